"""LSTMs on ONNX Runtime: ``DynamicQuantizeLSTM`` with weights proven not to saturate on CPUs
without VNNI; GRU and RNN stay float with the reason.

The real model is a bidirectional LSTM trained on scikit-learn's digits (rows as a sequence),
quantized through the PyTorch front door. The adversarial one has weights whose full-range int8
pairs leave int16 for inputs at the top of their range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import requant
from requant.report.lint import lint
from tests.host import PAIRS_SATURATE
from tests.models.digits import digits_split, train_digits_lstm

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def digits_lstm() -> tuple[Any, np.ndarray, dict[str, np.ndarray]]:
    net, accuracy = train_digits_lstm()
    assert accuracy > 0.95
    x_train, _, x_test, y_test = digits_split()
    return net, x_train[:200], {"x": x_test, "labels": y_test}


def _run(model: Any, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def test_a_trained_lstm_runs_as_dynamicquantizelstm(digits_lstm: tuple[Any, np.ndarray, dict[str, Any]]) -> None:
    net, calibration, evaluation_data = digits_lstm  # a dict with labels, as an .npz would have them
    example = (torch.from_numpy(evaluation_data["x"][:1]),)
    quantized = requant.quantize(
        net, {"x": calibration}, eval_data=evaluation_data, measure=False, example_inputs=example
    )
    ops = [n.op_type for n in quantized.model.graph]
    assert "DynamicQuantizeLSTM" in ops and "LSTM" not in ops
    lstm = next(n for n in quantized.model.graph if n.op_type == "DynamicQuantizeLSTM")
    assert lstm.domain == "com.microsoft" and quantized.model.opset_imports["com.microsoft"] == 1
    w, r = (lstm.inputs[i] for i in (1, 2))
    assert w is not None and r is not None and w.const_value is not None and r.const_value is not None
    # transposed for the kernel: [directions, size, 4 x hidden]; 8-bit, a scale per direction and gate row
    assert tuple(w.const_value.shape) == (2, 8, 128) and tuple(r.const_value.shape) == (2, 32, 128)
    assert w.const_value.dtype in (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
    scale = lstm.inputs[8]
    assert scale is not None and scale.const_value is not None and tuple(scale.const_value.shape) == (2, 128)
    evaluation = quantized.report["evaluation"]
    assert evaluation["int8_accuracy"] >= evaluation["float_accuracy"] - 0.01
    assert evaluation["top1_agreement"] >= 0.98
    assert quantized.report["lint"]["int8_kernels"]["DynamicQuantizeLSTM"] == 1
    encodings = [k for k in quantized.report["weight_encoding"]["kernels"] if k["node"] == lstm.name]
    assert len(encodings) == 2 and all(k["margin"] >= 0 for k in encodings)


def _adversarial_lstm(steps: int = 4, size: int = 16, hidden: int = 8, layout: int = 0, op: str = "LSTM") -> Any:
    """An LSTM whose gate rows have pairs of large same-sign weights: full-range int8 weights
    saturate in int16 for inputs near the top of the uint8 range."""
    rng = np.random.default_rng(3)
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    w = rng.normal(0, 0.05, (1, gates * hidden, size)).astype(np.float32)
    w[:, :, 0:4] = 0.25 * np.sign(rng.normal(size=(1, gates * hidden, 1)))  # two saturating pairs per row
    r = rng.normal(0, 0.1, (1, gates * hidden, hidden)).astype(np.float32)
    shape, out = ([1, steps, size], [1, steps, 1, hidden]) if layout else ([steps, 1, size], [steps, 1, 1, hidden])
    attributes: dict[str, Any] = {"hidden_size": hidden}
    if layout:
        attributes["layout"] = layout
    node = helper.make_node(op, ["x", "w", "r"], ["y"], **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(r, "r")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def test_lstm_weights_are_encoded_so_no_pair_saturates_without_vnni(tmp_path: Path) -> None:
    model = _adversarial_lstm()
    # one run a sample: the LSTM's input [4, 1, 16] has no batch axis of its own (a dict of stacked arrays
    # cannot feed it; nothing read the samples before every output was checked against float)
    runs = np.random.default_rng(0).uniform(0, 1, (16, 4, 1, 16)).astype(np.float32)
    calibration = [{"x": run} for run in runs]
    exact = requant.quantize(model, calibration, measure=False)
    full = requant.quantize(model, calibration, target="onnxruntime-cpu-vnni", measure=False)
    by_weight = {k["weight"]: k for k in exact.report["weight_encoding"]["kernels"]}
    assert by_weight["w"]["encoding"] == "pair-safe" and by_weight["w"]["margin"] >= 0
    assert tuple(by_weight["w"]["input_range"]) == (0, 255)  # quantized by the kernel over each run's range
    vnni = {k["weight"]: k for k in full.report["weight_encoding"]["kernels"]}
    assert vnni["w"]["encoding"] == "full range"  # exact with VNNI; lint below shows it can saturate here
    for kind, quantized in (("exact", exact), ("full", full)):
        quantized.save(tmp_path / f"{kind}.onnx")
    x = np.random.default_rng(99).uniform(0.9, 1.0, (4, 1, 16)).astype(np.float32)  # near the top: worst pairs
    reference = _run(model, x)
    error_exact = np.abs(_run(str(tmp_path / "exact.onnx"), x) - reference).max()
    error_full = np.abs(_run(str(tmp_path / "full.onnx"), x) - reference).max()
    # the weights' rounding alone: a few steps of the widest row scale through the gates
    assert error_exact < 0.02
    if PAIRS_SATURATE:
        assert error_full > 4 * error_exact  # full-range weights saturate on CPUs without VNNI
    else:
        assert error_full < 0.02  # with VNNI they are exact
    assert lint(onnx.load(tmp_path / "exact.onnx")).can_saturate == []
    assert [f.op_type for f in lint(onnx.load(tmp_path / "full.onnx")).can_saturate] == ["DynamicQuantizeLSTM"]


@pytest.mark.parametrize(
    ("op", "layout", "reason"),
    [
        ("GRU", 0, "ONNX Runtime 1.31 has no int8 GRU kernel"),
        ("RNN", 0, "ONNX Runtime 1.31 has no int8 RNN kernel"),
    ],
)
def test_recurrent_ops_without_an_int8_kernel_stay_float_with_the_reason(op: str, layout: int, reason: str) -> None:
    model = _adversarial_lstm(op=op, layout=layout)
    shape = (1, 4, 16) if layout else (4, 1, 16)
    calibration = [{"x": run} for run in np.random.default_rng(0).uniform(0, 1, (8, *shape)).astype(np.float32)]
    quantized = requant.quantize(model, calibration, measure=False)
    assert [n.op_type for n in quantized.model.graph] == [op]
    decisions = [d for q in quantized.report["quantizers"]["quantizers"] for d in q["decisions"]]
    assert any(d["status"] == "rejected" and reason in d["reason"] for d in decisions), decisions


def test_auto_takes_the_first_method_without_measuring_when_both_give_the_same_model() -> None:
    model = _adversarial_lstm(op="GRU")  # stays float: nothing to calibrate, so both methods agree
    calibration = [{"x": x} for x in np.random.default_rng(0).uniform(0, 1, (8, 4, 1, 16)).astype(np.float32)]
    quantized = requant.quantize(model, calibration, method="auto", measure=False)
    choice = quantized.report["method_choice"]
    assert choice == {
        "chosen": "minmax",
        "output_sqnr_db": {},
        "samples": 0,
        "held_out": 0,
        "why": "the candidates are the same model",
    }
    assert "method: auto -> minmax (the candidates are the same model)" in quantized.report["summary"]


def test_an_lstm_named_float_stays_float() -> None:
    # the LSTM's check rejected a float config ("an LSTM's int8 kernel only quantizes weights"), so the node went
    # unclaimed and the preset made it a DynamicQuantizeLSTM anyway: a user's float override was ignored
    from requant.quantizers import FLOAT, Quantizer

    model = _adversarial_lstm()
    model.graph.node[0].name = "lstm"
    calibration = [{"x": run} for run in np.random.default_rng(0).uniform(0, 1, (8, 4, 1, 16)).astype(np.float32)]
    quantizer = Quantizer().set_global_by_model().set_node_name("lstm", FLOAT)
    quantized = requant.quantize(model, calibration, quantizer=quantizer, measure=False)
    assert [n.op_type for n in quantized.model.graph] == ["LSTM"]
    x = calibration[0]["x"]
    assert np.array_equal(_run(ir.to_proto(quantized.model), x), _run(model, x))


def _spectrum_lstm(size: int = 32, hidden: int = 16) -> Any:
    """An LSTM reading a magnitude spectrum (channel k's range 100 e^(-k/4): the low bins dwarf the high ones, as
    DTLN's input does), then a linear layer: ``y = MatMul(Squeeze(LSTM(x)), w2)``."""
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.3, (1, 4 * hidden, size)).astype(np.float32) / np.exp(-np.arange(size) / 8).astype(np.float32)
    r = rng.normal(0, 0.2, (1, 4 * hidden, hidden)).astype(np.float32)
    nodes = [helper.make_node("LSTM", ["x", "w", "r"], ["h"], hidden_size=hidden),
             helper.make_node("Squeeze", ["h", "axes"], ["s"]), helper.make_node("MatMul", ["s", "w2"], ["y"])]  # fmt: skip
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(r, "r"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
             numpy_helper.from_array(rng.normal(0, 0.3, (hidden, 8)).astype(np.float32), "w2")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def test_an_lstm_reading_a_spectrum_is_smoothed_with_the_alpha_closest_for_its_int8_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Smoothing moves the spectrum's spread into the LSTM's input weights (a float Mul before it); ONNX Runtime's
    int8 LSTM quantizes its input over each run's own range, so the alpha is chosen by the product's error as that
    kernel computes it (``lstm_alpha``): here 0.5, 31.7 dB against float where the run's 0.8 gives 25.6 and no
    smoothing 3.9 (DTLN's mask stage: 33.5 dB unsmoothed, 33.7 at 0.8, 35.0 at the 0.5 chosen)."""
    import requant.transforms.smoothing as smoothing
    from requant.report.outputs import sqnr
    from requant.transforms.smoothing import LSTM_ALPHAS

    model = _spectrum_lstm()
    scale = (100 * np.exp(-np.arange(32) / 4)).astype(np.float32)
    runs = np.random.default_rng(0).uniform(0, 1, (80, 1, 1, 32)).astype(np.float32) * scale
    calibration, evaluation = [{"x": x} for x in runs[:64]], runs[64:]
    smoothed = requant.quantize(model, calibration, measure=False)
    plain = requant.quantize(model, calibration, smoothing=0, measure=False)
    monkeypatch.setattr(smoothing, "LSTM_ALPHAS", ())  # the run's alpha (0.8) alone
    fixed = requant.quantize(model, calibration, measure=False)
    (record,) = [r for r in smoothed.report["smoothing"]["inputs"] if r["input"] == "x"]
    assert record["applied"].startswith("Mul ") and record["alpha"] == 0.5 and 0.5 in LSTM_ALPHAS
    assert record["spread_before"] > 40 and record["spread_after"] < 10, record
    for quantized in (smoothed, plain):
        assert "DynamicQuantizeLSTM" in [n.op_type for n in quantized.model.graph]
    reference = np.concatenate([_run(model, x) for x in evaluation])
    closeness = {}
    for name, quantized in (("smoothed", smoothed), ("plain", plain), ("fixed", fixed)):
        proto = ir.to_proto(quantized.model)
        closeness[name] = sqnr(reference, np.concatenate([_run(proto, x) for x in evaluation]))
    assert closeness["smoothed"] > closeness["fixed"] > closeness["plain"] + 1.0, closeness
