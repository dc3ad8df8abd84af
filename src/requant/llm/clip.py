"""Per-block clipping: each block's range shrunk to whichever of a few ratios leaves the least error on the
layer's output (the clipping search of AWQ, Lin et al., 2023, measured on the layer's own input moments).

A block's weights ``w_b`` (``block_size`` inputs of one output) rounded at a scale ``s`` leave the error
``e = q(w_b, s) - w_b``; its share of the layer's output error over the calibration inputs is ``e^T H_bb e``,
``H_bb`` the block's diagonal block of ``H = sum x x^T``. Shrinking the range (largest magnitude, or both
ends when asymmetric) by a ratio ``r < 1`` clips the block's extreme weights and rounds every other one on
a finer grid; each ratio of :data:`RATIOS` is tried and each block keeps its best, which never does worse
than the full range (``r = 1`` is tried).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from requant.llm.blocks import BlockFormat, block_scales, padded_rows

__all__ = ["RATIOS", "clipped_scales"]

Array = npt.NDArray[Any]
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def _diagonal_blocks(h: Array, fmt: BlockFormat) -> Array:
    """``H``'s diagonal blocks ``[blocks, block_size, block_size]`` (the padding's: zeros)."""
    k, size = h.shape[0], fmt.block_size
    full = np.zeros((fmt.blocks(k) * size,) * 2)
    full[:k, :k] = h
    return np.stack([full[i : i + size, i : i + size] for i in range(0, full.shape[0], size)])


def _errors(blocks: Array, scales: Array, zero_points: Array, hb: Array | None, top: int) -> Array:
    """Each block's ``e^T H_bb e`` (``[N, blocks]``) at these scales (float32 arithmetic: it only ranks); ``hb``
    None: ``H = I``, ``e^T e``."""
    s, z = scales[..., None], zero_points.astype(np.float32)[..., None]
    e = np.divide(blocks, s)  # (clip(rint(w / s) + z, 0, top) - z) * s - w, in place: [N, blocks, size]
    np.rint(e, out=e)
    e += z
    np.clip(e, 0, top, out=e)
    e -= z
    e *= s
    e -= blocks
    if hb is None:
        squares: Array = np.einsum("nbi,nbi->nb", e, e)
        return squares
    weighted = np.matmul(e.transpose(1, 0, 2), hb).transpose(1, 0, 2)  # each block's e @ H_bb: batched, BLAS
    found: Array = np.einsum("nbi,nbi->nb", weighted, e)
    return found


def clipped_scales(w: Array, h: Array | None, fmt: BlockFormat, ratios: tuple[float, ...] = RATIOS,
                   rows: Array | None = None) -> tuple[Array, Array]:  # fmt: skip
    """Scales and zero points (``[N, blocks]``) for ``w`` (``[K, N]``): each block's range shrunk by the ratio
    of ``ratios`` that leaves the least error on the layer's output (inputs of second moments ``h``; None: the
    identity, the error on the weights themselves, as an embedding's rows are its output). A range
    shrunk by ``r`` has ``r`` times the scale and the same zero point (both ends shrink toward 0). ``rows``: ``w``
    as :func:`~requant.llm.blocks.padded_rows` cuts it, when the caller has it."""
    blocks = (padded_rows(w, fmt) if rows is None else rows).astype(np.float32)
    hb = None if h is None else _diagonal_blocks(np.asarray(h, np.float64), fmt).astype(np.float32)
    full, zero_points = block_scales(blocks, fmt)
    best_ratio = np.ones(full.shape, np.float32)
    best = _errors(blocks, full, zero_points, hb, fmt.top)
    for ratio in ratios:
        if ratio == 1.0:
            continue
        errors = _errors(blocks, full * np.float32(ratio), zero_points, hb, fmt.top)
        better = errors < best
        best = np.where(better, errors, best)
        best_ratio = np.where(better, np.float32(ratio), best_ratio)
    return (full * best_ratio).astype(np.float32), zero_points.astype(np.uint8)
