"""The accumulation reference, the proof, and the pair-safe weight encoding.

Golden cases (``tests/golden/encoding/*.test``): a model in ONNX text with its input's type, the
weights calibrated with a preset's weight spec, the weight-encoding step against a kernel model,
and the printed records, types and stored integers (in the kernel's reduction order).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

import requant.quantizers as q
import requant.targets.kernels as kernel_models
from requant.calibration.calibrate import weight_type
from requant.encoding.weight_encoding import encode_rows, encode_weights, rescale_stored
from requant.frontends import load_onnx_text
from requant.ir.annotations import quant_type, set_quant_type, set_stored_values, stored_values
from requant.targets.kernels import Reduction
from requant.types import UniformQuantizedPerAxisType, parse_type, with_scales
from requant.types.accumulation import INT16_PAIRS, INT32

CASES = sorted((Path(__file__).parent / "golden" / "encoding").glob("*.test"))
EXPECTED = "# expected:\n"


def test_pair_extremes_are_the_sums_at_the_worst_corners() -> None:
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (5, 5))
    lo, hi = rng.integers(0, 60, 5), rng.integers(100, 256, 5)
    top, bottom = INT16_PAIRS.pair_extremes(w, lo, hi)
    corners = np.array(list(itertools.product(*zip(lo, hi, strict=True))))  # every input at a bound: [32, 5]
    sums = np.pad(corners[:, None, :] * w[None], ((0, 0), (0, 0), (0, 1)))  # odd K: a zero pads the last pair
    pairs = sums[..., 0::2] + sums[..., 1::2]  # [corner, row, pair]
    assert (top == pairs.max(axis=0)).all() and (bottom == pairs.min(axis=0)).all()
    uniform_top, _ = INT16_PAIRS.pair_extremes(w, 0, 255)
    assert (uniform_top == INT16_PAIRS.pair_extremes(w, np.zeros(5), np.full(5, 255))[0]).all()
    floats_top, _ = INT16_PAIRS.pair_extremes(w + 0.5, lo, hi)
    assert floats_top.dtype == np.float64


def test_dot_adds_each_pair_in_saturating_int16() -> None:
    rng = np.random.default_rng(1)
    a, w = rng.integers(0, 256, (3, 7)), rng.integers(-128, 128, (7, 4))
    expected = np.zeros((3, 4), np.int64)
    for i, j in itertools.product(range(3), range(4)):
        for k in range(0, 7, 2):
            pair = a[i, k] * w[k, j] + (a[i, k + 1] * w[k + 1, j] if k + 1 < 7 else 0)
            expected[i, j] += min(max(pair, -32768), 32767)
    assert (INT16_PAIRS.dot(a, w) == expected).all()
    assert (INT32.dot(a, w) == a @ w).all()
    assert (INT16_PAIRS.overflow(w.T, 0, 255) > 0).any() and INT32.overflow(w.T, 0, 255).max() == 0


def test_margin_is_the_distance_of_the_closest_pair() -> None:
    w = np.array([[64, 64, -100, 28]])  # the first pair reaches 255 * 128 = 32640: 127 below 32767
    assert INT16_PAIRS.margin(w, 0, 255) == 127
    assert INT16_PAIRS.margin(np.array([[127, 127]]), 0, 255) == 32767 - 255 * 254
    assert INT32.margin(np.array([[127, 127]]), 0, 255) == 2**31 - 1


def test_pair_overflows_a_block_of_rows_at_a_time_are_those_of_the_whole_matrix() -> None:
    """More rows than one block, an odd K, bounds per input and per row: the blocks' answer is the
    whole matrix's pair extremes against the int16 range."""
    rng = np.random.default_rng(3)
    w = rng.integers(-128, 128, (700, 51)).astype(np.int8)  # 35,700 elements: three blocks
    w[500, :2] = -128
    signed_lo = rng.integers(-128, 0, (700, 51))
    signed_lo[500, :2] = -128  # int8 inputs: (-128)(-128) twice is 32768, one above int16
    for lo, hi in ((0, 255), (rng.integers(0, 60, 51), rng.integers(100, 256, 51)),
                   (signed_lo, rng.integers(0, 128, (700, 51)))):  # fmt: skip
        top, bottom = INT16_PAIRS.pair_extremes(w.astype(np.int64), lo, hi)
        up, down, margin = INT16_PAIRS.pair_overflows(w, lo, hi)
        assert (up == np.maximum(top - 32767, 0)).all() and (down == np.maximum(-32768 - bottom, 0)).all()
        assert margin == min((32767 - top).min(), (bottom + 32768).min())
        assert up.any() or down.any()  # the case is not vacuous


@pytest.mark.parametrize("k", [16, 27, 300])
def test_encoded_rows_cannot_saturate_and_lose_less_than_seven_bits(k: int) -> None:
    rng = np.random.default_rng(k)
    f = rng.standard_normal((64, k))
    f[:8] *= 0.05  # small rows: no pair can saturate, they stay as rounded
    f = f / np.abs(f).max(axis=1, keepdims=True) * 127.5
    f[:8] *= 0.3
    q_, t = encode_rows(f, 0, 255, INT16_PAIRS)
    assert INT16_PAIRS.overflow(q_, 0, 255).max() == 0
    assert (t >= 1).all() and (t <= 2.01).all()
    assert (t[:8] == 1).all() and (q_[:8] == np.rint(f[:8])).all()
    encoded = ((f - q_ * t[:, None]) ** 2).sum(axis=1)
    seven_bits = ((f - np.clip(np.rint(f / 2), -64, 63) * 2) ** 2).sum(axis=1)
    assert (encoded[8:] < seven_bits[8:]).mean() > 0.9  # 7 bits (t = 2) is not always among the factors tried
    assert encoded.sum() < 0.6 * seven_bits.sum()


def test_a_per_tensor_weight_gets_one_factor() -> None:
    f = np.array([[127.0, 120.0, 3.0, -2.0], [10.0, -20.0, 30.0, 5.0]])
    q_, t = encode_rows(f, 0, 255, INT16_PAIRS, shared_scale=True)
    assert t[0] == t[1] > 1 and INT16_PAIRS.overflow(q_, 0, 255).max() == 0


def test_a_narrower_input_range_needs_no_encoding() -> None:
    """uint8 inputs stored in [0, 127] (a reduced-range activation): 127 * 254 fits int16."""
    f = np.full((2, 8), 127.0)
    q_, t = encode_rows(f, 0, 127, INT16_PAIRS)
    assert (t == 1).all() and (q_ == 127).all()


def _run_case(path: Path) -> tuple[str, str]:
    text = path.read_text()
    head = text.split(EXPECTED)[0]
    settings = dict(line[2:].split(": ", 1) for line in head.splitlines() if line.startswith("# ") and ": " in line)
    model_text = "".join(line + "\n" for line in head.splitlines() if not line.startswith("#"))
    model = load_onnx_text(model_text, path.name)
    values = {str(v.name): v for v in [*model.graph.inputs, *model.graph.initializers.values()]}
    for assignment in settings["types"].split("; "):
        name, text_type = assignment.split(" = ")
        set_quant_type(values[name], parse_type(text_type))
    spec = q.PRESETS[settings["weights"]].weight
    assert isinstance(spec, q.QuantizationSpec)
    for node in model.graph:
        weight = node.inputs[1]
        assert weight is not None and weight.const_value is not None
        axis = 1 if node.op_type in ("MatMul", "Gemm") and not node.attributes.get_int("transB", 0) else 0
        set_quant_type(weight, weight_type(weight.const_value.numpy(), q.QuantizationSpec(
            spec.dtype, symmetric=spec.symmetric, granularity=spec.granularity, axis=axis,
            reduce_range=spec.reduce_range)
            if spec.granularity == "per_axis" else spec, "f32", str(weight.name)))  # fmt: skip
    records = encode_weights(model, getattr(kernel_models, settings["kernels"]))
    lines = []
    for record, node in zip(records, model.graph, strict=True):
        weight = node.inputs[1]
        assert weight is not None and weight.const_value is not None
        stored = stored_values(weight)
        reduction = Reduction(node.op_type, tuple(weight.const_value.shape.numpy()),
                              bool(node.attributes.get_int("transB", 0)), node.attributes.get_int("group", 1))  # fmt: skip
        lines += [
            f"{record.node}: {record.encoding}, {record.kernel}, {record.accumulation}, inputs {record.input_range}, "
            f"margin {record.margin}, rescaled {record.rescaled} of {record.channels} (x{record.largest_factor:.3f}), "
            f"moved {record.moved}",
            f"  why: {record.why}",
            f"  type: {quant_type(weight)}",
            "  stored rows: " + ("as rounded" if stored is None else str(reduction.rows(stored).tolist())),
        ]
    return head, "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_weight_encoding_golden(path: Path, update_golden: bool) -> None:
    head, got = _run_case(path)
    if update_golden:
        path.write_text(head + EXPECTED + got)
        return
    assert got == path.read_text().split(EXPECTED)[1], f"{path.name} differs (pytest --update-golden to accept)"


def test_a_raised_bias_scale_shrinks_the_encoded_integers() -> None:
    """When a bias needs a larger weight scale than the encoding chose (propagate's int32 room), the
    stored integers follow the scale down, and no pair grows."""
    weight = ir.Value(name="w", const_value=ir.tensor(np.ones((2, 4), np.float32)))
    old = UniformQuantizedPerAxisType("i8", "f32", 0, [0.01, 0.02])
    set_quant_type(weight, old)
    set_stored_values(weight, np.array([[100, 28, 100, 28], [64, 64, -64, -64]], np.int8))
    new = with_scales(old, [0.01, 0.04])
    rescale_stored(weight, old, new)
    stored = stored_values(weight)
    assert stored is not None and stored.tolist() == [[100, 28, 100, 28], [32, 32, -32, -32]]
