"""The five quantized types of MLIR's ``quant`` dialect, as frozen, validated values.

``str(t)`` is MLIR 22's canonical text for ``t``, byte for byte; see
:mod:`requant.types.syntax` for the way back. Constructors check everything
MLIR's verifiers check, plus what MLIR lets through but cannot use itself
(documented in ``docs/types.md``): NaN scales, sub-channel zero points outside
the storage type (MLIR aborts on them) and a block axis not below the rank of
the scale grid. What MLIR accepts and uses but no target can store, a zero
point of a uniform or per-axis type outside its storage type (MLIR's own tests
write ``!quant.uniform<i8:f32, 2.0:128>``) and a block axis given twice (the
last size wins), is accepted and printed as MLIR prints it; ``t.problems()``
names it, and requant's verifier refuses it on a value of a model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral, Real
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from requant.errors import QuantTypeError
from requant.types.floats import FLOAT_FORMATS, FloatFormat, format_diag, format_float, round_array_to_format
from requant.types.storage import StorageType, storage_type

__all__ = [
    "AnyQuantizedType",
    "CalibratedQuantizedType",
    "QuantizedType",
    "UniformQuantizedPerAxisType",
    "UniformQuantizedSubChannelType",
    "UniformQuantizedType",
    "UniformType",
    "expressed_format",
    "normalize",
]


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise QuantTypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def expressed_format(name: object) -> FloatFormat:
    """The float format called ``name``; QuantTypeError listing the allowed names otherwise."""
    fmt = FLOAT_FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        allowed = ", ".join(FLOAT_FORMATS)
        raise QuantTypeError(f"expressed type must be floating point (one of {allowed}), got {name!r}")
    return fmt


def _scale_range_error(value: float, fmt: FloatFormat) -> QuantTypeError:
    lo, hi = fmt.scale_range
    return QuantTypeError(
        f"scale {format_diag(value)} out of expressed type range [{format_diag(lo)}, {format_diag(hi)}]"
    )


def _scale(value: object, fmt: FloatFormat) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise QuantTypeError(f"scale must be a real number, got {value!r}")
    scale = float(value)
    lo, hi = fmt.scale_range
    if not lo <= scale <= hi:  # also rejects NaN, which MLIR accepts
        raise _scale_range_error(scale, fmt)
    return scale


def _zero_point_error(zp: int, storage: StorageType) -> QuantTypeError:
    return QuantTypeError(f"zero point {zp} out of storage type {storage} range [{storage.min}, {storage.max}]")


def _zero_point(value: object) -> int:
    """A zero point as MLIR holds one: any int64 (one outside the storage type is for ``problems()``)."""
    zp = _int("zero point", value)
    if not -(2**63) <= zp < 2**63:
        raise QuantTypeError(f"zero point {zp} does not fit in 64 bits")
    return zp


def _outside(zero_points: Iterable[int], storage: StorageType) -> list[str]:
    """The problem of the first zero point outside ``storage``'s range, if any (``problems()``)."""
    bad = next((z for z in zero_points if not storage.min <= z <= storage.max), None)
    return [] if bad is None else [str(_zero_point_error(bad, storage))]


def _array(values: object, what: str, integer: bool) -> npt.NDArray[Any]:
    """``values`` as a rectangular numpy array of rank >= 1 of integers (or real numbers)."""
    kind = "an integer" if integer else "a real number"
    if isinstance(values, (str, bytes)):
        raise QuantTypeError(f"{what} must be a sequence or array, got {values!r}")
    if not isinstance(values, np.ndarray) and isinstance(values, Iterable):
        values = list(values)
    try:
        array = np.asarray(values)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise QuantTypeError(f"{what}: tensor literal is invalid; ranks are not consistent between elements") from exc
    if array.ndim == 0:
        raise QuantTypeError(f"{what} must be a sequence or array of rank >= 1, got {values!r}")
    if array.size == 0:
        raise QuantTypeError(f"{what} must not be empty")
    if array.dtype.kind not in ("iu" if integer else "iuf"):
        raise QuantTypeError(f"each of the {what} must be {kind} (got an array of {array.dtype})")
    return array


def _scale_array(values: object, fmt: FloatFormat) -> npt.NDArray[np.float64]:
    scales = _array(values, "scales", integer=False).astype(np.float64)
    lo, hi = fmt.scale_range
    bad = np.flatnonzero(~((scales >= lo) & (scales <= hi)))  # NaN fails both comparisons
    if bad.size:
        raise _scale_range_error(float(scales.flat[bad[0]]), fmt)
    return scales


def _zero_point_array(
    values: object, storage: StorageType, shape: tuple[int, ...], in_range: bool = True
) -> npt.NDArray[np.int64]:
    """``in_range``: refuse zero points outside the storage type (sub-channel types, on which MLIR
    aborts); per-axis ones are MLIR's to accept (``problems()`` names them)."""
    if values is None:
        return np.zeros(shape, dtype=np.int64)
    zps = _array(values, "zero points", integer=True)
    if zps.shape != shape:
        raise QuantTypeError(f"shape of scales and zeroPoints ({list(shape)} vs {list(zps.shape)}) does not match")
    if in_range:
        bad = np.flatnonzero((zps < storage.min) | (zps > storage.max))
        if bad.size:
            raise _zero_point_error(int(zps.flat[bad[0]]), storage)
    elif zps.dtype == np.uint64 and (zps >= 2**63).any():  # (other integer arrays fit in int64)
        _zero_point(int(zps.max()))  # raises, as for one zero point
    return zps.astype(np.int64)


def _bounds(storage: StorageType, lo: object, hi: object) -> tuple[int, int]:
    smin = storage.min if lo is None else _int("storage_min", lo)
    smax = storage.max if hi is None else _int("storage_max", hi)
    if smin < storage.min:
        raise QuantTypeError(f"illegal storage type minimum: {smin}")
    if smax > storage.max:
        raise QuantTypeError(f"illegal storage type maximum: {smax}")
    if smax - smin <= 0:
        raise QuantTypeError(f"illegal storage min and storage max: ({smin}:{smax})")
    return smin, smax


class QuantizedType:
    """Base of the five types: immutable, hashable, compared by value."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _set(self, **fields: object) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizedType) and type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def problems(self) -> list[str]:
        """Why no target can store values of this type although MLIR accepts it (empty: none)."""
        return []


class _StoredType(QuantizedType):
    """A type with a storage integer type and optional storage bounds."""

    __slots__ = ("_storage", "storage_max", "storage_min")
    _storage: StorageType
    storage_min: int
    storage_max: int

    def _init_storage(self, storage: object, lo: object, hi: object) -> None:
        st = storage_type(storage)  # type: ignore[arg-type]
        smin, smax = _bounds(st, lo, hi)
        self._set(_storage=st, storage_min=smin, storage_max=smax)

    @property
    def storage(self) -> str:
        """Canonical spelling of the storage type, e.g. ``"i8"``."""
        return str(self._storage)

    @property
    def storage_type(self) -> StorageType:
        """The storage type as a value with width, signedness and range."""
        return self._storage

    @property
    def is_signed(self) -> bool:
        """Whether the storage type is signed."""
        return self._storage.signed

    @property
    def storage_width(self) -> int:
        """Bits of the storage type."""
        return self._storage.width

    @property
    def has_storage_bounds(self) -> bool:
        """Whether the bounds differ from the storage type's full range."""
        return (self.storage_min, self.storage_max) != (self._storage.min, self._storage.max)

    def _storage_text(self) -> str:
        bounds = f"<{self.storage_min}:{self.storage_max}>" if self.has_storage_bounds else ""
        return f"{self._storage}{bounds}"


class _UniformBase(_StoredType):
    __slots__ = ("_fmt",)
    _fmt: FloatFormat

    @property
    def expressed(self) -> str:
        """The expressed floating-point type, e.g. ``"f32"``."""
        return self._fmt.name

    @property
    def expressed_format(self) -> FloatFormat:
        """The expressed type's format (precision, range)."""
        return self._fmt


class UniformQuantizedType(_UniformBase):
    """Per-layer quantization: ``!quant.uniform<i8:f32, 2.000000e-02:-3>``."""

    __slots__ = ("scale", "zero_point")
    scale: float
    zero_point: int

    def __init__(
        self,
        storage: str,
        expressed: str,
        scale: float,
        zero_point: int = 0,
        storage_min: int | None = None,
        storage_max: int | None = None,
    ) -> None:
        self._init_storage(storage, storage_min, storage_max)
        fmt = expressed_format(expressed)
        self._set(_fmt=fmt, scale=_scale(scale, fmt), zero_point=_zero_point(zero_point))

    def _key(self) -> tuple[object, ...]:
        return (self._storage, self.storage_min, self.storage_max, self.expressed, self.scale, self.zero_point)

    @property
    def float_range(self) -> tuple[float, float]:
        """The expressed values its storage range stands for: ``(storage_min - zero_point) * scale`` to
        ``(storage_max - zero_point) * scale``."""
        return (self.storage_min - self.zero_point) * self.scale, (self.storage_max - self.zero_point) * self.scale

    def problems(self) -> list[str]:
        return _outside([self.zero_point], self._storage)

    def __str__(self) -> str:
        zp = f":{self.zero_point}" if self.zero_point else ""
        return f"!quant.uniform<{self._storage_text()}:{self.expressed}, {format_float(self.scale)}{zp}>"


class UniformQuantizedPerAxisType(_UniformBase):
    """Per-axis quantization: ``!quant.uniform<i8:f32:1, {2.000000e+00,3.000000e+00:5}>``."""

    __slots__ = ("_text", "axis", "scales", "zero_points")
    axis: int
    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    _text: str

    def __init__(
        self,
        storage: str,
        expressed: str,
        axis: int,
        scales: Sequence[float] | npt.ArrayLike,
        zero_points: Sequence[int] | npt.ArrayLike | None = None,
        storage_min: int | None = None,
        storage_max: int | None = None,
    ) -> None:
        self._init_storage(storage, storage_min, storage_max)
        fmt = expressed_format(expressed)
        dim = _int("quantized dimension", axis)
        if dim < 0:
            raise QuantTypeError(f"illegal quantized dimension: {dim}")
        scale_array = _scale_array(scales, fmt)
        if scale_array.ndim != 1:
            raise QuantTypeError(f"per-axis scales must be one-dimensional, got shape {scale_array.shape}")
        if zero_points is not None:
            count = _array(zero_points, "zero points", integer=True).size
            if count != scale_array.size:
                raise QuantTypeError(f"illegal number of scales and zeroPoints: {scale_array.size}, {count}")
        zp_array = _zero_point_array(zero_points, self._storage, scale_array.shape, in_range=False)
        scale_list: list[float] = scale_array.tolist()
        zp_list: list[int] = zp_array.tolist()
        self._set(_fmt=fmt, axis=dim, scales=tuple(scale_list), zero_points=tuple(zp_list))

    def _key(self) -> tuple[object, ...]:
        return (
            self._storage,
            self.storage_min,
            self.storage_max,
            self.expressed,
            self.axis,
            self.scales,
            self.zero_points,
        )

    def problems(self) -> list[str]:
        return _outside(self.zero_points, self._storage)

    def __str__(self) -> str:
        try:  # printed more than once (annotation text, report): each scale costs a few microseconds
            return self._text
        except AttributeError:
            pass
        params = ",".join(
            format_float(s) + (f":{z}" if z else "") for s, z in zip(self.scales, self.zero_points, strict=True)
        )
        text = f"!quant.uniform<{self._storage_text()}:{self.expressed}:{self.axis}, {{{params}}}>"
        object.__setattr__(self, "_text", text)
        return text


class UniformQuantizedSubChannelType(_UniformBase):
    """Blockwise quantization: ``!quant.uniform<i8:f32:{0:1, 1:2}, {{s00, s01}, {s10, s11}}>``.

    ``block_sizes`` maps a tensor axis to its block size (order kept as given);
    axes not named have one block spanning the whole dimension. ``scales`` and
    ``zero_points`` are read-only numpy arrays of the block grid's shape; the
    scales are rounded to the expressed type, as MLIR stores them.
    """

    __slots__ = ("block_sizes", "scales", "zero_points")
    block_sizes: tuple[tuple[int, int], ...]
    scales: npt.NDArray[np.float64]
    zero_points: npt.NDArray[np.int64]

    def __init__(
        self,
        storage: str,
        expressed: str,
        block_sizes: Mapping[int, int] | Iterable[tuple[int, int]],
        scales: npt.ArrayLike,
        zero_points: npt.ArrayLike | None = None,
        storage_min: int | None = None,
        storage_max: int | None = None,
    ) -> None:
        self._init_storage(storage, storage_min, storage_max)
        fmt = expressed_format(expressed)
        pairs = list(block_sizes.items()) if isinstance(block_sizes, Mapping) else list(block_sizes)
        blocks: list[tuple[int, int]] = []
        for pair in pairs:
            axis, size = pair
            axis, size = _int("quantized dimension", axis), _int("block size", size)
            if axis < 0:
                raise QuantTypeError(f"illegal quantized dimension: {axis}")
            if size <= 0:
                raise QuantTypeError(f"illegal block size: {size}")
            blocks.append((axis, size))  # a repeated axis: MLIR keeps both, the last size counts
        scale_array = round_array_to_format(_scale_array(scales, fmt), fmt)
        zp_array = _zero_point_array(zero_points, self._storage, scale_array.shape)
        for axis, _ in blocks:
            if axis >= scale_array.ndim:
                raise QuantTypeError(
                    f"quantized dimension {axis} must be less than the rank of the scales {scale_array.ndim}"
                )
        scale_array.flags.writeable = False
        zp_array.flags.writeable = False
        self._set(_fmt=fmt, block_sizes=tuple(blocks), scales=scale_array, zero_points=zp_array)

    @property
    def block_size_map(self) -> dict[int, int]:
        """Block sizes as a dict axis -> size (insertion order is the written order; an axis given
        twice has its last size, as in MLIR)."""
        return dict(self.block_sizes)

    def problems(self) -> list[str]:
        axes = [axis for axis, _ in self.block_sizes]
        twice = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
        return [] if twice is None else [f"quantized dimension {twice} has more than one block size"]

    def _key(self) -> tuple[object, ...]:
        return (
            self._storage,
            self.storage_min,
            self.storage_max,
            self.expressed,
            self.block_sizes,
            self.scales.shape,
            self.scales.tobytes(),
            self.zero_points.tobytes(),
        )

    def __str__(self) -> str:
        blocks = ", ".join(f"{a}:{b}" for a, b in self.block_sizes)
        return f"!quant.uniform<{self._storage_text()}:{self.expressed}:{{{blocks}}}, {self._dense_text()}>"

    def _dense_text(self) -> str:
        fmt = self._fmt
        cells = [
            format_float(float(s), fmt, fmt.scale_range) + (f":{int(z)}" if z else "")
            for s, z in zip(self.scales.flat, self.zero_points.flat, strict=True)
        ]

        def nest(level: int, start: int) -> tuple[str, int]:
            if level == self.scales.ndim:
                return cells[start], start + 1
            parts = []
            for _ in range(self.scales.shape[level]):
                text, start = nest(level + 1, start)
                parts.append(text)
            return "{" + ", ".join(parts) + "}", start

        return nest(0, 0)[0]


class AnyQuantizedType(_StoredType):
    """A storage type with no parameters yet: ``!quant.any<i8:f32>``."""

    __slots__ = ("_fmt",)
    _fmt: FloatFormat | None

    def __init__(
        self,
        storage: str,
        expressed: str | None = None,
        storage_min: int | None = None,
        storage_max: int | None = None,
    ) -> None:
        self._init_storage(storage, storage_min, storage_max)
        self._set(_fmt=None if expressed is None else expressed_format(expressed))

    @property
    def expressed(self) -> str | None:
        """The expressed floating-point type, if given."""
        return None if self._fmt is None else self._fmt.name

    def _key(self) -> tuple[object, ...]:
        return (self._storage, self.storage_min, self.storage_max, self.expressed)

    def __str__(self) -> str:
        expressed = "" if self._fmt is None else f":{self._fmt.name}"
        return f"!quant.any<{self._storage_text()}{expressed}>"


class CalibratedQuantizedType(QuantizedType):
    """An observed range, before parameters are chosen: ``!quant.calibrated<f32<-1.0:1.0>>``."""

    __slots__ = ("_fmt", "max", "min")
    _fmt: FloatFormat
    min: float
    max: float

    def __init__(self, expressed: str, min: float, max: float) -> None:  # noqa: A002 - MLIR's names
        fmt = expressed_format(expressed)
        values: list[float] = []
        for name, value in (("min", min), ("max", max)):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise QuantTypeError(f"calibrated {name} must be a real number, got {value!r}")
            values.append(float(value))
        lo, hi = values
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
            raise QuantTypeError(f"illegal min and max: ({format_diag(lo)}:{format_diag(hi)})")
        self._set(_fmt=fmt, min=lo, max=hi)

    @property
    def expressed(self) -> str:
        """The expressed floating-point type."""
        return self._fmt.name

    def _key(self) -> tuple[object, ...]:
        return (self.expressed, self.min, self.max, math.copysign(1.0, self.min))

    def __str__(self) -> str:
        return f"!quant.calibrated<{self.expressed}<{format_float(self.min)}:{format_float(self.max)}>>"


UniformType: TypeAlias = UniformQuantizedType | UniformQuantizedPerAxisType | UniformQuantizedSubChannelType


def normalize(t: QuantizedType) -> QuantizedType:
    """The simplest equivalent form of a sub-channel type; other types unchanged.

    One scale: per-layer. Exactly one grid dimension longer than 1 whose block
    size is 1: per-axis on that dimension. (With a larger block on that
    dimension, no per-axis type says the same thing, so the type stays.)
    """
    if not isinstance(t, UniformQuantizedSubChannelType):
        return t
    bounds = {"storage_min": t.storage_min, "storage_max": t.storage_max}
    if t.scales.size == 1:
        return UniformQuantizedType(
            t.storage, t.expressed, float(t.scales.flat[0]), int(t.zero_points.flat[0]), **bounds
        )
    long_dims = [d for d, n in enumerate(t.scales.shape) if n > 1]
    if len(long_dims) == 1 and t.block_size_map.get(long_dims[0]) == 1:
        return UniformQuantizedPerAxisType(
            t.storage,
            t.expressed,
            long_dims[0],
            [float(s) for s in t.scales.flat],
            [int(z) for z in t.zero_points.flat],
            **bounds,
        )
    return t
