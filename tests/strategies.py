"""Hypothesis strategies for valid quantized types."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from requant.types import (
    FLOAT_FORMATS,
    AnyQuantizedType,
    CalibratedQuantizedType,
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
)
from requant.types.storage import StorageType

# MLIR 22.1.8 aborts on f80/f128 expressed types: the MLIR tests leave them out.
MLIR_EXPRESSED = [name for name in FLOAT_FORMATS if name not in ("f80", "f128")]
ALL_EXPRESSED = list(FLOAT_FORMATS)


@st.composite
def storages(draw: st.DrawFn) -> tuple[StorageType, int | None, int | None]:
    width = draw(st.one_of(st.sampled_from([4, 8, 16, 32]), st.integers(1, 32)))
    s = StorageType(draw(st.booleans()), width)
    if draw(st.booleans()):
        return s, None, None
    lo = draw(st.integers(s.min, s.max - 1))
    hi = draw(st.integers(lo + 1, s.max))
    return s, lo, hi


def scales(name: str) -> st.SearchStrategy[float]:
    lo, hi = FLOAT_FORMATS[name].scale_range
    nice = st.sampled_from([1.0, 0.5, 0.1, 2.0 / 255, 1.0 / 127, 0.0186274509803921, 3.0, 0.25])
    return st.one_of(st.floats(min_value=lo, max_value=hi), nice.filter(lambda v: lo <= v <= hi))


def zero_points(s: StorageType, nonnegative_signed_half: bool = False) -> st.SearchStrategy[int]:
    if nonnegative_signed_half:  # MLIR prints sub-channel zero points as signed N-bit numbers
        return st.integers(0, (1 << (s.width - 1)) - 1)
    return st.integers(s.min, s.max)


@st.composite
def quantized_types(draw: st.DrawFn, expressed: list[str] = ALL_EXPRESSED, for_mlir: bool = False) -> QuantizedType:
    kind = draw(st.sampled_from(["uniform", "per_axis", "sub_channel", "any", "calibrated"]))
    name = draw(st.sampled_from(expressed))
    s, lo, hi = draw(storages())
    sto = str(s)
    if kind == "uniform":
        return UniformQuantizedType(sto, name, draw(scales(name)), draw(zero_points(s)), lo, hi)
    if kind == "per_axis":
        n = draw(st.integers(1, 6))
        return UniformQuantizedPerAxisType(
            sto,
            name,
            draw(st.integers(0, 4)),
            draw(st.lists(scales(name), min_size=n, max_size=n)),
            draw(st.lists(zero_points(s), min_size=n, max_size=n)),
            lo,
            hi,
        )
    if kind == "sub_channel":
        shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        count = 1
        for d in shape:
            count *= d
        axes = draw(st.permutations(range(len(shape))))
        blocks = {a: draw(st.integers(1, 8)) for a in axes[: draw(st.integers(0, len(shape)))]}
        flat_s = draw(st.lists(scales(name), min_size=count, max_size=count))
        flat_z = draw(st.lists(zero_points(s, for_mlir), min_size=count, max_size=count))
        return UniformQuantizedSubChannelType(
            sto, name, blocks, np.array(flat_s).reshape(shape), np.array(flat_z).reshape(shape), lo, hi
        )
    if kind == "any":
        return AnyQuantizedType(sto, draw(st.one_of(st.none(), st.just(name))), lo, hi)
    a = draw(st.floats(allow_nan=False, allow_infinity=False))
    b = draw(st.floats(allow_nan=False, allow_infinity=False))
    if a == b:
        b = math.nextafter(a, math.inf if a < 1e308 else -math.inf)
    return CalibratedQuantizedType(name, min(a, b), max(a, b))
