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


def _errors(blocks: Array, scales: Array, zero_points: Array, hb: Array, fmt: BlockFormat) -> Array:
    """Each block's ``e^T H_bb e`` (``[N, blocks]``) at these scales."""
    s, z = scales.astype(np.float64)[..., None], zero_points.astype(np.float64)[..., None]
    e = (np.clip(np.rint(blocks / s) + z, 0, fmt.top) - z) * s - blocks  # [N, blocks, size]
    weighted = np.einsum("nbi,bij->nbj", e, hb, optimize=True)
    found: Array = np.sum(weighted * e, axis=-1)
    return found


def clipped_scales(w: Array, h: Array, fmt: BlockFormat, ratios: tuple[float, ...] = RATIOS) -> tuple[Array, Array]:
    """Scales and zero points (``[N, blocks]``) for ``w`` (``[K, N]``): each block's range shrunk by the ratio
    of ``ratios`` that leaves the least error on the layer's output (inputs of second moments ``h``)."""
    blocks = padded_rows(w, fmt)
    hb = _diagonal_blocks(np.asarray(h, np.float64), fmt)
    best_scales, best_zero_points = block_scales(blocks, fmt)
    best = _errors(blocks, best_scales, best_zero_points, hb, fmt)
    for ratio in ratios:
        if ratio == 1.0:
            continue
        scales, zero_points = block_scales(blocks * ratio, fmt)  # the range shrunk, the weights as they are
        errors = _errors(blocks, scales, zero_points, hb, fmt)
        better = errors < best
        best = np.where(better, errors, best)
        best_scales = np.where(better, scales, best_scales)
        best_zero_points = np.where(better, zero_points, best_zero_points)
    return best_scales.astype(np.float32), best_zero_points.astype(np.uint8)
