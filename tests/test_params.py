"""from_range: parameters from observed ranges, as ONNX Runtime and PyTorch choose them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from requant.errors import QuantTypeError
from requant.types import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    dcast,
    from_range,
    qcast,
    storage_bounds,
)


def test_affine_uint8_matches_onnxruntime_formula() -> None:
    t = from_range(-1.0, 3.0, "u8")
    assert isinstance(t, UniformQuantizedType)
    assert t.scale == float(np.float32(4.0 / 255))  # stored as the f32 the model will hold
    assert t.zero_point == 64  # round(0 - (-1 / scale)) = round(63.75)


def test_symmetric_int8_and_narrow_range() -> None:
    t = from_range(-2.0, 1.0, "i8", symmetric=True)
    assert isinstance(t, UniformQuantizedType)
    assert (t.zero_point, t.scale) == (0, float(np.float32(2.0 / 127.5)))
    n = from_range(-2.0, 1.0, "i8", symmetric=True, narrow_range=True)
    assert isinstance(n, UniformQuantizedType)
    assert (n.zero_point, n.scale, n.storage_min, n.storage_max) == (0, float(np.float32(2.0 / 127)), -127, 127)
    u = from_range(-2.0, 1.0, "u8", symmetric=True)
    assert isinstance(u, UniformQuantizedType) and u.zero_point == 128


def test_reduce_range_drops_one_bit() -> None:
    # ONNX Runtime's and PyTorch's reduce_range: int8 [-64, 63], uint8 [0, 127], stated in the type
    t = from_range(-2.0, 1.0, "i8", symmetric=True, reduce_range=True)
    assert isinstance(t, UniformQuantizedType)
    assert (t.zero_point, t.scale, t.storage_min, t.storage_max) == (0, float(np.float32(2.0 / 63.5)), -64, 63)
    assert str(t) == "!quant.uniform<i8<-64:63>:f32, 0.031496062874794006>"
    u = from_range(0.0, 1.0, "u8", reduce_range=True)
    assert isinstance(u, UniformQuantizedType)
    assert (u.zero_point, u.scale, u.storage_min, u.storage_max) == (0, float(np.float32(1 / 127)), 0, 127)
    n = from_range(-2.0, 1.0, "i8", symmetric=True, reduce_range=True, narrow_range=True)
    assert isinstance(n, UniformQuantizedType) and (n.storage_min, n.storage_max) == (-63, 63)
    assert storage_bounds("i8") == (-128, 127) and storage_bounds("u4", reduce_range=True) == (0, 7)
    assert storage_bounds("i8", narrow_range=True, reduce_range=True) == (-63, 63)


def test_range_is_widened_to_contain_zero() -> None:
    t = from_range(2.0, 4.0, "u8")
    assert isinstance(t, UniformQuantizedType)
    assert t.zero_point == 0 and t.scale == float(np.float32(4.0 / 255))
    neg = from_range(-4.0, -2.0, "u8")
    assert isinstance(neg, UniformQuantizedType) and neg.zero_point == 255


@pytest.mark.parametrize("storage", ["i8", "u8", "i4", "u16"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_zero_is_exact(storage: str, symmetric: bool) -> None:
    t = from_range(-0.37, 5.1, storage, symmetric=symmetric)
    zero = np.zeros(3, np.float32)
    assert np.array_equal(dcast(qcast(zero, t), t), zero)


def test_constant_and_degenerate_ranges() -> None:
    t = from_range(0.0, 0.0, "i8")
    assert isinstance(t, UniformQuantizedType) and (t.scale, t.zero_point) == (1.0, 0)
    c = from_range(2.5, 2.5, "u8")  # a constant tensor: [0, 2.5] after widening
    assert isinstance(c, UniformQuantizedType)
    assert np.isclose(float(dcast(qcast(np.array([2.5], np.float32), c), c)[0]), 2.5)
    tiny = from_range(-1e-45, 1e-45, "u8")  # a range of denormals counts as empty, as in ONNX Runtime
    assert isinstance(tiny, UniformQuantizedType) and (tiny.scale, tiny.zero_point) == (1.0, 0)
    small = from_range(-1e-30, 1e-30, "i8", symmetric=True)
    assert isinstance(small, UniformQuantizedType) and small.scale == float(np.float32(1e-30 / 127.5))


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (float("nan"), 1.0, "range min is nan"),
        (0.0, float("inf"), "range max is inf"),
        (2.0, 1.0, "illegal min and max"),
        (np.array([0.0, float("nan")]), np.array([1.0, 1.0]), r"range min at index \(1,\) is nan"),
    ],
)
def test_bad_ranges_are_errors(lo: object, hi: object, message: str) -> None:
    axis = 0 if isinstance(lo, np.ndarray) else None
    with pytest.raises(QuantTypeError, match=message):
        from_range(lo, hi, "i8", axis=axis)  # type: ignore[arg-type]


def test_too_wide_for_f16() -> None:
    with pytest.raises(QuantTypeError, match="too wide for expressed type f16"):
        from_range(-1e9, 1e9, "i8", "f16")


def test_per_axis_and_blockwise() -> None:
    lo = np.array([-1.0, -2.0, 0.0])
    hi = np.array([1.0, 0.5, 0.0])
    t = from_range(lo, hi, "i8", symmetric=True, axis=1)
    assert isinstance(t, UniformQuantizedPerAxisType)
    assert t.axis == 1 and t.zero_points == (0, 0, 0) and t.scales[2] == 1.0
    b = from_range(lo.reshape(3, 1), hi.reshape(3, 1), "i4", block_sizes={0: 1, 1: 32})
    assert isinstance(b, UniformQuantizedSubChannelType) and b.scales.shape == (3, 1)


@given(
    lo=st.floats(-1e6, 0.0),
    width=st.floats(1e-3, 1e6),
    storage=st.sampled_from(["i8", "u8", "i16", "u16", "i4"]),
    symmetric=st.booleans(),
)
def test_in_range_values_round_trip_within_half_a_scale(lo: float, width: float, storage: str, symmetric: bool) -> None:
    hi = lo + width
    t = from_range(lo, hi, storage, symmetric=symmetric)
    assert isinstance(t, UniformQuantizedType)
    x = np.linspace(lo, hi, 101).astype(np.float32)
    # inside the representable range, the error is at most half a step (plus f32 rounding)
    lo_rep = (t.storage_min - t.zero_point) * t.scale
    hi_rep = (t.storage_max - t.zero_point) * t.scale
    inside = (x >= lo_rep) & (x <= hi_rep)
    err = np.abs(dcast(qcast(x, t), t).astype(np.float64) - x)
    tol = t.scale / 2 + 4 * np.finfo(np.float32).eps * np.maximum(np.abs(x), t.scale)
    assert np.all(err[inside] <= tol[inside])
    if not symmetric:  # symmetric full-range storage clips the top half step, as ORT and PyTorch do
        assert lo_rep <= lo + t.scale / 2 and hi_rep >= hi - t.scale / 2
