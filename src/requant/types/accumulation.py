"""How integer kernels add their products: exactly in int32, or in int16 pairs that saturate.

An int8 dot product ``sum_k a[k] * w[k]`` is exact in int32 for any realistic length. Kernels do
not always add that way. On x86 CPUs without VNNI, the uint8 x int8 kernels multiply with
``vpmaddubsw``: it takes the reduction two elements at a time, ``a[2j] * w[2j] + a[2j + 1] *
w[2j + 1]``, and stores each pair's sum in int16, saturating at -32768 and 32767, before the pairs
are widened and added in int32. With full-range weights one pair can reach 255 * 127 * 2 = 64770.

:class:`Accumulation` describes one way of adding, and is used both ways round:

- ``dot`` computes what the kernel computes (saturation included): the reference that shows the
  damage;
- ``pair_extremes`` / ``overflow`` bound what any input inside per-element bounds can make each
  pair reach: the proof that a weight matrix cannot saturate, or by how much it can.

The reduction order is the kernel's (for a convolution, :mod:`requant.targets.kernels` says
which); a reduction of odd length is padded with a zero, as the kernels pad to whole pairs.
This module imports nothing else of requant's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["INT16_PAIRS", "INT32", "Accumulation"]

Array = npt.NDArray[Any]
Bound = npt.ArrayLike  # per-element bounds: a scalar for all, ``[K]``, or ``[N, K]``
_CHUNK = 1 << 22  # pair products computed at a time by ``dot`` (int64 elements)
_BLOCK = 1 << 14  # weight elements whose pairs ``pair_overflows`` bounds at a time


@dataclass(frozen=True)
class Accumulation:
    """An accumulation scheme: ``pair_bits`` set means neighbouring products are added in a
    saturating integer of that width before the exact int32 sum."""

    name: str
    pair_bits: int | None = None

    def __str__(self) -> str:
        return self.name

    @property
    def saturates(self) -> bool:
        return self.pair_bits is not None

    @property
    def pair_limits(self) -> tuple[int, int]:
        """The smallest and largest pair sum it can hold (int32's range when it does not pair)."""
        bits = self.pair_bits or 32
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def dot(self, a: Array, w: Array) -> Array:
        """``a @ w`` as the kernel computes it: ``a`` is ``[..., K]`` (raw stored integers, zero point
        not removed: the kernels multiply the stored values), ``w`` is ``[K, N]``. Returns int64."""
        a, w = np.asarray(a, np.int64), np.asarray(w, np.int64)
        if a.shape[-1] != w.shape[0]:
            raise ValueError(f"reduction lengths differ: {a.shape[-1]} and {w.shape[0]}")
        if not self.saturates:
            exact: Array = np.matmul(a, w)
            return exact
        a, w = _even(a, -1), _even(w, 0)
        lo, hi = self.pair_limits
        flat = a.reshape(-1, a.shape[-1])
        out = np.zeros((flat.shape[0], w.shape[1]), np.int64)
        pairs = w.shape[0] // 2
        step = max(1, _CHUNK // max(1, flat.shape[0] * w.shape[1]))
        for start in range(0, pairs, step):
            j = slice(2 * start, 2 * min(pairs, start + step))
            left = flat[:, j][:, 0::2, None] * w[j][0::2][None]  # [M, pairs, N]
            right = flat[:, j][:, 1::2, None] * w[j][1::2][None]
            out += np.clip(left + right, lo, hi).sum(axis=1)
        return out.reshape(*a.shape[:-1], w.shape[1])

    def pair_extremes(self, w: Array, lo: Bound, hi: Bound) -> tuple[Array, Array]:
        """The largest and smallest sum each pair of each row of ``w`` (``[N, K]``) can reach when
        input ``k`` is anything in ``[lo[k], hi[k]]`` (scalars, arrays of ``K``, or ``[N, K]``): two
        arrays ``[N, ceil(K / 2)]``. A sum is linear in each input, so its extremes are at the
        bounds: a positive weight's product is largest at ``hi``, a negative one's at ``lo``.
        Integer weights give exact int64 sums; float weights (unrounded) give float sums."""
        w = _numbers(w)
        lows, highs = np.asarray(lo, w.dtype), np.asarray(hi, w.dtype)
        if lows.size == 1 and highs.size == 1:  # one range for all inputs: sum the pairs first
            low, high = lows.reshape(-1)[0], highs.reshape(-1)[0]
            sums, magnitudes = _pair_sums(w), _pair_sums(np.abs(w))
            up, down = magnitudes + sums, sums - magnitudes  # twice the positive and the negative parts
            if low == 0:  # uint8 inputs: the common case, half the arithmetic
                top, bottom = high * up, high * down
            else:
                top, bottom = high * up + low * down, low * up + high * down
            return (top >> 1, bottom >> 1) if w.dtype.kind == "i" else (top / 2, bottom / 2)  # exact: even
        positive, negative = np.maximum(w, 0), np.minimum(w, 0)
        return _pair_sums(positive * highs + negative * lows), _pair_sums(positive * lows + negative * highs)

    def overflow(self, w: Array, lo: Bound, hi: Bound) -> Array:
        """By how much each pair of each row can leave the pair range at worst (``[N, pairs]``,
        0 where it cannot): the proof is ``overflow(...).max() == 0``. Always 0 when nothing pairs."""
        return self.overflow_and_margin(w, lo, hi)[0]

    def margin(self, w: Array, lo: Bound, hi: Bound) -> int:
        """How far the closest pair stays from the pair range (negative: by how much one can leave it)."""
        return self.overflow_and_margin(w, lo, hi)[1]

    def overflow_and_margin(self, w: Array, lo: Bound, hi: Bound) -> tuple[Array, int]:
        """``overflow`` and ``margin`` from one pass over ``w`` (a large weight's pair extremes are
        most of the proof's time)."""
        up, down, margin = self.pair_overflows(w, lo, hi)
        return np.maximum(up, down, out=up), margin

    def pair_overflows(self, w: Array, lo: Bound, hi: Bound) -> tuple[Array, Array, int]:
        """How far each pair of each row of ``w`` (``[N, K]``, integers) can go above the pair range
        and below it at worst (two int64 arrays ``[N, pairs]``, 0 where it cannot), and the margin.

        Computed a block of rows at a time: the temporaries of a whole large weight (a classifier's
        8210 x 1024) cost more in fresh memory than in arithmetic (0.31 s for its first pass here,
        0.07 s for the next ones)."""
        w = np.asarray(w)
        if w.dtype.kind not in "iu":
            w = w.astype(np.int64)
        n, k = w.shape
        pairs = (k + 1) // 2
        low, high = self.pair_limits
        up, down = np.zeros((n, pairs), np.int64), np.zeros((n, pairs), np.int64)
        if not self.saturates:
            return up, down, int(high)
        lows, highs = np.asarray(lo), np.asarray(hi)
        margin = int(high)
        rows = max(1, _BLOCK // max(1, k))
        for start in range(0, n, rows):
            block = slice(start, start + rows)
            top, bottom = self.pair_extremes(
                w[block], lows[block] if lows.ndim == 2 else lows, highs[block] if highs.ndim == 2 else highs
            )
            np.maximum(top - high, 0, out=up[block])
            np.maximum(low - bottom, 0, out=down[block])
            if top.size:
                margin = min(margin, int((high - top).min()), int((bottom - low).min()))
        return up, down, margin


def _numbers(array: Array) -> Array:
    """int64 for integers (exact products), float64 otherwise."""
    array = np.asarray(array)
    return array.astype(np.int64 if np.issubdtype(array.dtype, np.integer) else np.float64, copy=False)


def _pair_sums(array: Array) -> Array:
    """``array[:, 2j] + array[:, 2j + 1]`` (``[N, K]`` -> ``[N, ceil(K / 2)]``)."""
    even = _even(array, -1)
    pairs: Array = even[:, 0::2] + even[:, 1::2]
    return pairs


def _even(array: Array, axis: int) -> Array:
    """``array`` padded with a zero along ``axis`` to an even length (whole pairs)."""
    if array.shape[axis] % 2 == 0:
        return array
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, 1)
    return np.pad(array, pad)


INT32 = Accumulation("int32")
INT16_PAIRS = Accumulation("int16 pairs", pair_bits=16)
