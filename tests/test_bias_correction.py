"""Bias correction gives back the mean shift that quantizing a kernel's weights and input caused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant.api
import requant.calibration.data
import requant.calibration.moments
import requant.encoding.rounding
import requant.stages.convert
import requant.transforms.bias_correction
from requant.quantizers import DEFAULT_PRESET, PRESETS, Quantizer

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


def _gemm(rng: np.random.Generator) -> onnx.ModelProto:
    proto = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["" : 21]> g (float[N,256] x) => (float[N,16] y) { y = Gemm(x, w, b) }'
    )
    weight = rng.standard_normal((256, 16)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    proto.graph.initializer.extend([onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(bias, "b")])
    return proto


def _mean_error(model: ir.Model, x: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, float]:
    """The mean output error per channel, and one step of 8 bits over the output's range (the Gemm's
    output is only the model's: QGemm writes it in float, so the yardstick is what uint8 would step)."""
    proto = ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    return (y - expected).mean(axis=0), float(np.ptp(expected)) / 255


def test_the_mean_shift_of_each_output_channel_is_given_back() -> None:
    """Inputs far from zero turn each channel's weight rounding errors into a mean output shift.

    256 inputs in [2, 3]: per channel the shift is sum_k dw_k * 2.5, of the order of the output's
    scale. Corrected on 64 samples, what remains on 512 other samples is estimation noise.
    """
    rng = np.random.default_rng(0)
    proto = _gemm(rng)
    calib = rng.uniform(2, 3, (64, 256)).astype(np.float32)
    x = rng.uniform(2, 3, (512, 256)).astype(np.float32)
    weights = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in proto.graph.initializer}
    expected = (x.astype(np.float64) @ weights["w"] + weights["b"]).astype(np.float32)
    data = [{"x": calib[i : i + 1]} for i in range(len(calib))]
    quantizer = Quantizer().set_global(PRESETS[DEFAULT_PRESET])

    plain = requant.api.quantize(proto, data, quantizer=quantizer, measure=False, bias_correction=False)
    corrected = requant.api.quantize(proto, data, quantizer=quantizer, measure=False)
    before, y_scale = _mean_error(plain.model, x, expected)
    after, _ = _mean_error(corrected.model, x, expected)

    assert np.abs(before).max() > y_scale / 4  # the shift is there to correct
    assert np.abs(after).max() < np.abs(before).max() / 4
    assert np.abs(after).max() < y_scale / 8
    (kernel,) = corrected.report["bias_correction"]["kernels"]
    assert kernel["channels"] == 16 and np.isclose(kernel["max_shift"], np.abs(before).max(), rtol=0.2)
    assert plain.report["bias_correction"] == {"enabled": False, "kernels": []}
    # only the bias changed, and it stays int32 on the same scale
    inits = [{t.name: t for t in ir.to_proto(r.model).graph.initializer} for r in (plain, corrected)]
    changed = {n for n in inits[0] if inits[0][n].SerializeToString() != inits[1][n].SerializeToString()}
    assert changed == {"b_quantized"}


def test_the_bundled_model_gets_closer_to_float_and_stays_deterministic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # weights rounded to nearest: with error feedback (the default) the digits' kernels shift their
    # outputs' means too little for the correction to gain on the held-out samples (41.1 -> 40.9 dB)
    monkeypatch.setattr(requant.calibration.moments, "MAX_REDUCTION", 0)
    runs = {}
    for flag in (False, True, True):
        result = requant.api.quantize(
            DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz", bias_correction=flag
        )
        runs.setdefault(flag, []).append(result)
    sqnr = {flag: r[0].report["evaluation"]["sqnr_db"] for flag, r in runs.items()}
    assert sqnr[True] > sqnr[False]  # measured: 40.4 -> 41.0 dB
    assert len(runs[True][0].report["bias_correction"]["kernels"]) == 3  # two convs and the Gemm
    first, second = (ir.to_proto(r.model).SerializeToString() for r in runs[True])
    assert first == second
    assert "bias correction: 3 kernels" in runs[True][0].report["summary"]


def test_kernels_below_an_sqnr_threshold_are_kept_float() -> None:
    """Each int8 kernel's SQNR against float is in the report; below ``keep_float_below`` it computes in float."""
    plain = requant.api.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", measure=False)
    measured = {k["node"]: k["sqnr_db"] for k in plain.report["bias_correction"]["kernels"]}
    assert set(measured) == {"node_conv2d", "node_conv2d_1", "node_linear"}
    assert all(30 < db < 60 for db in measured.values())  # measured: 40.9, 43.6 and 52.7 dB
    worst = min(measured, key=measured.__getitem__)
    assert worst == "node_conv2d_1"

    # a threshold below every kernel changes nothing
    same = requant.api.quantize(
        DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", measure=False, keep_float_below=min(measured.values()) - 1
    )
    assert ir.to_proto(same.model).SerializeToString() == ir.to_proto(plain.model).SerializeToString()
    assert same.report["kept_float_below"]["kernels"] == []

    kept = requant.api.quantize(
        DIGITS / "digits_cnn.onnx",
        DIGITS / "calib.npz",
        measure=False,
        keep_float_below=measured[worst] + 0.01,
        eval_data=DIGITS / "eval.npz",
    )
    report = kept.report
    assert report["kept_float_below"] == {
        "threshold_db": measured[worst] + 0.01,
        "kernels": [{"node": worst, "sqnr_db": measured[worst]}],
    }
    # the kernel reads float, so the Conv+Relu before it, whose output it reads, is float too (by
    # decision, with the reason); the classifier stays int8; lint reports no accident
    assert report["lint"]["int8_kernels"] == {"QGemm": 1}
    assert report["lint"]["asked_to_be_quantized_but_float"] == []
    nodes = {n.name: n for n in kept.model.graph}
    assert nodes["node_conv2d"].metadata_props["requant.kept_float"] == "its output relu is read in float"
    assert nodes[worst].inputs[1].const_value is not None  # float weights, read directly
    assert "kept float (SQNR below" in report["summary"] and worst in report["summary"]
    assert report["evaluation"]["top1_agreement"] > 0.99


def test_a_second_calibration_reuses_the_statistics_of_the_first() -> None:
    """keep_float_below's second pass does not run the data again for what the first observed."""
    from requant.api import calibrate, prepare
    from requant.calibration.calibrate import StatisticsCache

    cache = StatisticsCache()
    first, _ = prepare(DIGITS / "digits_cnn.onnx")
    chosen = calibrate(first, DIGITS / "calib.npz", cache=cache)
    second, _ = prepare(DIGITS / "digits_cnn.onnx")
    again = calibrate(second, [], cache=cache)  # an empty data set: an error, were it read
    assert [c.__dict__ for c in again] == [c.__dict__ for c in chosen]
    assert cache.samples == 1347


def test_other_methods_are_observed_in_the_same_pass() -> None:
    """method="auto"'s candidates share one pass over the data: a calibration with a method observed
    ``also`` runs nothing, and gives what calibrating with that method alone gives."""
    from requant.api import calibrate, prepare
    from requant.calibration.calibrate import StatisticsCache

    cache = StatisticsCache()
    first, _ = prepare(DIGITS / "digits_cnn.onnx")
    calibrate(first, DIGITS / "calib.npz", method="minmax", cache=cache, also=("mean_minmax",))
    second, _ = prepare(DIGITS / "digits_cnn.onnx")
    shared = calibrate(second, [], method="mean_minmax", cache=cache)  # an empty data set: an error, were it read
    alone, _ = prepare(DIGITS / "digits_cnn.onnx")
    expected = calibrate(alone, DIGITS / "calib.npz", method="mean_minmax")
    assert [c.__dict__ for c in shared] == [c.__dict__ for c in expected]
    assert {c.observer for c in shared if c.kind == "activation"} == {"mean_minmax", "minmax"}  # (edges: minmax)


def test_large_inputs_are_measured_on_fewer_samples() -> None:
    """The means are over samples and positions: 64 images' worth of values, at least 8 samples."""
    from requant.calibration.data import samples_for

    image = 3 * 224 * 224
    assert samples_for(64, 64) == 64 and samples_for(image, 64) == 64 and samples_for(image, 20) == 20
    assert (
        samples_for(4 * image, 64) == 16 and samples_for(3 * 736 * 992, 64) == 8 and samples_for(100 * image, 64) == 8
    )
    assert samples_for(100 * image, 5) == 5  # never more than there are


@pytest.mark.parametrize("sqnr_values", [None, 1])
def test_the_shift_and_sqnr_are_those_of_every_row_and_position(
    sqnr_values: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe reduces each kernel's outputs in the graph (sums per channel, sums of squares, element
    counts): on samples of different batch sizes the measured mean shift and local SQNR are those of
    all rows and positions together, as NumPy computes them from the quantized model's integers. With
    ``SQNR_VALUES`` at 1 (and no minimum of samples), this pointwise conv is measured against its float
    version on the first sample only (its SQNR is that sample's) and its shift on the next two comes
    from its inputs' sums."""
    if sqnr_values is not None:
        monkeypatch.setattr(requant.transforms.bias_correction, "SQNR_VALUES", sqnr_values)
        monkeypatch.setattr(requant.calibration.data, "MIN_SAMPLES", 1)
    rng = np.random.default_rng(1)
    proto = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["" : 21]> g (float[N,4,5,5] x) => (float[N,8,5,5] y) { y = Conv(x, w, b) }'
    )
    weight = rng.standard_normal((8, 4, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    proto.graph.initializer.extend([onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(bias, "b")])
    data = [{"x": rng.uniform(1, 3, (rows, 4, 5, 5)).astype(np.float32)} for rows in (1, 3, 2)]
    quantizer = Quantizer().set_global(PRESETS[DEFAULT_PRESET])
    plain = ir.to_proto(
        requant.api.quantize(proto, data, quantizer=quantizer, measure=False, bias_correction=False).model
    )
    report = requant.api.quantize(proto, data, quantizer=quantizer, measure=False).report
    (kernel,) = report["bias_correction"]["kernels"]

    inits = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in plain.graph.initializer}
    nodes = {o: n for n in plain.graph.node for o in n.output}
    conv = next(n for n in plain.graph.node if n.op_type == "Conv")
    dq_x, dq_w, dq_b = (nodes[i] for i in conv.input)

    def dequantized(dq: onnx.NodeProto, q: np.ndarray) -> np.ndarray:
        scale, zero = inits[dq.input[1]], inits[dq.input[2]] if len(dq.input) > 2 else 0.0
        shape = (-1,) + (1,) * (q.ndim - 1) if np.ndim(scale) else ()
        return (q - np.reshape(zero, shape)) * np.reshape(scale, shape)

    w_q, b_q = dequantized(dq_w, inits[dq_w.input[0]]), dequantized(dq_b, inits[dq_b.input[0]])
    x_scale, x_zero = inits[dq_x.input[1]], inits[dq_x.input[2]]
    diffs, floats = [], []
    for sample in data:
        x = sample["x"].astype(np.float64)
        x_q = (np.clip(np.rint(x / x_scale) + x_zero, 0, 255) - x_zero) * x_scale
        quantized = np.einsum("nchw,oc->nohw", x_q, w_q[:, :, 0, 0]) + b_q[None, :, None, None]
        reference = np.einsum("nchw,oc->nohw", x, weight[:, :, 0, 0].astype(np.float64)) + bias[None, :, None, None]
        diffs.append(quantized - reference)
        floats.append(reference)
    diff = np.concatenate(diffs)
    shift = np.abs(diff.mean(axis=(0, 2, 3)))
    first = 3 if sqnr_values is None else 1  # the samples the SQNR is measured on
    sqnr = 10 * np.log10(np.sum(np.concatenate(floats[:first]) ** 2) / np.sum(np.concatenate(diffs[:first]) ** 2))
    assert kernel["samples"] == 3 and kernel["channels"] == 8 and kernel["sqnr_samples"] == first
    assert np.isclose(kernel["mean_shift"], shift.mean(), rtol=1e-3) and np.isclose(
        kernel["max_shift"], shift.max(), rtol=1e-3
    )
    assert np.isclose(kernel["sqnr_db"], sqnr, atol=0.01)


def test_a_grouped_pointwise_convs_shift_from_its_inputs_sums_is_the_one_measured_against_float(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pointwise conv's mean shift is ``W_q sum(x_q) - W sum(x)`` plus the biases' difference per
    position, taken group by group: from its inputs' sums after the first sample, the corrected biases
    are those of measuring it against its float version on every sample, up to float rounding (one
    step of the int32 bias), while the 3x3 conv beside it is measured in full either way."""
    rng = np.random.default_rng(3)
    proto = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["" : 21]> g (float[N,4,6,6] x) => (float[N,8,6,6] y, float[N,3,6,6] z) '
        "{ y = Conv <group: int = 2> (x, w, b)  z = Conv <pads: ints = [1, 1, 1, 1]> (x, v, c) }"
    )
    arrays = {
        "w": rng.standard_normal((8, 2, 1, 1)),
        "b": rng.standard_normal(8),
        "v": rng.standard_normal((3, 4, 3, 3)),
        "c": rng.standard_normal(3),
    }
    proto.graph.initializer.extend(onnx.numpy_helper.from_array(a.astype(np.float32), n) for n, a in arrays.items())
    # inputs off-centre: every kernel's mean shift is well above float rounding
    data = [{"x": rng.uniform(0.5, 3, (rows, 4, 6, 6)).astype(np.float32)} for rows in (2, 1, 3, 2)]
    quantizer = Quantizer().set_global(PRESETS[DEFAULT_PRESET])

    monkeypatch.setattr(requant.calibration.data, "MIN_SAMPLES", 1)

    def measured(values: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        monkeypatch.setattr(requant.transforms.bias_correction, "SQNR_VALUES", values)
        result = requant.api.quantize(proto, data, quantizer=quantizer, method="minmax", measure=False)
        inits = ir.to_proto(result.model).graph.initializer
        biases = {t.name: onnx.numpy_helper.to_array(t) for t in inits if t.name in ("b_quantized", "c_quantized")}
        return biases, {k["node"]: k for k in result.report["bias_correction"]["kernels"]}

    full, full_kernels = measured(1 << 40)
    sums, sum_kernels = measured(1)
    assert full.keys() == sums.keys() and len(full) == 2
    for name in full:
        assert np.abs(full[name].astype(np.int64) - sums[name]).max() <= 1, name
    assert {k["sqnr_samples"] for k in full_kernels.values()} == {4}
    assert sorted(k["sqnr_samples"] for k in sum_kernels.values()) == [1, 4]  # the pointwise one: the first only
    for node, kernel in full_kernels.items():
        assert kernel["mean_shift"] > 1e-3
        assert np.isclose(sum_kernels[node]["mean_shift"], kernel["mean_shift"], rtol=1e-4)
        assert np.isclose(sum_kernels[node]["max_shift"], kernel["max_shift"], rtol=1e-4)


def test_a_pass_started_from_an_earlier_ones_sums_runs_only_the_samples_after() -> None:
    """method="auto" corrects the chosen candidate starting from what its sketch measured on the first
    samples: the same biases, bit for bit, as one pass from the start, and only the rest is run."""
    from requant.api import calibrate, prepare
    from requant.stages.convert import stage as _stage
    from requant.targets.registry import get_target
    from requant.transforms.bias_correction import BiasSums, correct_biases

    model, _ = prepare(DIGITS / "digits_cnn.onnx")
    calibrate(model, DIGITS / "calib.npz")
    staged = _stage(model, get_target("onnxruntime-cpu"), True)
    with np.load(DIGITS / "calib.npz") as npz:
        key = npz.files[0]
        samples = [{key: npz[key][i : i + 1]} for i in range(20)]

    def biases(m: ir.Model) -> dict[str, bytes]:
        return {t.name: t.SerializeToString() for t in ir.to_proto(m).graph.initializer if t.data_type == 6}

    whole = staged.model.clone()
    expected = correct_biases(whole, staged.floats, samples, 20)
    sums = BiasSums()
    correct_biases(staged.model.clone(), staged.floats, samples, 8, sums=sums)
    assert sums.samples == 8 and len(sums.sums) == 3
    runs: list[int] = []
    resumed = staged.model.clone()
    got = correct_biases(resumed, staged.floats, samples, 20, lambda done, elapsed: runs.append(done), sums=sums)
    assert max(runs) == 12 and sums.samples == 20  # samples 9 to 20 only
    assert biases(resumed) == biases(whole) and biases(whole) != biases(staged.model)
    assert [k.__dict__ for k in got] == [k.__dict__ for k in expected]
    # sums of another model (here: none of its kernels) are not a start: a pass from the beginning
    other = BiasSums(8, {"elsewhere": sums.sums[next(iter(sums.sums))]})
    again = staged.model.clone()
    correct_biases(again, staged.floats, samples, 20, sums=other)
    assert biases(again) == biases(whole) and other.samples == 20


def _off_by(steps: int, real: Any) -> Any:
    """``correct_biases`` that, after correcting, moves every int32 bias ``steps`` steps further: a
    correction gone wrong."""

    def wrong(model: ir.Model, *args: object, **kwargs: object) -> object:
        done = real(model, *args, **kwargs)
        for node in model.graph:
            if node.op_type == "DequantizeLinear" and node.inputs[0] is not None:
                stored = node.inputs[0].const_value
                if stored is not None and stored.dtype == ir.DataType.INT32:
                    node.inputs[0].const_value = ir.tensor(stored.numpy() + steps, name=node.inputs[0].name)
        return done

    return wrong


def test_auto_keeps_a_bias_correction_only_where_it_brings_the_output_closer(monkeypatch: pytest.MonkeyPatch) -> None:
    # a correction that pushes every int8 bias 300 steps off: the held-out samples show it worse than
    # none, and the model is the one without correction (each kernel still measured, none corrected)
    with np.load(DIGITS / "calib.npz") as data:
        samples = {"x": data["x"][:200]}
    plain = requant.api.quantize(DIGITS / "digits_cnn.onnx", samples, measure=False, bias_correction=False)
    helped = requant.api.quantize(DIGITS / "digits_cnn.onnx", samples, measure=False)
    assert helped.report["method_choice"]["bias_correction_kept"] is True
    assert (
        helped.report["method_choice"]["corrected_sqnr_db"]
        >= helped.report["method_choice"]["uncorrected_sqnr_db"][helped.report["method_choice"]["chosen"]]
    )
    monkeypatch.setattr(requant.stages.convert, "correct_biases", _off_by(300, requant.stages.convert.correct_biases))
    hurt = requant.api.quantize(DIGITS / "digits_cnn.onnx", samples, measure=False)
    choice = hurt.report["method_choice"]
    assert choice["bias_correction_kept"] is False
    assert choice["corrected_sqnr_db"] < choice["uncorrected_sqnr_db"][choice["chosen"]]
    kernels = hurt.report["bias_correction"]["kernels"]
    assert kernels and not any(k["corrected"] for k in kernels)  # measured (local SQNRs), not applied
    assert ir.to_proto(hurt.model).SerializeToString() == ir.to_proto(plain.model).SerializeToString()
    assert "bias correction not applied: it moved the output further from float" in hurt.report["summary"]


def test_a_second_pass_does_not_apply_a_correction_auto_found_harmful(monkeypatch: pytest.MonkeyPatch) -> None:
    # --keep-float-below quantizes again with auto's method: without auto's held-out samples, it must
    # not bring back the correction auto dropped
    with np.load(DIGITS / "calib.npz") as data:
        samples = {"x": data["x"][:200]}
    monkeypatch.setattr(requant.stages.convert, "correct_biases", _off_by(300, requant.stages.convert.correct_biases))
    monkeypatch.setattr(requant.calibration.moments, "MAX_REDUCTION", 0)  # a kernel below 39 dB: nearest
    result = requant.api.quantize(DIGITS / "digits_cnn.onnx", samples, measure=False, keep_float_below=39)
    assert len(result.report["bias_correction"]["kernels"]) == 2  # measured in the second pass, one kept float
    assert result.report["method_choice"]["bias_correction_kept"] is False
    assert result.report["kept_float_below"]["kernels"]  # a second pass ran
    assert not any(k["corrected"] for k in result.report["bias_correction"]["kernels"])
