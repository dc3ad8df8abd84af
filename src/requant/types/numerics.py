"""qcast / dcast / scast over numpy arrays, for per-layer, per-axis and sub-channel types.

Rounding is always named:

``half_to_even``
    ONNX ``QuantizeLinear``: ``saturate(round_half_even(x / scale) + zero_point)``.
``half_away_from_zero``
    TFLite's reference kernels: ``saturate(round_half_away(x / scale) + zero_point)``.
``toward_zero``
    MLIR's lowering of ``quant.qcast``: ``saturate(trunc(x / scale + zero_point))``;
    the zero point is added *before* the conversion to integer.

Arithmetic is done in float32 for expressed types of up to 24 bits of
precision (f16, bf16, tf32, f32 and the f8 kinds, as ONNX Runtime computes),
and in float64 for f64, f80 and f128. Results always saturate to
``[storage_min, storage_max]``, and NaN quantizes to ``storage_min`` (ONNX
leaves NaN undefined; ONNX Runtime's answer depends on the kernel and the zero
point). Storage wider than 16 bits rounds and adds the zero point in float64,
so i32/u32 results are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.errors import QuantTypeError
from requant.types.quantized import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    UniformType,
)
from requant.types.storage import StorageType, storage_type
from requant.types.tensor import _verify_blocks

__all__ = ["ROUNDING_MODES", "dcast", "qcast", "scast"]

ROUNDING_MODES = ("half_to_even", "half_away_from_zero", "toward_zero")
_CHUNK = 1 << 16  # elements per block: keeps the temporaries in cache

Array = npt.NDArray[Any]


def _compute_dtype(t: UniformType) -> type[np.floating[Any]]:
    return np.float64 if t.expressed_format.precision > 24 else np.float32


def _output_float(t: UniformType) -> np.dtype[Any]:
    return np.dtype(
        {"f16": np.float16, "f64": np.float64, "f80": np.float64, "f128": np.float64}.get(t.expressed, np.float32)
    )


def _check_uniform(t: object, fn: str) -> UniformType:
    if not isinstance(t, (UniformQuantizedType, UniformQuantizedPerAxisType, UniformQuantizedSubChannelType)):
        raise QuantTypeError(f"{fn} needs a !quant.uniform type, got {t!r}")
    return t


def _layout(x: Array, t: UniformType, ct: type[np.floating[Any]]) -> tuple[Array, Array, Array]:
    """``x`` viewed so that ``scale`` and ``zero_point`` broadcast against it."""
    if isinstance(t, UniformQuantizedType):
        return x, np.array(t.scale, dtype=ct), np.array(t.zero_point, dtype=np.int64)
    if isinstance(t, UniformQuantizedPerAxisType):
        if x.ndim <= t.axis:
            raise QuantTypeError(
                f"quantized dimension must be less than tensor rank (axis {t.axis}, array of shape {x.shape})"
            )
        if x.shape[t.axis] != len(t.scales):
            raise QuantTypeError(
                f"quantized dimension size does not match number of scales "
                f"(axis {t.axis} of shape {x.shape} vs {len(t.scales)} scales)"
            )
        shape = [1] * x.ndim
        shape[t.axis] = len(t.scales)
        scale = np.array(t.scales, dtype=ct).reshape(shape)
        return x, scale, np.array(t.zero_points, dtype=np.int64).reshape(shape)
    _verify_blocks(t, x.shape)
    blocked: list[int] = []
    grid: list[int] = []
    for size, groups in zip(x.shape, t.scales.shape, strict=True):
        blocked += [groups, size // groups]
        grid += [groups, 1]
    return x.reshape(blocked), t.scales.astype(ct).reshape(grid), t.zero_points.reshape(grid)


def _chunked(
    x: Array, scale: Array, zp: Array, out: Array, kernel: Callable[[Array, Array, Array, Array], None]
) -> None:
    """Apply ``kernel`` over slices of the leading axis small enough to stay in cache."""
    if x.ndim == 0 or x.size <= _CHUNK or (scale.ndim and scale.shape[0] != 1) or (zp.ndim and zp.shape[0] != 1):
        kernel(x, scale, zp, out)
        return
    rows = max(1, _CHUNK // max(1, x.size // x.shape[0]))
    for start in range(0, x.shape[0], rows):
        kernel(x[start : start + rows], scale, zp, out[start : start + rows])


def qcast(x: npt.ArrayLike, t: UniformType, rounding: str = "half_to_even") -> Array:
    """Quantize ``x`` to the stored values of ``t`` (an integer array of ``x``'s shape).

    Widths below 8 bits come back one value per int8/uint8 element.
    """
    t = _check_uniform(t, "qcast")
    if rounding not in ROUNDING_MODES:
        raise QuantTypeError(f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDING_MODES)}")
    xa = np.asarray(x)
    if not np.issubdtype(xa.dtype, np.floating):
        raise QuantTypeError(f"qcast expects a floating-point array, got {xa.dtype}")
    ct = _compute_dtype(t)
    # Values past 2**24 are not exact in float32: wide storage rounds in float64.
    wide = np.float64 if t.storage_width > 16 else ct
    lo, hi = t.storage_min, t.storage_max
    storage = t.storage_type
    view, scale, zp = _layout(xa, t, ct)
    out = np.empty(view.shape, dtype=storage.numpy_dtype)

    def kernel(xs: Array, s: Array, z: Array, o: Array) -> None:
        v = np.divide(xs, s, dtype=ct).astype(wide, copy=False)
        if rounding == "toward_zero":
            v += z.astype(wide)
            np.trunc(v, out=v)
        else:
            if rounding == "half_to_even":
                np.rint(v, out=v)
            else:
                whole = np.trunc(v)
                frac = v - whole
                whole += (frac >= 0.5).astype(wide) - (frac <= -0.5).astype(wide)
                v = whole
            v += z.astype(wide)
        # fmax/fmin return the number when the other operand is NaN: NaN saturates to storage_min
        np.fmax(v, lo, out=v)
        np.fmin(v, hi, out=v)
        o[...] = v

    _chunked(view, scale, zp, out, kernel)
    return out.reshape(xa.shape)


def dcast(q: npt.ArrayLike, t: UniformType) -> Array:
    """Dequantize stored values ``q``: ``(q - zero_point) * scale`` in ``t``'s expressed type."""
    t = _check_uniform(t, "dcast")
    qa = np.asarray(q)
    if not np.issubdtype(qa.dtype, np.integer):
        raise QuantTypeError(f"dcast expects an integer array of stored values, got {qa.dtype}")
    ct = _compute_dtype(t)
    view, scale, zp = _layout(qa, t, ct)
    out = np.empty(view.shape, dtype=_output_float(t))
    exact_in_ct = t.storage_width <= 16

    def kernel(qs: Array, s: Array, z: Array, o: Array) -> None:
        if exact_in_ct:
            v = qs.astype(ct)
            v -= z.astype(ct)
        else:  # subtract in integers, as ONNX Runtime does, then convert
            v = (qs.astype(np.int64) - z).astype(ct)
        v *= s
        o[...] = v

    _chunked(view, scale, zp, out, kernel)
    return out.reshape(qa.shape)


def scast(x: npt.ArrayLike, to: UniformType | str) -> Array:
    """MLIR's ``quant.scast``: reinterpret bits, no arithmetic.

    ``scast(bits, t)`` reads the low ``t.storage_width`` bits of each integer in
    ``bits`` as stored values of ``t`` (sign-extended for signed storage).
    ``scast(stored, "i8")`` gives the bit patterns of stored values as an
    unsigned array (numpy has no signless integers), masked to the width.
    """
    xa = np.asarray(x)
    if not np.issubdtype(xa.dtype, np.integer):
        raise QuantTypeError(f"scast expects an integer array, got {xa.dtype}")
    if isinstance(to, str):
        if not (to.startswith("i") and to[1:].isdigit()):
            raise QuantTypeError(f"scast to an integer needs a signless integer type such as 'i8', got {to!r}")
        st: StorageType = storage_type("u" + to[1:])
        mask = (1 << st.width) - 1
        return (xa.astype(np.int64) & mask).astype(st.numpy_dtype)
    t = _check_uniform(to, "scast")
    st = t.storage_type
    bits = xa.astype(np.int64) & ((1 << st.width) - 1)
    if st.signed:
        bits = np.where(bits >= (1 << (st.width - 1)), bits - (1 << st.width), bits)
    return bits.astype(st.numpy_dtype)
