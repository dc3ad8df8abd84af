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
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from requant.encoding.rounding import DAMPING, damped_diagonal
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
    diagonal = damped_diagonal(h, damping)
    perm = np.argsort(-diagonal, kind="stable") if order == "activation" else np.arange(k)
    perm = np.concatenate([perm, np.arange(k, size)])  # the padding last: inputs never seen (their weights 0)
    u = inverse_factor(h, diagonal, perm)
    grid = _Grid(n, fmt.blocks(k))
    if order == "activation":
        grid.set(slice(None), *(given or block_scales(rows.reshape(n, -1, fmt.block_size), fmt)))
    wt = np.ascontiguousarray(rows[:, perm].T)  # [size, n]: one input's weights contiguous (they are read in turn)
    codes = np.zeros((size, n), np.uint8)
    for start in range(0, size, CHUNK):
        stop = min(start + CHUNK, size)
        band = np.ascontiguousarray(u[start:stop, start:])  # the chunk's rows of U (a reversed view: BLAS wants these)
        errors = _round_chunk(wt[start:], band, perm[start:stop], fmt, grid, codes, order == "natural")
        wt[stop:] -= band[:, stop - start :].T @ errors
    return Blocked(np.ascontiguousarray(codes.T), grid.scales, grid.zero_points, k, fmt)


class _Grid:
    """Each block's scales and zero points (``[N, blocks]``, as stored) and their float64 rows by block (the
    column loop reads one block's for all outputs)."""

    def __init__(self, n: int, blocks: int) -> None:
        self.scales, self.zero_points = np.zeros((n, blocks), np.float32), np.zeros((n, blocks), np.uint8)
        self.rows = (np.zeros((blocks, n)), np.zeros((blocks, n)))

    def set(self, block: int | slice, scales: Array, zero_points: Array) -> None:
        self.scales[:, block], self.zero_points[:, block] = scales, zero_points
        self.rows[0][block], self.rows[1][block] = scales.T, zero_points.T


def _round_chunk(wt: Array, band: Array, columns: Array, fmt: BlockFormat, grid: _Grid, codes: Array,
                 natural: bool) -> Array:  # fmt: skip
    """The chunk of inputs ``columns`` rounded in turn (``wt``: the weights from the chunk's first input on, in
    the order; ``band``: U's rows of the chunk from its first input on); each input's error spread onto the
    chunk's inputs after it as each is reached. Its codes into ``codes``; the chunk's scaled errors returned."""
    errors = np.empty((len(columns), wt.shape[1]))
    code = np.empty(wt.shape[1])
    for i, column in enumerate(columns):
        block = column // fmt.block_size
        if i:  # the errors of this chunk's inputs before it, applied when it is reached (one product)
            wt[i] -= band[:i, i] @ errors[:i]
        if natural and column % fmt.block_size == 0:  # the block's scales, as the errors left it
            ahead = wt[i : i + fmt.block_size].copy()  # its inputs after i: this chunk's errors still owed
            ahead[1:] -= band[:i, i + 1 : i + fmt.block_size].T @ errors[:i]
            found = block_scales(ahead.T[:, None, :], fmt)
            grid.set(block, found[0][:, 0], found[1][:, 0])
        s, z = grid.rows[0][block], grid.rows[1][block]
        code = np.divide(wt[i], s, out=code)  # clip(rint(w / s) + z, 0, top), in place
        np.rint(code, out=code)
        code += z
        np.minimum(np.maximum(code, 0, out=code), fmt.top, out=code)
        codes[column] = code
        error = np.subtract(code, z, out=errors[i])  # (w - (code - z) * s) / u_ii, in place
        error *= s
        np.subtract(wt[i], error, out=error)
        error /= band[i, i]
    return errors


ROWS_AT_ONCE = 256  # rows of H copied into the reordered matrix at a time (no second K x K copy)


def inverse_factor(h: Array, diagonal: Array, perm: Array) -> Array:
    """The upper Cholesky factor ``U`` of the inverse of ``H`` (``h`` off its diagonal, ``diagonal`` on it,
    padded with an identity to ``len(perm)`` inputs) in the order ``perm``, made in one ``[size, size]``
    float64 array: ``H`` copied into it in the reverse of ``perm`` (a row chunk at a time), its lower
    Cholesky factor and that factor's inverse made in place by LAPACK (SciPy's ``dpotrf`` and ``dtrtri``;
    NumPy's functions copy: ``np.linalg.cholesky`` holds the input, a work copy and the factor), and ``U``
    read from it reversed (a view: ``U = J L^-1 J`` for ``L`` the lower factor of ``J H J``). At K = 4096:
    128 MB instead of the five copies (640 MB) NumPy's route held at once, and 0.5 s instead of 1.7."""
    from scipy.linalg import lapack  # type: ignore[import-untyped]

    size, k = len(perm), len(diagonal)
    backwards = perm[::-1]
    real = backwards[size - k :]  # backwards[: size - k]: the padding, first in reverse
    reordered = np.zeros((size, size))
    pad = size - k
    reordered[np.arange(pad), np.arange(pad)] = 1.0
    for start in range(0, k, ROWS_AT_ONCE):
        chunk = np.take(np.asarray(h), real[start : start + ROWS_AT_ONCE], axis=0)
        reordered[pad + start : pad + start + len(chunk), pad:] = np.take(chunk, real, axis=1)
    reordered[np.arange(pad, size), np.arange(pad, size)] = diagonal[real]
    with threadpool_limits(limits=1, user_api="blas"):
        lower, info = lapack.dpotrf(reordered.T, lower=1, overwrite_a=1, clean=1)  # .T: Fortran order, in place
        if info == 0:
            lower, info = lapack.dtrtri(lower, lower=1, overwrite_c=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"the damped input moments are not positive definite (LAPACK info {info})")
    factor: Array = lower[::-1, ::-1]
    return factor
