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

The updates are applied lazily (GPTQ's blocking): those of a chunk of ``CHUNK`` inputs to the inputs after it in
one product when the chunk is done; within the chunk, each input's owed updates in one product when it is
reached (not every input's after each one: 1.7-2.6x faster on SmolLM2's layers, the same codes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from requant.encoding.rounding import DAMPING, damped, upper_inverse_factor
from requant.llm.blocks import Blocked, BlockFormat, block_scales, padded_rows

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
    rows: Array | None = None,
) -> Blocked:
    """``w`` (``[K, N]``) in blocks of ``fmt``, rounded by error feedback against inputs of second moments
    ``h`` (``[K, K]``); in activation order, at ``given`` (scales and zero points ``[N, blocks]``, e.g. the
    clipping search's) when given, else at the original weights' ranges. ``rows``: ``w`` as
    :func:`~requant.llm.blocks.padded_rows` cuts it, when the caller has it."""
    if given is not None and order != "activation":
        raise ValueError("scales given in advance are for the activation order (static groups)")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    k, n = w.shape
    size = fmt.blocks(k) * fmt.block_size
    rows = (padded_rows(w, fmt) if rows is None else rows).reshape(n, size)  # the weights, one row per output
    hh = np.eye(size)  # the padding: an input never seen (its weights are 0 and stay so)
    hh[:k, :k] = damped(h, damping)
    perm = np.argsort(-np.diag(hh)[:k], kind="stable") if order == "activation" else np.arange(k)
    perm = np.concatenate([perm, np.arange(k, size)])
    hh = hh[np.ix_(perm, perm)]  # rebound, then dropped: K x K float64 each (128 MB at K = 4096)
    u = upper_inverse_factor(hh)
    del hh
    scales = np.zeros((n, fmt.blocks(k)), np.float32)
    zero_points = np.zeros((n, fmt.blocks(k)), np.uint8)
    if order == "activation":
        scales, zero_points = given or block_scales(rows.reshape(n, -1, fmt.block_size), fmt)
    wt = np.ascontiguousarray(rows[:, perm].T)  # [size, n]: one input's weights contiguous (they are read in turn)
    codes = np.zeros((size, n), np.uint8)
    s_all, z_all = scales.T.astype(np.float64), zero_points.T.astype(np.float64)  # [blocks, n]: a block's row
    code = np.empty(n)
    for start in range(0, size, CHUNK):
        stop = min(start + CHUNK, size)
        errors = np.empty((stop - start, n))
        for i in range(start, stop):
            column = perm[i]
            block = column // fmt.block_size
            if i > start:  # the errors of this chunk's inputs before it, applied when it is reached (one product)
                wt[i] -= u[start:i, i] @ errors[: i - start]
            if order == "natural" and column % fmt.block_size == 0:  # the block's scales, as the errors left it
                ahead = wt[i : i + fmt.block_size].copy()  # its inputs after i: this chunk's errors still owed
                ahead[1:] -= u[start:i, i + 1 : i + fmt.block_size].T @ errors[: i - start]
                found = block_scales(ahead.T[:, None, :], fmt)
                scales[:, block], zero_points[:, block] = found[0][:, 0], found[1][:, 0]
                s_all[block], z_all[block] = found[0][:, 0], found[1][:, 0]
            s, z = s_all[block], z_all[block]
            code = np.divide(wt[i], s, out=code)  # clip(rint(w / s) + z, 0, top), in place
            np.rint(code, out=code)
            code += z
            np.minimum(np.maximum(code, 0, out=code), fmt.top, out=code)
            codes[column] = code
            error = np.subtract(code, z, out=errors[i - start])  # (w - (code - z) * s) / u_ii, in place
            error *= s
            np.subtract(wt[i], error, out=error)
            error /= u[i, i]
        wt[stop:] -= u[start:stop, stop:].T @ errors
    codes = np.ascontiguousarray(codes.T)
    return Blocked(codes, scales, zero_points, k, fmt)
