"""Scales and zero points from observed ranges, the way ONNX Runtime and PyTorch choose them.

Rules (``docs/types.md`` has the worked examples):

- The range is widened to contain 0, so 0.0 is always exactly representable.
- ``narrow_range`` drops the lowest storage value (``-127..127`` for i8,
  ``1..255`` for u8), as TensorFlow does.
- Symmetric: ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)`` and the zero
  point is the middle of the storage range, ``ceil((qmin + qmax) / 2)``: 0 for
  signed storage, 128 for u8.
- Affine: ``scale = (max - min) / (qmax - qmin)``,
  ``zero_point = qmin - round_half_even(min / scale)``, clamped to storage.
- The scale is rounded to the expressed type (an f32 model stores f32 scales),
  and the zero point is computed from that rounded scale.
- A scale below the expressed type's smallest normal number (an all-zero
  tensor, or a range of denormals) becomes 1.0 with the zero point at 0
  (clamped to the storage range), as ONNX Runtime does. Never a zero or NaN
  scale.
- NaN or infinite bounds, or ``min > max``, raise :class:`QuantTypeError`
  naming the bound and its index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.errors import QuantTypeError
from requant.types.floats import round_array_to_format
from requant.types.quantized import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    UniformType,
    expressed_format,
)
from requant.types.storage import storage_type

__all__ = ["from_range", "storage_bounds", "with_scales"]


def storage_bounds(storage: str, *, narrow_range: bool = False, reduce_range: bool = False) -> tuple[int, int]:
    """The stored integers a range maps onto: the storage type's, one bit less with ``reduce_range``
    (int8 [-64, 63], uint8 [0, 127]: ONNX Runtime's and PyTorch's reduce_range), without the
    lowest with ``narrow_range``."""
    st = storage_type(storage)
    qmin, qmax = st.min, st.max
    if reduce_range:
        qmin, qmax = (qmin // 2, qmax // 2) if st.signed else (0, qmax // 2)
    if narrow_range:
        qmin += 1
    if qmax - qmin < 1:
        raise QuantTypeError(f"narrow range leaves no values in {st}")
    return qmin, qmax


def _check(name: str, values: npt.NDArray[np.float64]) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        index = tuple(int(i) for i in np.unravel_index(bad[0], values.shape))
        where = "" if values.ndim == 0 else f" at index {index}"
        raise QuantTypeError(
            f"range {name}{where} is {values.flat[bad[0]]}; a quantization range must be finite "
            f"(filter NaN/Inf before observing, or use a clipping observer)"
        )


def from_range(
    min: npt.ArrayLike,  # noqa: A002 - the names users know
    max: npt.ArrayLike,  # noqa: A002
    storage: str = "i8",
    expressed: str = "f32",
    *,
    symmetric: bool = False,
    narrow_range: bool = False,
    reduce_range: bool = False,
    axis: int | None = None,
    block_sizes: Mapping[int, int] | None = None,
) -> UniformType:
    """Quantization parameters covering ``[min, max]``.

    Scalars give a per-layer type; 1-D arrays with ``axis`` a per-axis type;
    arrays of the block grid's shape with ``block_sizes`` a sub-channel type.
    """
    st = storage_type(storage)
    fmt = expressed_format(expressed)
    if axis is not None and block_sizes is not None:
        raise QuantTypeError("give either axis (per-axis) or block_sizes (sub-channel), not both")
    lo = np.asarray(min, dtype=np.float64)
    hi = np.asarray(max, dtype=np.float64)
    if lo.shape != hi.shape:
        raise QuantTypeError(f"min and max must have the same shape, got {lo.shape} and {hi.shape}")
    if axis is None and block_sizes is None and lo.ndim != 0:
        raise QuantTypeError("array ranges need axis= (per-axis) or block_sizes= (sub-channel)")
    if axis is not None and lo.ndim != 1:
        raise QuantTypeError(f"per-axis ranges must be one-dimensional, got shape {lo.shape}")
    _check("min", lo)
    _check("max", hi)
    inverted = np.flatnonzero(lo > hi)
    if inverted.size:
        i = inverted[0]
        raise QuantTypeError(f"illegal min and max: ({lo.flat[i]}:{hi.flat[i]}); min must not exceed max")
    lo = np.minimum(lo, 0.0)
    hi = np.maximum(hi, 0.0)
    qmin, qmax = storage_bounds(storage, narrow_range=narrow_range, reduce_range=reduce_range)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.maximum(-lo, hi) / ((qmax - qmin) / 2.0) if symmetric else (hi - lo) / float(qmax - qmin)
    if np.any(scale > fmt.scale_range[1]):
        raise QuantTypeError(f"range is too wide for expressed type {fmt.name}: the scale would exceed its maximum")
    degenerate = scale < 2.0**fmt.emin
    scale = round_array_to_format(np.where(degenerate, 1.0, scale), fmt)
    if symmetric:
        zp = np.full(scale.shape, (qmin + qmax + 1) // 2, dtype=np.int64)
    else:
        zp = np.clip(qmin - np.rint(lo / scale), qmin, qmax).astype(np.int64)
    zp = np.where(degenerate, np.clip(0, qmin, qmax), zp)
    bounds: dict[str, Any] = {}
    if narrow_range or reduce_range:
        bounds = {"storage_min": qmin, "storage_max": qmax}
    if axis is not None:
        return UniformQuantizedPerAxisType(str(st), fmt.name, axis, scale.tolist(), zp.tolist(), **bounds)
    if block_sizes is not None:
        return UniformQuantizedSubChannelType(str(st), fmt.name, block_sizes, scale, zp, **bounds)
    return UniformQuantizedType(str(st), fmt.name, float(scale), int(zp), **bounds)


def _at_least(scale: float, expressed: str) -> float:
    """``scale`` rounded up to the expressed type (f32 scales are what the model stores)."""
    if expressed != "f32":
        return scale
    rounded = np.float32(scale)
    if float(rounded) < scale:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return float(rounded)


def with_scales(t: UniformType, scales: npt.ArrayLike) -> UniformType:
    """``t`` with other scales (one per channel or block, or the largest for a per-layer type), each
    rounded up to the expressed type: a raised scale never ends up below what was asked."""
    values = np.asarray(scales, np.float64).reshape(-1)
    if isinstance(t, UniformQuantizedType):
        scale = _at_least(float(values.max()), t.expressed)
        return UniformQuantizedType(t.storage, t.expressed, scale, t.zero_point, t.storage_min, t.storage_max)
    rounded = [_at_least(float(s), t.expressed) for s in values]
    if isinstance(t, UniformQuantizedSubChannelType):  # the scales in the order of the block grid
        grid = np.asarray(rounded).reshape(t.scales.shape)
        return UniformQuantizedSubChannelType(
            t.storage, t.expressed, t.block_sizes, grid, t.zero_points, t.storage_min, t.storage_max
        )
    return UniformQuantizedPerAxisType(
        t.storage, t.expressed, t.axis, rounded, t.zero_points, t.storage_min, t.storage_max
    )
