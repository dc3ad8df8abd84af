"""Smoothing (SmoothQuant): outlier channels of a linear layer's input move into its weight.

The float model must compute the same numbers; the outlier input must come out flatter; the scale
is folded into a LayerNormalization when only the linear layers read it, and is a float Mul (kept
float by the quantizers) otherwise; and on a real transformer the int8 model must be closer to
float than without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.passes import get_passes, run_passes
from requant.report.html import to_html
from requant.report.markdown import to_markdown
from requant.transforms.smoothing import smooth_linears

# Channel 7 of x is 12x the others after the LayerNormalization (its gamma), and w1's last row feeds
# every output of a, so a's ReLU output h has no single outlier (its largest channel ~2x the median).
MLP = """<ir_version: 10, opset_import: ["" : 21]>
g (float[N, 8] x) => (float[N, 4] y) <float[8] gamma = {1., 1., 1., 1., 1., 1., 1., 12.},
    float[8] beta = {0., 0., 0., 0., 0., 0., 0., 0.5},
    float[8, 6] w1 = {1., 0., 0., 0., 0., 0., 0., 1., 0., 0., 0., 0., 0., 0., 1., 0., 0., 0., 0., 0., 0., 1., 0., 0.,
                      0., 0., 0., 0., 1., 0., 0., 0., 0., 0., 0., 1., 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5},
    float[6, 4] w2 = {1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15., 16., 17., 18., 19., 20., 21.,
                      22., 23., 24.}> {
  n = LayerNormalization <axis = -1> (x, gamma, beta)
  a = MatMul (n, w1)
  h = Relu (a)
  y = MatMul (h, w2)
}"""


def _model(text: str) -> ir.Model:
    model, _ = run_passes(load_onnx_text(text), get_passes("canonicalize"))
    return model


def _data(count: int = 32, channels: int = 8, seed: int = 0) -> list[dict[str, np.ndarray]]:
    x = np.random.default_rng(seed).normal(size=(count, 1, channels)).astype(np.float32)
    return [{"x": x[i]} for i in range(count)]


def _outputs(model: ir.Model, data: list[dict[str, np.ndarray]]) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, sample)[0] for sample in data])


def test_a_normalization_read_only_by_linear_layers_takes_the_scale_and_the_float_model_is_unchanged() -> None:
    model, data = _model(MLP), _data()
    before = _outputs(model, data)
    result = smooth_linears(model, data, alpha=0.8, min_spread=3.0)
    after = _outputs(model, data)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    by_input = {r.input: r for r in result.inputs}
    assert by_input["n"].applied == "folded into LayerNormalization 'node' (its scale and bias)"
    assert by_input["n"].spread_before > 6 and by_input["n"].spread_after < 2  # measured: 9.3 -> 1.5
    assert by_input["h"].applied is None and by_input["h"].skipped.startswith("its largest channel is 1.")
    assert result.muls == []
    text = print_model(model)
    assert "= Mul(" not in text and "%n: tensor<Nx8xf32> = LayerNormalization(%x, %gamma, %beta)" in text
    gamma = model.graph.initializers["gamma"].const_value.numpy()
    assert gamma[7] / gamma[0] < 12 / 3  # the outlier channel's scale went into w1's row 7


def test_an_input_read_by_others_too_gets_a_float_mul_that_the_quantizers_keep_float() -> None:
    # the same MLP, but y also adds n back (a residual): n must stay as it is for the Add
    text = MLP.replace("(float[N, 4] y)", "(float[N, 4] y, float[N, 8] r)").replace(
        "  y = MatMul (h, w2)\n", "  y = MatMul (h, w2)\n  r = Add (n, x)\n"
    )
    model, data = _model(text), _data()
    before = _outputs(model, data)
    result = smooth_linears(model, data, alpha=0.8, min_spread=3.0)
    np.testing.assert_allclose(_outputs(model, data), before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    (mul,) = result.muls
    assert (
        mul == "n/smooth"
        and {r.input: r.applied for r in result.inputs}["n"] == "Mul 'n/smooth' before the linear layers"
    )
    printed = print_model(model)
    assert "%n/smoothed: tensor<Nx8xf32> = Mul(%n, %n/smoothing)" in printed
    assert "MatMul(%n/smoothed, %w1)" in printed and "Add(%n, %x)" in printed
    # end to end: the Mul stays float, both linear layers run int8 with float outputs
    proto = ir.serde.serialize_model(_model(text))
    quantized = requant.quantize(proto, data, measure=False, progress=lambda done, total: None)
    decisions = [d for q in quantized.report["quantizers"]["quantizers"] for d in q["decisions"]]
    (kept,) = [d for d in decisions if d["nodes"] == ["n/smooth"] and d["status"] == "accepted"]
    assert set(kept["inputs"].values()) == {"#requant.float"} and kept["outputs"] == {}
    assert sum(quantized.report["lint"]["int8_kernels"].values()) == 2  # both MatMuls
    assert "smoothing (alpha 0.8): 1 linear-layer inputs (0 folded" in quantized.report["summary"]
    assert "<h2>Smoothing</h2>" in to_html(quantized.report) and "n/smooth" in to_html(quantized.report)
    page = to_markdown(quantized.report)
    assert "| `n` | `node_1` | Mul 'n/smooth' before the linear layers | 10.9 -> 1.4 |" in page
    assert "| `h` | `node_3` | not smoothed: its largest channel is 1.1x its median one" in page


def test_what_cannot_be_smoothed_is_left_with_the_reason() -> None:
    ones = ", ".join(["1."] * 64)
    shared = f"""<ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 8] x, float[N, 8] z) => (float[N, 8] y, float[N, 8] v) <float[8, 8] w = {{{ones}}}> {{
      y = MatMul (x, w)
      v = MatMul (z, w)
    }}"""
    model = _model(shared)
    data = [{"x": s["x"], "z": s["x"]} for s in _data()]
    result = smooth_linears(model, data)
    assert [r.skipped for r in result.inputs] == [
        "its weight 'w' is also read by node 'node_1'",
        "its weight 'w' is also read by node 'node'",
    ]
    conv = """<ir_version: 10, opset_import: ["" : 21]>
    g (float[1, 1, 4, 4] x) => (float[1, 1, 2, 2] y) <float[1, 1, 3, 3] w = {1., 1., 1., 1., 1., 1., 1., 1., 1.}> {
      y = Conv (x, w)
    }"""
    skipped = smooth_linears(_model(conv), [])
    assert skipped.inputs == [] and skipped.not_applied is not None
    assert skipped.not_applied.startswith("a convolutional model (1 convolutions, 0 linear layers)")


def test_the_alpha_is_checked_before_any_work() -> None:
    with pytest.raises(requant.RequantError, match=r"smoothing must be an alpha in \[0, 1\]"):
        requant.quantize(ir.serde.serialize_model(_model(MLP)), _data(), smoothing=1.5, measure=False)


def test_smoothing_brings_minilm_closer_to_float_and_gives_the_same_bytes() -> None:
    """all-MiniLM-L6-v2, 40 calibration / 40 evaluation sentences of the bench's. Measured on the
    bench's 200 / 298: cosine 0.9928 without, 0.9981 with (INT8_FLOAT_OUTPUTS, minmax)."""
    from tests.models.minilm import export_minilm

    model, samples = export_minilm(80)
    plain, at_08 = (
        requant.quantize(model, samples[:40], eval_data=samples[40:], smoothing=alpha, measure=False)
        for alpha in (0, 0.8)
    )
    again = requant.quantize(model, samples[:40], measure=False)  # the default: alpha 0.8, and no evaluation
    assert (
        ir.serde.serialize_model(again.model).SerializeToString()
        == ir.serde.serialize_model(at_08.model).SerializeToString()
    )
    plain, smoothed = plain.report, at_08.report
    assert plain["smoothing"]["inputs"] == [] and smoothed["smoothing"]["alpha"] == 0.8
    applied = [r for r in smoothed["smoothing"]["inputs"] if r["applied"]]
    assert len(applied) >= 18 and all(r["spread_after"] < r["spread_before"] for r in applied)
    assert smoothed["lint"]["int8_kernels"] == {"MatMulIntegerToFloat": 36}  # the Muls do not break a fusion
    assert smoothed["quantizers"]["preset_choice"].startswith("INT8_FLOAT_OUTPUTS")
    cos_plain, cos_smoothed = (r["evaluation"]["cosine_similarity"] for r in (plain, smoothed))
    # measured: 0.9930 -> 0.9979 (the error 3.3x smaller)
    assert cos_smoothed > 0.996 and (1 - cos_smoothed) < 0.5 * (1 - cos_plain), (cos_plain, cos_smoothed)


def test_the_cli_takes_an_alpha_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    import json

    from tests.test_quantize import run_cli

    text = MLP.replace("(float[N, 4] y)", "(float[N, 4] y, float[N, 8] r)").replace(
        "  y = MatMul (h, w2)\n", "  y = MatMul (h, w2)\n  r = Add (n, x)\n"
    )
    model, data = tmp_path / "mlp.onnx", tmp_path / "calib.npz"
    onnx.save(ir.serde.serialize_model(_model(text)), model)
    np.savez(data, x=np.concatenate([s["x"] for s in _data()]))
    for alpha, smoothed in (("0.5", 1), ("0", 0)):
        report = tmp_path / f"r{alpha}.json"
        ran = run_cli(str(model), "-o", str(tmp_path / f"q{alpha}.onnx"), "--calib", str(data), "--smoothing", alpha,
                      "--no-measure", "--report-json", str(report))  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        section = json.loads(report.read_text())["smoothing"]
        assert len([r for r in section["inputs"] if r["applied"]]) == smoothed
    refused = run_cli(str(model), "-o", str(tmp_path / "bad.onnx"), "--calib", str(data), "--smoothing", "2")
    assert refused.returncode != 0 and "smoothing must be an alpha in [0, 1]" in refused.stderr
    assert not (tmp_path / "bad.onnx").exists()


def test_a_gemm_with_transposed_weight_after_a_normalization_without_bias() -> None:
    """Gemm(transB=1): the weight's input channels are its columns; a LayerNormalization with no bias
    takes 1/s in its scale alone. The float model computes the same."""
    rng = np.random.default_rng(3)
    gamma = ", ".join(f"{v:.3f}" for v in [1, 1, 1, 1, 1, 1, 1, 12])
    w = ", ".join(f"{v:.3f}" for v in rng.normal(size=24))
    text = f"""<ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 8] x) => (float[N, 3] y) <float[8] gamma = {{{gamma}}}, float[3, 8] w = {{{w}}},
        float[3] b = {{0.1, 0.2, 0.3}}> {{
      n = LayerNormalization <axis = -1> (x, gamma)
      y = Gemm <transB = 1> (n, w, b)
    }}"""
    model, data = _model(text), _data()
    before = _outputs(model, data)
    (record,) = smooth_linears(model, data, alpha=0.8).inputs
    assert record.applied is not None and record.applied.startswith("folded into LayerNormalization")
    np.testing.assert_allclose(_outputs(model, data), before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    assert record.spread_after < record.spread_before / 3


def test_compare_matches_a_smoothed_input_with_its_float_tensor_times_the_factor(tmp_path: Path) -> None:
    """The quantized model quantizes n / s, which the float model does not compute: compare reads the
    smoothing Mul's constant and compares n * (1 / s) with what the int8 kernel gets; the SQNR is the
    input rounding's (uint8 over a range that is no longer dominated by one channel)."""
    text = MLP.replace("(float[N, 4] y)", "(float[N, 4] y, float[N, 8] r)").replace(
        "  y = MatMul (h, w2)\n", "  y = MatMul (h, w2)\n  r = Add (n, x)\n"
    )
    float_path, quant_path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(ir.serde.serialize_model(_model(text)), float_path)
    data = _data()
    requant.quantize(str(float_path), data, measure=False, output=str(quant_path), progress=lambda d, t: None)
    rows = {r.name: r for r in requant.compare(float_path, quant_path, data)}
    assert rows["n"].quantized_as.endswith("times 8 per-channel factors (smoothed)")
    assert 35 < rows["n"].sqnr_db < 60 and rows["n"].cosine > 0.999  # measured: 44.3 dB
    plain = tmp_path / "plain.onnx"
    requant.quantize(str(float_path), data, measure=False, output=str(plain), smoothing=0, progress=lambda d, t: None)
    unsmoothed = {r.name: r for r in requant.compare(float_path, plain, data)}["n"]
    assert "smoothed" not in unsmoothed.quantized_as and unsmoothed.sqnr_db < rows["n"].sqnr_db - 4  # 38.5 dB
