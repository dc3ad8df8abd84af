"""Error-feedback rounding (GPTQ) of convolutions' weights against their calibration inputs.

The patches against a real convolution, the factor against the inverse it stands for, the rounding
against nearest on correlated inputs (and within the pair proof's bound), the moments' independence
from how samples are stacked, and the digits CNN end to end: its kernels' output closer to float,
its model closer to float in ONNX Runtime, no kernel that can saturate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import requant.api
import requant.calibration.moments as moments
import requant.encoding.rounding as rounding
from requant.calibration.moments import InputMoments, Patches
from requant.encoding.rounding import output_error, round_rows, round_rows_each
from requant.encoding.weight_encoding import encode_rows
from requant.types.accumulation import INT16_PAIRS

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


@pytest.mark.parametrize(
    ("kernel", "pads", "strides", "dilations"),
    [
        ((1, 1), (0, 0, 0, 0), (1, 1), (1, 1)),
        ((3, 3), (1, 1, 1, 1), (2, 2), (1, 1)),
        ((3, 2), (2, 1, 0, 2), (1, 2), (2, 1)),
    ],
)
def test_patches_times_the_weight_rows_are_the_convolution(kernel, pads, strides, dilations) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 11, 13)).astype(np.float32)
    w = rng.normal(size=(4, 5, *kernel)).astype(np.float32)
    node = onnx.helper.make_node(
        "Conv", ["x", "w"], ["y"], pads=list(pads), strides=list(strides), dilations=list(dilations)
    )
    graph = onnx.helper.make_graph(
        [node], "conv", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    rows = Patches(kernel, pads, strides, dilations).rows(x)
    by_patches = rows @ np.moveaxis(w, 1, -1).reshape(4, -1).T  # the weight's rows in the kernel's order
    assert np.allclose(by_patches, np.moveaxis(y, 1, -1).reshape(-1, 4), atol=1e-4)
    some = Patches(kernel, pads, strides, dilations).rows(x, at_most=7)
    assert len(some) <= 7 and all(any(np.array_equal(r, s) for r in rows) for s in some)


def test_the_factor_is_the_upper_cholesky_factor_of_the_inverse() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 60)) @ rng.normal(size=(60, 60))
    h = x.T @ x
    u = rounding.upper_inverse_factor(h)
    assert np.allclose(u, np.triu(u)) and (np.diag(u) > 0).all()
    assert np.allclose(u.T @ u, np.linalg.inv(h), rtol=1e-8, atol=1e-12 * np.abs(np.linalg.inv(h)).max())


def _correlated(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Inputs whose elements move together, as neighbouring pixels and channels do."""
    base = rng.normal(size=(n, k))
    return base + 0.9 * np.roll(base, 1, axis=1) + 0.5 * rng.normal(size=(n, 1))


def test_error_feedback_brings_the_output_closer_than_nearest_on_new_inputs() -> None:
    rng = np.random.default_rng(2)
    k, rows = 48, 32
    f = rng.normal(scale=30, size=(rows, k))  # weights in units of their scale
    fitted, fresh = _correlated(rng, 2000, k), _correlated(rng, 2000, k)
    q = round_rows(f, fitted.T @ fitted, -127, 127)
    nearest = np.clip(np.rint(f), -127, 127)
    assert q.dtype.kind == "f" and np.array_equal(q, np.rint(q)) and np.abs(q).max() <= 127
    h_new = fresh.T @ fresh
    assert output_error(f, q, h_new) < 0.6 * output_error(f, nearest, h_new)  # held out, not only where fitted
    assert np.abs(q - f).max() < 4  # the errors are spread, not piled on a few weights


def test_an_input_never_seen_keeps_its_weights_rounded_to_nearest() -> None:
    rng = np.random.default_rng(3)
    f = rng.normal(scale=20, size=(8, 6))
    x = _correlated(rng, 500, 6)
    x[:, 2] = 0.0  # a channel dead on the calibration data
    q = round_rows(f, x.T @ x, -127, 127)
    assert np.array_equal(q[:, 2], np.rint(f[:, 2]))


@pytest.mark.parametrize("spread", [30.0, 60.0, 90.0])
def test_pairs_stay_within_the_int16_bound_where_the_kernel_pairs_products(spread: float) -> None:
    """Weights whose pairs saturate at nearest: first the pair-safe encoding's scales (as the pipeline
    does), then error feedback at those scales, against the encoding's own integers."""
    rng = np.random.default_rng(4)
    k = 40
    f = np.abs(rng.normal(scale=spread, size=(64, k))) + 40  # pairs of one sign, near 255 * 128 and past it
    f[::2] *= -1
    f = np.clip(f, -127, 127)
    assert INT16_PAIRS.overflow(np.rint(f).astype(np.int64), 0, 255).max() > 0
    safe, factor = encode_rows(f, 0, 255, INT16_PAIRS)
    units = f / factor[:, None]
    x = _correlated(rng, 3000, k)
    q = round_rows(units, x.T @ x, -128, 127, pair_bound=(255.0, -32768.0, 32767.0))
    assert INT16_PAIRS.overflow(q.astype(np.int64), 0, 255).max() == 0
    fresh = _correlated(rng, 3000, k)
    assert output_error(units, q, fresh.T @ fresh) < output_error(units, safe, fresh.T @ fresh)
    # with no room (every pair over at any scale the search tried) the errors stay bounded
    tight = round_rows(f, x.T @ x, -128, 127, pair_bound=(255.0, -32768.0, 32767.0))
    assert INT16_PAIRS.overflow(tight.astype(np.int64), 0, 255).max() == 0 and np.abs(tight - f).max() < 128


def test_moments_are_the_same_however_samples_are_stacked() -> None:
    rng = np.random.default_rng(5)
    samples = rng.normal(size=(20, 3, 9, 9)).astype(np.float32)
    patches = Patches((3, 3), (1, 1, 1, 1))
    one, stacked = InputMoments(patches, 27), InputMoments(patches, 27)
    for sample in samples:
        one.update(sample[None])
    for start in range(0, 20, 7):
        stacked.update(samples[start : start + 7])
    assert one.total is not None and stacked.total is not None
    assert np.array_equal(one.total, stacked.total) and one.vectors == stacked.vectors == one.cap
    assert one.per_sample == int(np.ceil(one.cap / moments.SAMPLE_SHARE))  # no sample gives more than its share
    assert one.enough


def test_a_depthwise_kernels_moments_are_each_channels_own() -> None:
    rng = np.random.default_rng(6)
    samples = rng.normal(size=(6, 4, 10, 10)).astype(np.float32) * np.arange(1, 5, dtype=np.float32)[:, None, None]
    depthwise = InputMoments(Patches((3, 3), (1, 1, 1, 1), depthwise=True), 9)
    for sample in samples:
        depthwise.update(sample[None])
    assert depthwise.total is not None and depthwise.total.shape == (4, 9, 9) and depthwise.enough
    for c in range(4):  # channel c alone through a convolution of one input channel
        alone = InputMoments(Patches((3, 3), (1, 1, 1, 1)), 9)
        for sample in samples:
            alone.update(sample[None, c : c + 1])
        assert alone.total is not None and alone.vectors == depthwise.vectors
        np.testing.assert_allclose(depthwise.total[c], alone.total, rtol=1e-5)


def test_each_row_is_rounded_against_its_own_inputs() -> None:
    rng = np.random.default_rng(7)
    rows, k = 12, 9
    f = rng.normal(scale=25, size=(rows, k))
    fitted = [_correlated(rng, 400, k) for _ in range(rows)]
    fresh = [_correlated(rng, 400, k) for _ in range(rows)]
    h = np.stack([x.T @ x for x in fitted])
    q = round_rows_each(f, h, -127, 127)
    for i in range(rows):  # the same integers as the shared-H rounding of that row alone
        assert np.array_equal(q[i], round_rows(f[i : i + 1], h[i], -127, 127)[0])
    h_new = np.stack([x.T @ x for x in fresh])
    nearest = np.clip(np.rint(f), -127, 127)
    assert output_error(f, q, h_new) < 0.8 * output_error(f, nearest, h_new)  # held out
    assert output_error(f, q, h_new) == pytest.approx(
        sum(output_error(f[i : i + 1], q[i : i + 1], h_new[i]) for i in range(rows))
    )


def _quantized(tmp: Path, name: str) -> tuple[requant.api.QuantizedModel, np.ndarray]:
    out = tmp / f"{name}.onnx"
    q = requant.api.quantize(
        DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", output=out, measure=False, method="minmax"
    )
    x = np.load(DIGITS / "eval.npz")["x"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return q, session.run(None, {session.get_inputs()[0].name: x})[0]


def test_the_digits_cnn_is_closer_to_float_with_error_feedback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fed, y_fed = _quantized(tmp_path, "fed")
    monkeypatch.setattr(moments, "MAX_REDUCTION", 0)  # every kernel rounded to nearest
    nearest, y_nearest = _quantized(tmp_path, "nearest")
    x = np.load(DIGITS / "eval.npz")["x"]
    f = ort.InferenceSession(str(DIGITS / "digits_cnn.onnx"), providers=["CPUExecutionProvider"])
    y = f.run(None, {f.get_inputs()[0].name: x})[0]

    records = {r["node"]: r for r in fed.report["weight_encoding"]["kernels"]}
    convs = [r for r in records.values() if r["node"].startswith("node_conv")]
    assert convs and all(r["rounding"] == "error feedback" for r in convs)
    for r in convs:  # each kernel's output, from its weights alone, on its calibration inputs
        assert r["output_sqnr_db"] > r["nearest_output_sqnr_db"] + 1.0
        assert r["margin"] >= 0  # still proven on CPUs without VNNI
    assert all(r["rounding"] == "nearest" for r in nearest.report["weight_encoding"]["kernels"])
    assert fed.report["lint"]["saturation"]["can_saturate"] == []  # on CPUs without VNNI, none

    def sqnr(q: np.ndarray) -> float:
        return float(10 * np.log10(np.sum(y.astype(np.float64) ** 2) / np.sum((y.astype(np.float64) - q) ** 2)))

    assert sqnr(y_fed) > sqnr(y_nearest)  # the model's logits on held-out digits, as ONNX Runtime computes them
