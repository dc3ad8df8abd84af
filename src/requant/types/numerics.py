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

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from requant.types.tensor import verify_blocks

__all__ = ["ROUNDING_MODES", "dcast", "qcast", "scast"]

ROUNDING_MODES = ("half_to_even", "half_away_from_zero", "toward_zero")
_CHUNK = 1 << 18  # elements per block: temporaries stay in L2, and few enough blocks for threads to pay off
_THREADS = max(1, min(4, os.cpu_count() or 1))

Array = npt.NDArray[Any]


def _compute_dtype(t: UniformType, rounding: str = "half_to_even") -> type[np.floating[Any]]:
    if t.expressed_format.precision > 24:
        return np.float64
    if rounding == "toward_zero" and t.expressed == "f16":
        return np.float16  # MLIR's lowering computes in the expressed type
    return np.float32


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
    verify_blocks(t, x.shape)
    blocked: list[int] = []
    grid: list[int] = []
    for size, groups in zip(x.shape, t.scales.shape, strict=True):
        blocked += [groups, size // groups]
        grid += [groups, 1]
    return x.reshape(blocked), t.scales.astype(ct).reshape(grid), t.zero_points.reshape(grid)


def _chunked(
    x: Array, scale: Array, zp: Array, out: Array, kernel: Callable[[Array, Array, Array, Array], None]
) -> None:
    """Apply ``kernel`` to slices of the leading axis that fit in cache, on a few threads.

    numpy releases the GIL inside ufuncs, so slices run in parallel; every
    element is computed the same way whatever the slicing, so results do not
    depend on the number of threads.
    """
    if x.ndim == 0 or x.size <= _CHUNK:
        kernel(x, scale, zp, out)
        return
    lead = x.shape[0]

    def along(p: Array, start: int, stop: int) -> Array:
        # parameters that vary along the leading axis are sliced with it
        return p[start:stop] if p.ndim and p.shape[0] == lead and lead > 1 else p

    rows = max(1, _CHUNK // max(1, x.size // lead))
    starts = range(0, lead, rows)

    def run(start: int) -> None:
        stop = start + rows
        kernel(x[start:stop], along(scale, start, stop), along(zp, start, stop), out[start:stop])

    if len(starts) < 4 or _THREADS == 1:
        for start in starts:
            run(start)
        return
    with ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(run, starts))


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
    ct = _compute_dtype(t, rounding)
    # Values past 2**24 are not exact in float32: wide storage rounds in float64
    # (MLIR's lowering adds the zero point before that, in the expressed type).
    wide = np.float64 if t.storage_width > 16 or ct is np.float16 else ct
    lo, hi = wide(t.storage_min), wide(t.storage_max)
    view, scale, zp = _layout(xa, t, ct)
    zpf = zp.astype(wide)
    add_zp = bool(np.any(zp))
    out = np.empty(view.shape, dtype=t.storage_type.numpy_dtype)

    def kernel(xs: Array, s: Array, z: Array, o: Array) -> None:
        # an explicit output: on 0-d inputs numpy returns scalars, which in-place ops refuse
        v = np.divide(xs, s, out=np.empty(np.broadcast_shapes(xs.shape, s.shape), dtype=ct))
        if rounding == "toward_zero":  # MLIR: add the zero point in the expressed type, then convert
            if add_zp:
                np.add(v, z.astype(ct), out=v)
            v = np.asarray(np.trunc(v.astype(wide)))
        else:
            if wide is not ct:
                v = v.astype(wide)
            if rounding == "half_to_even":
                np.rint(v, out=v)
            else:  # half away from zero, exactly: trunc, then step out where |fraction| >= 1/2
                whole = np.asarray(np.trunc(v))
                np.subtract(v, whole, out=v)
                whole += v >= 0.5
                whole -= v <= -0.5
                v = whole
            if add_zp:
                np.add(v, z, out=v)
        np.clip(v, lo, hi, out=v)
        nan = np.isnan(v)
        if nan.any():
            v[nan] = lo  # NaN saturates to storage_min
        o[...] = v

    _chunked(view, scale, zpf, out, kernel)
    return out.reshape(xa.shape)


def dcast(q: npt.ArrayLike, t: UniformType) -> Array:
    """Dequantize stored values ``q``: ``(q - zero_point) * scale`` in ``t``'s expressed type."""
    t = _check_uniform(t, "dcast")
    qa = np.asarray(q)
    if not np.issubdtype(qa.dtype, np.integer):
        raise QuantTypeError(f"dcast expects an integer array of stored values, got {qa.dtype}")
    ct = _compute_dtype(t)
    view, scale, zp = _layout(qa, t, ct)
    out_dtype = _output_float(t)
    out = np.empty(view.shape, dtype=out_dtype)
    exact_in_ct = t.storage_width <= 16  # every stored value and difference is exact in float32
    sub_zp = bool(np.any(zp))
    zpc = zp.astype(ct) if exact_in_ct else zp
    direct = out_dtype == ct

    def kernel(qs: Array, s: Array, z: Array, o: Array) -> None:
        v = o if direct else np.empty(qs.shape, dtype=ct)
        if not exact_in_ct:  # subtract in integers, as ONNX Runtime does, then convert
            v[...] = qs.astype(np.int64) - z
        elif sub_zp:
            np.subtract(qs, z, out=v, dtype=ct)
        else:
            v[...] = qs
        np.multiply(v, s, out=v)
        if not direct:
            o[...] = v

    _chunked(view, scale, zpc, out, kernel)
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
