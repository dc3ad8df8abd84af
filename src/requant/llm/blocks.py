"""Weights in blocks of 4 or 8 bits along the input axis: ONNX Runtime's ``MatMulNBits`` layout.

A linear layer ``y = x @ W`` (``W`` is ``[K, N]``: ``K`` inputs, ``N`` outputs) keeps, for each output
column ``n`` and each block ``b`` of ``block_size`` consecutive inputs, a scale ``s[n, b]`` and a zero
point ``z[n, b]``; each weight is an unsigned code ``c`` in ``[0, 2^bits - 1]`` standing for
``(c - z) * s``. This is the MLIR quant dialect's sub-channel type ``!quant.uniform<i4:f32:{0:128}, ...>``
with the codes offset to unsigned storage.

- Symmetric: ``z`` is ``2^(bits - 1)`` (8 for 4 bits, ``MatMulNBits``' default when no zero points are
  given); the block's largest magnitude ``v`` maps to code 0 (``s = v / -2^(bits - 1)``, negative when ``v``
  is positive: the code range ``[-8, 7]`` is used whole, as ONNX Runtime's own quantizer does).
- Asymmetric: the block's range, widened to hold 0, maps onto ``[0, 2^bits - 1]``; ``z`` is stored.

``K`` need not be a multiple of ``block_size``: the last block is padded with zeros (code ``z``).

``MatMulNBits`` (com.microsoft, ONNX Runtime 1.31) reads ``B`` as ``uint8 [N, blocks, block_size * bits / 8]``
(codes along ``K``, the low bits first), ``scales`` as ``[N * blocks]`` and ``zero_points`` packed the same
way as the codes, ``[N * ceil(blocks * bits / 8)]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BlockFormat",
    "Blocked",
    "block_scales",
    "dequantize",
    "dequantized_rows",
    "pack",
    "pack_codes",
    "padded_rows",
    "quantize_with",
    "round_to_nearest",
    "unpack",
]

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class BlockFormat:
    """How a weight is stored: ``bits`` (4 or 8) per code, ``block_size`` inputs per scale (a power of
    two, at least 16: what ``MatMulNBits`` takes), symmetric or not."""

    bits: int = 4
    block_size: int = 128
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"block weights take 4 or 8 bits, not {self.bits}")
        size = self.block_size
        if size < 16 or size & (size - 1):
            raise ValueError(f"block_size must be a power of two of at least 16 (MatMulNBits), not {size}")

    @property
    def top(self) -> int:
        """The largest code."""
        return (1 << self.bits) - 1

    @property
    def middle(self) -> int:
        """The symmetric zero point."""
        return 1 << (self.bits - 1)

    def blocks(self, k: int) -> int:
        return -(-k // self.block_size)


@dataclass(frozen=True)
class Blocked:
    """A ``[K, N]`` weight as codes ``[N, blocks * block_size]`` (uint8, padding included), scales and zero
    points ``[N, blocks]`` (float32, uint8), in ``format``."""

    codes: Array
    scales: Array
    zero_points: Array
    k: int
    format: BlockFormat


def padded_rows(w: Array, fmt: BlockFormat) -> Array:
    """``w`` (``[K, N]``) as ``[N, blocks, block_size]`` float64, the last block padded with zeros."""
    k, n = w.shape
    rows = np.zeros((n, fmt.blocks(k) * fmt.block_size), np.float64)
    rows[:, :k] = np.asarray(w, np.float64).T
    return rows.reshape(n, fmt.blocks(k), fmt.block_size)


def block_scales(w: Array, fmt: BlockFormat) -> tuple[Array, Array]:
    """Round-to-nearest's scales and zero points (``[N, blocks]``) for ``w`` (``[K, N]``, or blocks
    ``[N, blocks, block_size]`` already cut)."""
    blocks = padded_rows(w, fmt) if w.ndim == 2 else np.asarray(w, np.float64)
    if fmt.symmetric:
        at = np.abs(blocks).argmax(axis=-1)
        extreme = np.take_along_axis(blocks, at[..., None], axis=-1)[..., 0]
        scales = extreme / -fmt.middle
        zero_points = np.full(scales.shape, fmt.middle)
    else:
        lo, hi = np.minimum(blocks.min(axis=-1), 0.0), np.maximum(blocks.max(axis=-1), 0.0)
        scales = (hi - lo) / fmt.top
        safe = np.where(scales == 0, 1.0, scales)
        zero_points = np.clip(np.rint(-lo / safe), 0, fmt.top)
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    return scales, zero_points.astype(np.uint8)


def quantize_with(w: Array, scales: Array, zero_points: Array, fmt: BlockFormat, rows: Array | None = None) -> Blocked:
    """``w`` (``[K, N]``) rounded to the nearest code of the given scales and zero points (``rows``: ``w`` as
    :func:`padded_rows` cuts it, when the caller has it: the cut transposes the weight)."""
    blocks = padded_rows(w, fmt) if rows is None else rows
    s, z = scales.astype(np.float64)[..., None], zero_points.astype(np.float64)[..., None]
    codes = np.clip(np.rint(blocks / s) + z, 0, fmt.top).astype(np.uint8)
    return Blocked(codes.reshape(codes.shape[0], -1), scales, zero_points, int(w.shape[0]), fmt)


def round_to_nearest(w: Array, fmt: BlockFormat, rows: Array | None = None) -> Blocked:
    """``w`` (``[K, N]``) in blocks, each rounded to nearest at its own range's scale (``rows``: as
    :func:`quantize_with`'s)."""
    blocks = padded_rows(w, fmt) if rows is None else rows
    scales, zero_points = block_scales(blocks, fmt)
    return quantize_with(w, scales, zero_points, fmt, blocks)


def dequantize(blocked: Blocked) -> Array:
    """The float32 ``[K, N]`` weight the codes stand for."""
    return np.ascontiguousarray(dequantized_rows(blocked).T)


def dequantized_rows(blocked: Blocked) -> Array:
    """The float32 weight the codes stand for, one row per output: ``[N, K]`` (:func:`dequantize` transposed)."""
    fmt, n = blocked.format, blocked.codes.shape[0]
    codes = blocked.codes.reshape(n, -1, fmt.block_size).astype(np.float32)
    values = (codes - blocked.zero_points.astype(np.float32)[..., None]) * blocked.scales[..., None]
    return values.reshape(n, -1)[:, : blocked.k]


def pack_codes(codes: Array, bits: int) -> Array:
    """Codes (``[..., M]``, uint8) packed along the last axis, the first in the low bits."""
    if bits == 8:
        return codes.astype(np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    packed: Array = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed


def pack(blocked: Blocked) -> tuple[Array, Array, Array | None]:
    """``MatMulNBits``' ``B`` (``[N, blocks, block_size * bits / 8]``), ``scales`` (``[N * blocks]``) and
    ``zero_points`` (packed, ``[N * ceil(blocks * bits / 8)]``; None when symmetric: its default)."""
    fmt, n = blocked.format, blocked.codes.shape[0]
    b = pack_codes(blocked.codes.reshape(n, -1, fmt.block_size), fmt.bits)
    zero_points = None if fmt.symmetric else pack_codes(blocked.zero_points, fmt.bits).reshape(-1)
    return b, blocked.scales.astype(np.float32).reshape(-1), zero_points


def _unpack_codes(packed: Array, bits: int, count: int) -> Array:
    if bits == 8:
        return packed[..., :count].astype(np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :count].astype(np.uint8)


def unpack(b: Array, scales: Array, zero_points: Array | None, k: int, fmt: BlockFormat) -> Blocked:
    """The blocks ``MatMulNBits``' inputs hold (the inverse of :func:`pack`)."""
    n, blocks = b.shape[0], b.shape[1]
    codes = _unpack_codes(b, fmt.bits, fmt.block_size).reshape(n, blocks * fmt.block_size)
    if zero_points is None:
        zps = np.full((n, blocks), fmt.middle, np.uint8)
    else:
        zps = _unpack_codes(zero_points.reshape(n, -1), fmt.bits, blocks)
    return Blocked(codes, np.asarray(scales, np.float32).reshape(n, blocks), zps, k, fmt)
