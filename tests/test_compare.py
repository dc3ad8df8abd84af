"""``requant compare``: tensor by tensor, as ONNX Runtime's int8 kernels compute the quantized model."""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import requant
import requant.api
from requant.report.compare import CompareError, compare
from tests.host import PAIRS_SATURATE

DIGITS = Path(__file__).parent.parent / "examples" / "digits"
FLOAT = DIGITS / "digits_cnn.onnx"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("compare")
    made = {}
    for target in ("onnxruntime-cpu", "onnxruntime-cpu-vnni"):
        made[target] = folder / f"{target}.onnx"
        requant.api.quantize(FLOAT, DIGITS / "calib.npz", target=target, output=made[target], measure=False)
    return made


def test_every_quantized_tensor_is_compared_with_its_float_twin(outputs: dict[str, Path]) -> None:
    results = compare(FLOAT, outputs["onnxruntime-cpu"], DIGITS / "eval.npz")
    assert [r.to_json() for r in requant.compare(FLOAT, outputs["onnxruntime-cpu"], DIGITS / "eval.npz")] == [
        r.to_json() for r in results
    ]  # the package's door, the same
    by_name = {r.name: r for r in results}
    # the logits are not quantized: the Gemm's output is only the model's (QGemm writes it in float)
    assert set(by_name) == {"x", "relu", "max_pool2d", "_unsafe_view", "relu_1"}
    assert [r.sqnr_db for r in results] == sorted(r.sqnr_db for r in results)  # worst first
    x = by_name["x"]  # the input's own rounding: half a step at most, uniform error (SQNR ~ 6.02 * 8 + ...)
    assert (
        x.max_error <= 0.5 * 0.003922 + 1e-6 and x.sqnr_db > 50 and x.quantized_as.startswith("uint8, scale 0.003922")
    )
    assert all(30 < r.sqnr_db < 60 and r.cosine > 0.999 for r in results)
    assert by_name["relu"].sources == ["x"] and by_name["relu"].own_loss_db == pytest.approx(
        x.sqnr_db - by_name["relu"].sqnr_db
    )


def test_it_sees_what_the_int8_kernels_compute_saturation_included(outputs: dict[str, Path]) -> None:
    """Full-range int8 weights (the VNNI target) on a CPU without VNNI: the first conv's int16 pairs
    saturate; with VNNI they are exact, and round less than the pair-safe weights."""
    exact = {r.name: r for r in compare(FLOAT, outputs["onnxruntime-cpu"], DIGITS / "eval.npz", samples=100)}
    saturated = {r.name: r for r in compare(FLOAT, outputs["onnxruntime-cpu-vnni"], DIGITS / "eval.npz", samples=100)}
    assert saturated["x"].sqnr_db == pytest.approx(exact["x"].sqnr_db)  # the same input rounding
    if PAIRS_SATURATE:
        assert saturated["relu"].sqnr_db < exact["relu"].sqnr_db - 20  # measured: 14.9 against 41.2 dB
        assert saturated["relu"].own_loss_db > 30
    else:
        assert saturated["relu"].sqnr_db > exact["relu"].sqnr_db - 1  # measured (AVX512-VNNI): 41.9 against 41.2 dB
        assert saturated["relu"].own_loss_db < exact["relu"].own_loss_db + 1


def test_the_cli_prints_the_worst_tensors_and_where_the_error_grows(outputs: dict[str, Path]) -> None:
    command = [sys.executable, "-m", "requant", "compare", str(FLOAT), str(outputs["onnxruntime-cpu-vnni"]),
               "--data", str(DIGITS / "eval.npz"), "--samples", "50"]  # fmt: skip
    text = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    assert text.startswith("5 tensors compared, worst SQNR first:")
    assert "the error grows most at 'relu':" in text and "below 'x'" in text
    as_json = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, check=True).stdout)
    assert {"name", "sqnr_db", "cosine", "max_error", "own_loss_db", "sources", "quantized_as"} <= set(as_json[0])
    assert all(math.isfinite(t["sqnr_db"]) for t in as_json)


def test_models_with_nothing_in_common_are_refused() -> None:
    with pytest.raises(CompareError, match="quantizes no tensor the float model computes"):
        compare(FLOAT, FLOAT, DIGITS / "eval.npz")
    bad = subprocess.run([sys.executable, "-m", "requant", "compare", str(FLOAT), str(FLOAT), "--data",
                          str(DIGITS / "eval.npz")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.startswith("requant compare: error: the quantized model quantizes no")


def test_another_tools_qdq_model_is_compared_too(tmp_path: Path) -> None:
    """ONNX Runtime's quantize_static names its tensors its own way; the QuantizeLinear inputs still match."""
    import numpy as np
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    with np.load(DIGITS / "calib.npz") as archive:
        rows = [{"x": archive["x"][i : i + 1]} for i in range(64)]

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.rows = iter(rows)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.rows, None)

    out = tmp_path / "ort.onnx"
    quantize_static(str(FLOAT), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8)  # fmt: skip
    results = {r.name: r for r in compare(FLOAT, out, DIGITS / "eval.npz", samples=100)}
    # the logits too: quantize_static renames the graph output's float value NAME_QuantizeLinear_Input
    (output,) = (o.name for o in onnx.load(FLOAT).graph.output)
    assert {"x", "relu", "relu_1", output} <= set(results)
    assert all(math.isfinite(r.sqnr_db) and r.sqnr_db > 10 for r in results.values())
    assert results[output].sources == ["clone_1"] and results[output].quantized_as.startswith("uint8")  # 40.0 dB


def test_the_page_shows_each_tensors_sqnr_in_graph_order(outputs: dict[str, Path], tmp_path: Path) -> None:
    page = tmp_path / "compare.html"
    command = [sys.executable, "-m", "requant", "compare", str(FLOAT), str(outputs["onnxruntime-cpu"]),
               "--data", str(DIGITS / "eval.npz"), "--samples", "50", "--html", str(page)]  # fmt: skip
    subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    text = html.unescape(page.read_text())
    assert text.startswith("<!DOCTYPE html>") and text.count("<svg") == 1 and "</html>" in text
    results = compare(FLOAT, outputs["onnxruntime-cpu"], DIGITS / "eval.npz", samples=50)
    assert sorted(r.position for r in results) == list(range(5))  # each tensor's place in the graph
    assert min(results, key=lambda r: r.position).name == "x"  # the input is quantized first
    worst = results[0]
    assert f"5 tensors compared; worst {worst.name!r} at {worst.sqnr_db:.1f} dB" in text
    assert text.count("<tr>") == 1 + 5  # the header and every tensor (at most 30)
    again = tmp_path / "again.html"
    subprocess.run([*command[:-1], str(again)], capture_output=True, text=True, timeout=120, check=True)
    assert again.read_bytes() == page.read_bytes()  # the same comparison, the same bytes
    taken = subprocess.run([*command[:-1], str(FLOAT)], capture_output=True, text=True, timeout=120)
    assert taken.returncode != 0 and "--html" in taken.stderr  # never over an input


def test_the_report_compares_every_tensor_when_it_has_evaluation_data() -> None:
    with_eval = requant.api.quantize(FLOAT, DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz", measure=False)
    tensors = {t["name"]: t for t in with_eval.report["tensors"]}
    assert set(tensors) == {"x", "relu", "max_pool2d", "_unsafe_view", "relu_1"}
    alone = {r.name: r for r in compare(FLOAT, with_eval.model, DIGITS / "eval.npz", samples=16)}  # requant compare
    assert set(alone) == set(tensors)  # the same records, up to float sums' order (two sessions' threads)
    assert all(tensors[n]["sqnr_db"] == pytest.approx(r.sqnr_db, abs=1e-3) for n, r in alone.items())
    without = requant.api.quantize(FLOAT, DIGITS / "calib.npz", measure=False)
    assert "tensors" not in without.report


def _per_channel_add(tmp_path: Path) -> tuple[Path, Path, Path]:
    """NNCF's shape on PP-OCR's detector: an int8 Conv, an Add of its output and the Conv's input, the sum
    quantized per channel. ONNX Runtime 1.31 loads it, but with the Conv's quantized output also a graph output
    it fuses the Add with that per-channel QuantizeLinear into a QLinearAdd and refuses it."""
    import numpy as np
    import onnx
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper as nh

    weight = np.random.default_rng(0).integers(-50, 50, (4, 4, 1, 1)).astype(np.int8)
    arrays = {"s": np.float32(0.05), "z": np.int8(0), "sw": np.float32(0.02), "zw": np.int8(0), "w": weight,
              "sc": np.float32([0.1, 0.2, 0.3, 0.4]), "zc": np.zeros(4, np.int8)}  # fmt: skip
    q = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]), h.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
         h.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"]), h.make_node("Conv", ["xd", "wd"], ["c"]),
         h.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"]), h.make_node("DequantizeLinear", ["cq", "s", "z"], ["cd"]),
         h.make_node("Add", ["cd", "xd"], ["a"], name="add"),
         h.make_node("QuantizeLinear", ["a", "sc", "zc"], ["aq"], axis=1),
         h.make_node("DequantizeLinear", ["aq", "sc", "zc"], ["y"], axis=1)]  # fmt: skip
    f = [h.make_node("Conv", ["x", "wf"], ["c"]), h.make_node("Add", ["c", "x"], ["a"])]
    io = ([h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
          [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])])  # fmt: skip
    paths = tmp_path / "q.onnx", tmp_path / "f.onnx", tmp_path / "data.npz"
    inits = [nh.from_array(np.asarray(v), k) for k, v in arrays.items()]
    onnx.save(
        h.make_model(h.make_graph(q, "q", *io, inits), opset_imports=[h.make_opsetid("", 13)], ir_version=8), paths[0]
    )
    wf = nh.from_array(weight.astype(np.float32) * 0.02, "wf")
    out = [h.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4, 8, 8])]
    floats = h.make_graph(f, "f", io[0], out, [wf])
    onnx.save(h.make_model(floats, opset_imports=[h.make_opsetid("", 13)], ir_version=8), paths[1])
    np.savez(paths[2], x=np.random.default_rng(1).uniform(-3, 3, (1, 4, 8, 8)).astype(np.float32))
    return paths


def test_a_model_onnx_runtime_refuses_with_its_values_exposed_is_compared_unfused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quantized, floats, data = _per_channel_add(tmp_path)
    import onnx
    import onnxruntime as ort

    ort.InferenceSession(str(quantized))  # loads as given
    exposed = onnx.load(quantized)
    exposed.graph.output.append(onnx.ValueInfoProto(name="cq"))
    with pytest.raises(Exception, match="Scale and Zero-point must be a scalar"):
        ort.InferenceSession(exposed.SerializeToString())  # what compare met on NNCF's PP-OCR model
    results = {r.name: r for r in compare(floats, quantized, data)}
    assert set(results) == {"x", "c", "a"} and all(r.sqnr_db > 15 for r in results.values())
    assert "QDQ fusions off" in caplog.text
