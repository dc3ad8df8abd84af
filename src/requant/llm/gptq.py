"""GPTQ for block weights: each input's weights rounded in turn, their error spread onto the inputs not yet
rounded, in proportion to how the layer's inputs correlate (Frantar et al., "GPTQ", 2022; the same error
feedback as :mod:`requant.encoding.rounding`, with a scale per block instead of per row).

``h`` is ``sum x x^T`` over the layer's calibration inputs (``[K, K]``), damped as there
(:func:`~requant.encoding.rounding.damped`: ``DAMPING`` times the mean of its diagonal; an input never seen gets
a diagonal of 1). The inputs are taken in one of two orders:

- ``"natural"``: ``0, 1, ..., K - 1``; each block's scales are found when its first input is reached, from the
  weights as the errors before it left them (GPTQ's group-wise quantization);
- ``"activation"``: the inputs with the largest ``h`` diagonal first (GPTQ's ``act_order``); the blocks'
  scales are then found first, from the original weights ("static groups": a block's inputs are reached at
  scattered times).

The updates are applied lazily, ``CHUNK`` inputs at a time (GPTQ's blocking: the same numbers, fewer passes
over the weight).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from requant.encoding.rounding import DAMPING, damped, upper_inverse_factor
from requant.llm.blocks import Blocked, BlockFormat, block_scales

__all__ = ["ORDERS", "gptq"]

Array = npt.NDArray[Any]
ORDERS = ("natural", "activation")
CHUNK = 128


def gptq(
    w: Array,
    h: Array,
    fmt: BlockFormat,
    order: str = "natural",
    damping: float = DAMPING,
    given: tuple[Array, Array] | None = None,
) -> Blocked:
    """``w`` (``[K, N]``) in blocks of ``fmt``, rounded by error feedback against inputs of second moments
    ``h`` (``[K, K]``); in activation order, at ``given`` (scales and zero points ``[N, blocks]``, e.g. the
    clipping search's) when given, else at the original weights' ranges."""
    if given is not None and order != "activation":
        raise ValueError("scales given in advance are for the activation order (static groups)")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    k, n = w.shape
    size = fmt.blocks(k) * fmt.block_size
    rows = np.zeros((n, size), np.float64)  # the weights being rounded, one row per output
    rows[:, :k] = np.asarray(w, np.float64).T
    hh = np.eye(size)  # the padding: an input never seen (its weights are 0 and stay so)
    hh[:k, :k] = damped(h, damping)
    perm = np.argsort(-np.diag(hh)[:k], kind="stable") if order == "activation" else np.arange(k)
    perm = np.concatenate([perm, np.arange(k, size)])
    u = upper_inverse_factor(hh[np.ix_(perm, perm)])
    scales = np.zeros((n, fmt.blocks(k)), np.float32)
    zero_points = np.zeros((n, fmt.blocks(k)), np.uint8)
    if order == "activation":
        scales, zero_points = given or block_scales(rows.reshape(n, -1, fmt.block_size), fmt)
    wt = np.ascontiguousarray(rows[:, perm].T)  # [size, n]: one input's weights contiguous (they are read in turn)
    codes = np.zeros((size, n), np.uint8)
    for start in range(0, size, CHUNK):
        stop = min(start + CHUNK, size)
        errors = np.empty((stop - start, n))
        for i in range(start, stop):
            column = perm[i]
            block = column // fmt.block_size
            if order == "natural" and column % fmt.block_size == 0:  # the block's scales, as the errors left it
                found = block_scales(wt[i : i + fmt.block_size].T[:, None, :], fmt)
                scales[:, block], zero_points[:, block] = found[0][:, 0], found[1][:, 0]
            s, z = scales[:, block].astype(np.float64), zero_points[:, block].astype(np.float64)
            code = np.clip(np.rint(wt[i] / s) + z, 0, fmt.top)
            codes[column] = code
            error = (wt[i] - (code - z) * s) / u[i, i]
            wt[i + 1 : stop] -= np.outer(u[i, i + 1 : stop], error)
            errors[i - start] = error
        wt[stop:] -= u[start:stop, stop:].T @ errors
    codes = np.ascontiguousarray(codes.T)
    return Blocked(codes, scales, zero_points, k, fmt)
