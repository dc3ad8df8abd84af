"""Rounding weights against their inputs: error feedback (GPTQ).

Rounding each weight to its nearest integer makes each weight as close as it can be, not the
kernel's output. For a kernel ``y = W x`` whose weights are off by ``E``, the output is off by
``E x``, whose energy over the inputs ``x`` is ``trace(E H E^T)`` with ``H = sum x x^T``, the
second moments of the kernel's input in its reduction order. GPTQ (Frantar et al., "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers", 2022; the Optimal Brain
Quantizer's greedy order) rounds one reduction element at a time and spreads each element's rounding
error onto the elements not yet rounded, in proportion to how the inputs correlate (the rows of the
Cholesky factor of ``H^-1``): neighbouring pixels of an image, the channels of a feature map.

- ``H`` comes from calibration (:class:`~requant.calibration.moments.InputMoments`, fed in the same
  pass as the ranges): the float model's input to each convolution (a 3x3 one's patches, in its
  kernel's order: kernel rows, kernel columns, then channels), from at most ``VECTORS_PER_ELEMENT``
  input vectors per reduction element and at most ``1 / SAMPLE_SHARE`` of them from one sample. With
  fewer than ``MIN_VECTORS_PER_ELEMENT`` per element, or a reduction longer than ``MAX_REDUCTION``
  (its ``H`` costs ``K^3``), the weights are rounded to nearest.
- The weights keep their scales (chosen by the weight encoding: full range, or raised so no pair
  can saturate) and stay in the type's range; where the kernel adds pairs of products in int16
  (uint8 x int8 without VNNI), the second element of each pair is held inside what its first one
  leaves of the bound, so the encoding's proof holds for the new integers too (it is checked again).

A depthwise convolution reads one input channel per output channel: each channel has its own
``H`` (``[C, K, K]``, ``K`` its kernel's positions) and its row is rounded against it
(:func:`round_rows_each`; they add their products in int32: no pair bound). EfficientNet-Lite0, its
16 depthwise convs so rounded too: KL on 2,000 crops 0.0052 -> 0.0041, top-1 agreement 0.932 ->
0.945 (its depthwise weights float: 0.0038, 0.944).

The linear layers of Gemm and MatMul are rounded to nearest: on all-MiniLM-L6-v2 error feedback
moved the cosine to float 0.99807 -> 0.99812 and cost 1.2 s of 4.7 (its error is its activations').
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DAMPING",
    "damped",
    "damped_diagonal",
    "output_error",
    "round_rows",
    "round_rows_each",
    "upper_inverse_factor",
]

Array = npt.NDArray[Any]

DAMPING = 0.01  # added to H's diagonal, times its mean (GPTQ's): a direction no input took costs something
_BLOCK = 128  # reduction elements rounded before their errors reach the rest in one product


def upper_inverse_factor(h: Array) -> Array:
    """The upper Cholesky factor ``U`` of ``h^-1`` (``h^-1 = U^T U``; ``h`` symmetric positive
    definite, or a stack of them): the inverse of the lower factor of ``h`` with its order reversed,
    reversed back (one factorization and one inverse instead of GPTQ's two and two)."""
    reversed_lower = np.linalg.cholesky(h[..., ::-1, ::-1])
    return np.ascontiguousarray(lower_inverse(reversed_lower)[..., ::-1, ::-1])


def lower_inverse(lower: Array, leaf: int = 128) -> Array:
    """The inverse of a lower-triangular ``lower`` (or a stack of them), by halves: ``[[A, 0], [B, C]]^-1`` is
    ``[[A^-1, 0], [-C^-1 B A^-1, C^-1]]``, its work in matrix products (SmolLM2's down_proj, 1536 inputs: 0.03 s
    against 0.17 s for ``np.linalg.inv``, which does not know the matrix is triangular; as accurate)."""
    n = lower.shape[-1]
    if n <= leaf:
        return np.linalg.inv(lower)
    m = n // 2
    first, second = lower_inverse(lower[..., :m, :m], leaf), lower_inverse(lower[..., m:, m:], leaf)
    out = np.zeros_like(lower)
    out[..., :m, :m], out[..., m:, m:] = first, second
    out[..., m:, :m] = -(second @ (lower[..., m:, :m] @ first))
    return out


def damped(h: Array, damping: float = DAMPING) -> Array:
    """``h`` (``[K, K]``, or a stack of them; a float64 copy) with :func:`damped_diagonal` on its diagonal."""
    h = np.array(h, np.float64)
    k = np.arange(h.shape[-1])
    h[..., k, k] = damped_diagonal(h, damping)
    return h


def damped_diagonal(h: Array, damping: float = DAMPING) -> Array:
    """The diagonal of ``h`` (float64) once each input that was always zero has 1 there (its weights rounded to
    nearest, alone) and ``damping`` times the mean of the diagonal is added to it."""
    diagonal = np.array(np.diagonal(h, axis1=-2, axis2=-1), np.float64)
    diagonal[diagonal <= 0] = 1.0
    damped_values: Array = diagonal + damping * diagonal.mean(axis=-1, keepdims=True)
    return damped_values


def _damped_factor(h: Array) -> Array:
    """:func:`upper_inverse_factor` of :func:`damped` ``h``."""
    return upper_inverse_factor(damped(h))


def round_rows(
    f: Array,
    h: Array,
    qmin: int,
    qmax: int,
    pair_bound: tuple[float, float, float] | None = None,
) -> Array:
    """Integers for weights ``f`` (``[N, K]``, in units of each row's scale) that keep ``q @ x`` close
    to ``f @ x`` for inputs with second moments ``h`` (``[K, K]``): GPTQ's order (the reduction's),
    with each rounding error spread onto the elements after it.

    ``pair_bound`` ``(hi, low, high)``: the kernel adds the products of elements ``2j`` and ``2j + 1``
    in a saturating integer ``[low, high]`` for inputs in ``[0, hi]``: a pair of one sign is held to
    ``hi * (|q[2j]| + |q[2j + 1]|)`` inside it (``K`` even)."""
    n, k = f.shape
    w = np.array(f, np.float64).T.copy()  # [K, N]: one reduction element's weights are a contiguous row
    u = _damped_factor(h)
    q = np.empty_like(w)
    for start in range(0, k, _BLOCK):
        stop = min(start + _BLOCK, k)
        errors = np.empty((stop - start, n))
        for i in range(start, stop):
            if pair_bound is not None and i % 2 == 0:  # a pair whose targets leave the bound: both brought in
                w[i], w[i + 1] = _onto_pair_bound(w[i], w[i + 1], pair_bound)
            v = np.clip(np.rint(w[i]), qmin, qmax)
            if pair_bound is not None and i % 2:
                v = _within_pair(q[i - 1], v, pair_bound)
            q[i] = v
            error = (w[i] - v) / u[i, i]
            w[i + 1 : stop] -= np.outer(u[i, i + 1 : stop], error)
            errors[i - start] = error
        w[stop:] -= u[start:stop, stop:].T @ errors
    return q.T


def round_rows_each(f: Array, h: Array, qmin: int, qmax: int) -> Array:
    """:func:`round_rows` for rows that each read their own inputs (a depthwise convolution's
    channels): ``h`` is ``[N, K, K]``, one row's second moments each; no pair bound."""
    k = f.shape[1]
    w = np.array(f, np.float64)
    u = _damped_factor(h)
    q = np.empty_like(w)
    for i in range(k):
        q[:, i] = np.clip(np.rint(w[:, i]), qmin, qmax)
        error = (w[:, i] - q[:, i]) / u[:, i, i]
        w[:, i + 1 :] -= error[:, None] * u[:, i, i + 1 :]
    return q


def _onto_pair_bound(a: Array, b: Array, bound: tuple[float, float, float]) -> tuple[Array, Array]:
    """Targets ``a``, ``b`` of one sign whose magnitudes add up past what the pair bound allows, each
    shortened by half the excess (the nearest point of the bound; neither past zero); the others as they
    are. Without this the errors fed onto a pair that cannot hold them grow from pair to pair."""
    hi, low, high = bound
    limit = np.where(a + b > 0, high, -low) / hi
    same = np.sign(a) * np.sign(b) > 0
    excess = np.where(same, np.abs(a) + np.abs(b) - limit, 0.0)
    over = excess > 0
    if not over.any():
        return a, b
    cut_a = np.minimum(np.abs(a), excess / 2 + np.maximum(0.0, excess / 2 - np.abs(b)))
    cut_b = excess - cut_a
    return np.where(over, a - np.sign(a) * cut_a, a), np.where(over, b - np.sign(b) * cut_b, b)


def _within_pair(first: Array, second: Array, bound: tuple[float, float, float]) -> Array:
    """``second`` held where a same-sign pair with ``first`` stays inside ``[low, high]`` for inputs
    in ``[0, hi]``: ``hi * (|first| + |second|)`` at most ``high`` (positive) or ``-low`` (negative)."""
    hi, low, high = bound
    room_up = np.floor((high - hi * np.maximum(first, 0.0)) / hi)
    room_down = np.floor((-low - hi * np.maximum(-first, 0.0)) / hi)
    return np.where(second > 0, np.minimum(second, room_up), np.maximum(second, -room_down))


def output_error(f: Array, q: Array, h: Array) -> float:
    """``trace(E h E^T)`` for ``E = f - q`` (``[N, K]``, in any units): the output error's energy."""
    e = np.asarray(f, np.float64) - q
    if np.ndim(h) == 3:  # a row's own moments each
        return float(np.einsum("nk,nkl,nl->", e, h, e))
    return float(((e @ h) * e).sum())
