"""qcast / dcast / scast: rounding modes against their references, and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from requant.errors import QuantTypeError
from requant.types import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    dcast,
    parse_type,
    qcast,
    scast,
)

X = np.array([-2.5, -1.5, -0.5, -0.25, 0.25, 0.5, 1.5, 2.5, 1e9, -1e9, np.nan], np.float32)


def test_half_to_even_is_onnx() -> None:
    # ONNX: round(x / scale) half to even, then add the zero point
    t = UniformQuantizedType("i8", "f32", 1.0, 3)
    assert qcast(X, t).tolist() == [1, 1, 3, 3, 3, 3, 5, 5, 127, -128, -128]


def test_half_away_from_zero_is_tflite() -> None:
    t = UniformQuantizedType("i8", "f32", 1.0, 3)
    assert qcast(X, t, "half_away_from_zero").tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 127, -128, -128]


def test_toward_zero_is_mlir_lowering() -> None:
    # MLIR: x / scale + zero_point first, then truncate toward zero
    t = UniformQuantizedType("i8", "f32", 1.0, 3)
    assert qcast(X, t, "toward_zero").tolist() == [0, 1, 2, 2, 3, 3, 4, 5, 127, -128, -128]


def test_where_the_zero_point_enters_matters() -> None:
    # ONNX rounds -2.5 then adds 3: rint(-2.5) + 3 = 1. MLIR adds first: trunc(0.5) = 0.
    t = UniformQuantizedType("i8", "f32", 1.0, 3)
    x = np.array([-2.5, -3.5], np.float32)
    assert qcast(x, t).tolist() == [1, -1]
    assert qcast(x, t, "toward_zero").tolist() == [0, 0]  # trunc(-0.5) is 0 too: near zero they agree less


def test_storage_bounds_saturate() -> None:
    t = UniformQuantizedType("i8", "f32", 0.5, 0, storage_min=-127, storage_max=100)
    assert qcast(np.array([-1000.0, 49.75, 50.5, 1000.0], np.float32), t).tolist() == [-127, 100, 100, 100]


def test_int4_uint4_and_16_bit() -> None:
    x = np.array([-100.0, -3.0, 3.0, 100.0], np.float32)
    assert qcast(x, parse_type("!quant.uniform<i4:f32, 1.0>")).tolist() == [-8, -3, 3, 7]  # type: ignore[arg-type]
    u4 = qcast(x, parse_type("!quant.uniform<u4:f32, 1.0:8>"))  # type: ignore[arg-type]
    assert u4.dtype == np.uint8 and u4.tolist() == [0, 5, 11, 15]
    i16 = qcast(x * 1000, parse_type("!quant.uniform<i16:f32, 1.0>"))  # type: ignore[arg-type]
    assert i16.dtype == np.int16 and i16.tolist() == [-32768, -3000, 3000, 32767]


def test_i32_storage_is_exact_beyond_float32_integers() -> None:
    t = UniformQuantizedType("i32", "f32", 1.0, 0)
    x = np.array([2.0**30, -(2.0**31), 2.0**40], np.float32)
    assert qcast(x, t).tolist() == [2**30, -(2**31), 2**31 - 1]
    q = np.array([2**31 - 1, -(2**31)], np.int32)
    assert dcast(q, UniformQuantizedType("i32", "f64", 1.0, -5)).tolist() == [2**31 - 1 + 5, -(2**31) + 5]


def test_dcast_output_types() -> None:
    q = np.array([0, 10], np.int8)
    assert dcast(q, UniformQuantizedType("i8", "f16", 0.5)).dtype == np.float16
    assert dcast(q, UniformQuantizedType("i8", "bf16", 0.5)).dtype == np.float32
    assert dcast(q, UniformQuantizedType("i8", "f64", 0.5)).dtype == np.float64


def test_scast_reinterprets_bits() -> None:
    t = UniformQuantizedType("i4", "f32", 1.0)
    bits = np.array([0, 7, 8, 15], np.uint8)
    assert scast(bits, t).tolist() == [0, 7, -8, -1]
    assert scast(np.array([0, 7, -8, -1], np.int8), "i4").tolist() == [0, 7, 8, 15]
    u8 = UniformQuantizedType("u8", "f32", 1.0)
    assert scast(np.array([-1, 127], np.int8), u8).tolist() == [255, 127]
    with pytest.raises(QuantTypeError, match="signless integer"):
        scast(bits, "u4")
    with pytest.raises(QuantTypeError, match="integer array"):
        scast(np.zeros(2, np.float32), t)


def test_errors_name_the_problem() -> None:
    pa = UniformQuantizedPerAxisType("i8", "f32", 1, [1.0, 2.0])
    with pytest.raises(QuantTypeError, match="quantized dimension size does not match number of scales"):
        qcast(np.zeros((2, 3), np.float32), pa)
    with pytest.raises(QuantTypeError, match="less than tensor rank"):
        qcast(np.zeros(2, np.float32), pa)
    sc = UniformQuantizedSubChannelType("i8", "f32", {1: 4}, [[1.0, 2.0]])
    with pytest.raises(QuantTypeError, match="divisible by the corresponding block size 4"):
        qcast(np.zeros((1, 6), np.float32), sc)
    with pytest.raises(QuantTypeError, match="floating-point array"):
        qcast(np.zeros(2, np.int8), pa)
    with pytest.raises(QuantTypeError, match="integer array"):
        dcast(np.zeros(2, np.float32), pa)
    with pytest.raises(QuantTypeError, match="unknown rounding 'nearest'; expected one of half_to_even"):
        qcast(np.zeros((1, 2), np.float32), pa, "nearest")
    with pytest.raises(QuantTypeError, match=r"needs a !quant\.uniform type"):
        qcast(np.zeros(2, np.float32), parse_type("!quant.any<i8>"))  # type: ignore[arg-type]


storages = st.sampled_from(["i8", "u8", "i4", "u4", "i16", "u16"])
modes = st.sampled_from(["half_to_even", "half_away_from_zero", "toward_zero"])


@st.composite
def per_tensor(draw: st.DrawFn) -> UniformQuantizedType:
    storage = draw(storages)
    t = UniformQuantizedType(storage, "f32", 1.0)
    scale = float(np.float32(draw(st.floats(1e-3, 1e3))))
    zp = draw(st.integers(t.storage_min, t.storage_max))
    return UniformQuantizedType(storage, "f32", scale, zp)


@given(per_tensor(), modes, st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=50))
def test_round_trip_within_half_a_scale_inside_the_range(t: UniformQuantizedType, mode: str, u: list[float]) -> None:
    lo = (t.storage_min - t.zero_point) * t.scale
    hi = (t.storage_max - t.zero_point) * t.scale
    x = (lo + (np.array(u, np.float64) + 1) / 2 * (hi - lo)).astype(np.float32)
    err = np.abs(dcast(qcast(x, t, mode), t).astype(np.float64) - x.astype(np.float64))
    # half a step for round-to-nearest, a whole step for truncation; plus float32 rounding of x/scale
    step = t.scale if mode == "toward_zero" else t.scale / 2
    slack = 2 * np.finfo(np.float32).eps * (np.abs(x.astype(np.float64)) + t.scale)
    assert np.all(err <= step + slack)


@given(per_tensor(), modes, st.floats(1.0, 1e6))
def test_saturation_outside_the_range(t: UniformQuantizedType, mode: str, beyond: float) -> None:
    hi = (t.storage_max - t.zero_point + 1) * t.scale + beyond
    lo = (t.storage_min - t.zero_point - 1) * t.scale - beyond
    q = qcast(np.array([hi, lo], np.float32), t, mode)
    assert q.tolist() == [t.storage_max, t.storage_min]


@given(
    hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, max_side=5), elements=st.floats(-50, 50, width=32)),
    st.data(),
    modes,
)
def test_per_axis_equals_per_tensor_channel_by_channel(x: np.ndarray, data: st.DataObject, mode: str) -> None:
    axis = data.draw(st.integers(0, x.ndim - 1))
    n = x.shape[axis]
    scales = data.draw(st.lists(st.floats(0.015625, 10.0, width=32), min_size=n, max_size=n))
    zps = data.draw(st.lists(st.integers(-128, 127), min_size=n, max_size=n))
    t = UniformQuantizedPerAxisType("i8", "f32", axis, scales, zps)
    q = qcast(x, t, mode)
    y = dcast(q, t)
    for c in range(n):
        tc = UniformQuantizedType("i8", "f32", scales[c], zps[c])
        xc = np.take(x, c, axis=axis)
        assert np.array_equal(np.take(q, c, axis=axis), qcast(xc, tc, mode))
        assert np.array_equal(np.take(y, c, axis=axis), dcast(qcast(xc, tc, mode), tc))


@given(st.data(), modes)
def test_blockwise_equals_per_tensor_block_by_block(data: st.DataObject, mode: str) -> None:
    grid = data.draw(st.tuples(st.integers(1, 3), st.integers(1, 3)))
    block = data.draw(st.tuples(st.integers(1, 4), st.integers(1, 4)))
    shape = (grid[0] * block[0], grid[1] * block[1])
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-20, 20, width=32)))
    scales = np.array(
        data.draw(st.lists(st.floats(0.015625, 5.0, width=32), min_size=grid[0] * grid[1], max_size=grid[0] * grid[1]))
    ).reshape(grid)
    zps = np.array(data.draw(st.lists(st.integers(-8, 7), min_size=scales.size, max_size=scales.size))).reshape(grid)
    t = UniformQuantizedSubChannelType("i4", "f32", {1: block[1], 0: block[0]}, scales, zps)
    q = qcast(x, t, mode)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tb = UniformQuantizedType("i4", "f32", float(scales[i, j]), int(zps[i, j]))
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            assert np.array_equal(q[rows, cols], qcast(x[rows, cols], tb, mode))
            assert np.array_equal(dcast(q, t)[rows, cols], dcast(q[rows, cols], tb))


def test_large_arrays_go_through_the_chunked_path() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(1200, 1000)).astype(np.float32)  # 5 blocks: the threaded path
    t = UniformQuantizedType("u8", "f32", 0.02, 128)
    expected = np.clip(np.rint(x / np.float32(0.02)) + 128, 0, 255).astype(np.uint8)
    assert np.array_equal(qcast(x, t), expected)
    pa = UniformQuantizedPerAxisType("i8", "f32", 1, [0.01] * 1000)
    assert np.array_equal(qcast(x, pa), np.clip(np.rint(x / np.float32(0.01)), -128, 127).astype(np.int8))


def test_zero_dimensional_arrays() -> None:
    # a scalar constant (an attention mask's -10000.0) is quantized like any tensor
    t = UniformQuantizedType("i8", "f32", 0.5, 0)
    for mode in ("half_to_even", "half_away_from_zero", "toward_zero"):
        q = qcast(np.array(-3.0, np.float32), t, mode)
        assert q.shape == () and int(q) == -6
    assert dcast(np.array(3, np.int8), t).shape == ()
