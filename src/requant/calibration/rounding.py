"""Rounding weights against their inputs: error feedback (GPTQ).

Rounding each weight to its nearest integer makes each weight as close as it can be, not the
kernel's output. For a kernel ``y = W x`` whose weights are off by ``E``, the output is off by
``E x``, whose energy over the inputs ``x`` is ``trace(E H E^T)`` with ``H = sum x x^T``, the
second moments of the kernel's input in its reduction order. GPTQ (Frantar et al., "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers", 2022; the Optimal Brain
Quantizer's greedy order) rounds one reduction element at a time and spreads each element's rounding
error onto the elements not yet rounded, in proportion to how the inputs correlate (the rows of the
Cholesky factor of ``H^-1``): neighbouring pixels of an image, the channels of a feature map.

- ``H`` comes from calibration (:class:`InputMoments`, fed in the same pass as the ranges): the
  float model's input to each convolution (a 3x3 one's patches, in its kernel's order: kernel rows,
  kernel columns, then channels), from at most ``VECTORS_PER_ELEMENT`` input vectors per reduction
  element and at most ``1 / SAMPLE_SHARE`` of them from one sample. With fewer than
  ``MIN_VECTORS_PER_ELEMENT`` per element, or a reduction longer than ``MAX_REDUCTION`` (its ``H``
  costs ``K^3``), the weights are rounded to nearest.
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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.observers import Observer
from requant.targets.kernels import is_depthwise

__all__ = ["MOMENTS_KEY", "InputMoments", "Patches", "measured_kernel", "output_error", "round_rows", "round_rows_each"]

Array = npt.NDArray[Any]

MOMENTS_KEY = "requant.input_moments"  # a kernel node's meta: its InputMoments, once calibrated
# longer reductions are rounded to nearest: H costs K^3 to gather and to invert (MobileNetV2's 960-long
# ones: 0.6 s more for KL 0.0202 -> 0.0198)
MAX_REDUCTION = 512
# H from at most this many input vectors per reduction element (EfficientNet-Lite0's KL with 16, 8 and
# 4: 0.0064, 0.0056, 0.0052; nearest 0.0079)
VECTORS_PER_ELEMENT = 4
MIN_VECTORS_PER_ELEMENT = 2  # fewer, and H says more about the samples than about the kernel: nearest
SAMPLE_SHARE = 16  # one sample gives at most 1/16 of the vectors (its positions evenly spaced)
DAMPING = 0.01  # added to H's diagonal, times its mean (GPTQ's): a direction no input took costs something
_BLOCK = 128  # reduction elements rounded before their errors reach the rest in one product


@dataclass(frozen=True)
class Patches:
    """How a 2-D convolution reads its input as vectors of its reduction: ``kernel`` its size, with
    ``pads`` [top, left, bottom, right], ``strides`` and ``dilations``."""

    kernel: tuple[int, int] = (1, 1)
    pads: tuple[int, ...] = (0, 0, 0, 0)
    strides: tuple[int, ...] = (1, 1)
    dilations: tuple[int, ...] = (1, 1)
    depthwise: bool = False  # one input channel per output channel: a reduction (and an H) per channel

    @staticmethod
    def of(node: ir.Node) -> Patches | None:
        """The patches of a Conv over 2-D maps with one group, or depthwise, and a constant weight;
        None for anything else."""
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or weight is None:
            return None
        shape = weight.const_value.shape.numpy() if weight.const_value is not None else ()
        group = node.attributes.get_int("group", 1)
        if len(shape) != 4 or (group != 1 and not is_depthwise(tuple(int(d) for d in shape), group)):
            return None
        if node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            return None
        kernel = (int(shape[2]), int(shape[3]))
        pads = tuple(node.attributes.get_ints("pads", [0, 0, 0, 0]) or [0, 0, 0, 0])
        strides = tuple(node.attributes.get_ints("strides", [1, 1]) or [1, 1])
        dilations = tuple(node.attributes.get_ints("dilations", [1, 1]) or [1, 1])
        return Patches(kernel, pads, strides, dilations, group != 1)

    def rows(self, x: Array, at_most: int | None = None) -> Array:
        """``x`` (``[N, C, H, W]``) as ``[vectors, K]`` float32, each vector a patch in the kernel's
        reduction order (kernel rows, kernel columns, channels); ``at_most``: that many vectors at most,
        at evenly spaced output positions (only those are gathered)."""
        x = np.asarray(x, np.float32)
        if x.ndim != 4:
            raise ValueError(f"a 2-D convolution's input has 4 axes, this one {x.shape}")
        kh, kw = self.kernel
        top, left, bottom, right = self.pads
        (sh, sw), (dh, dw) = self.strides, self.dilations
        n, c, h, w = x.shape
        oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        ow = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        chosen = np.arange(0, n * oh * ow, _step(n * oh * ow, at_most))  # output positions, sample-major
        image, rest = np.divmod(chosen, oh * ow)
        oy, ox = np.divmod(rest, ow)
        cols = np.empty((len(chosen), kh, kw, c), np.float32)
        for i in range(kh):  # padding read as zeros where it falls (not padding x: a copy of all of it)
            y = oy * sh + i * dh - top
            for j in range(kw):
                xs = ox * sw + j * dw - left
                inside = (y >= 0) & (y < h) & (xs >= 0) & (xs < w)
                cols[:, i, j, :] = x[image, :, np.where(inside, y, 0), np.where(inside, xs, 0)]
                cols[~inside, i, j, :] = 0.0
        return cols.reshape(len(chosen), kh * kw * c)


def measured_kernel(node: ir.Node) -> tuple[Patches, int] | None:
    """How a convolution reads its input and the length of its reduction, when its weights are to
    be rounded against its inputs (``MAX_REDUCTION`` at most); None otherwise."""
    patches = Patches.of(node)
    if patches is None:
        return None
    weight = node.inputs[1].const_value  # type: ignore[union-attr]  # Patches.of checked it
    assert weight is not None
    reduction = (1 if patches.depthwise else weight.shape.numpy()[1]) * patches.kernel[0] * patches.kernel[1]
    return (patches, reduction) if reduction <= MAX_REDUCTION else None


def _step(count: int, at_most: int | None) -> int:
    return 1 if at_most is None else max(1, math.ceil(count / at_most))


class InputMoments(Observer):
    """``sum x x^T`` over a kernel's input vectors (float64, ``[K, K]``; a depthwise kernel's
    ``[C, K, K]``, one per channel), from at most
    ``VECTORS_PER_ELEMENT * K`` of them and at most ``1 / SAMPLE_SHARE`` of those per sample (evenly
    spaced positions), taken a sample at a time along the first axis.

    Not ``batchable``: ONNX Runtime computes a sample stacked with others in the last float digits
    differently, and rounding against inputs that differ in the last digits can pick other integers
    (``--method minmax`` calibrates stacked, ``auto`` does not: the digits CNN got other bytes)."""

    batchable = False

    def __init__(self, patches: Patches, reduction: int) -> None:
        self.patches = patches
        self.reduction = reduction
        self.cap = VECTORS_PER_ELEMENT * reduction  # a depthwise one's: the same vectors for every channel
        self.per_sample = max(1, math.ceil(self.cap / SAMPLE_SHARE))
        self.total: Array | None = None
        self.vectors = 0

    @property
    def enough(self) -> bool:
        """Whether the sums stand for the kernel's inputs (else its weights are rounded to nearest)."""
        return self.total is not None and self.vectors >= MIN_VECTORS_PER_ELEMENT * self.reduction

    def update(self, array: Array) -> None:
        for sample in np.asarray(array)[:, None]:
            if self.vectors >= self.cap:
                return
            rows = self.patches.rows(sample, self.per_sample)[: self.cap - self.vectors]
            channels = rows.shape[1] // self.reduction if self.patches.depthwise else 1
            if rows.shape[1] != self.reduction * channels:
                raise ValueError(f"input vectors of {rows.shape[1]} elements for a reduction of {self.reduction}")
            finite = np.isfinite(rows).all(axis=1)
            if not finite.all():  # left out here (the range observers name the value)
                rows = rows[finite]
            if self.patches.depthwise:  # [vectors, positions, channels] -> one [K, K] per channel
                per_channel = rows.reshape(len(rows), self.reduction, channels).astype(np.float64)
                # a few vectors a sample: one einsum (a stacked matmul's thousand tiny products took 1 ms)
                product = np.einsum("vkc,vlc->ckl", per_channel, per_channel)
            else:
                product = (rows.T @ rows).astype(np.float64)
            self.total = product if self.total is None else self.total + product
            self.vectors += len(rows)


def _upper_inverse_factor(h: Array) -> Array:
    """The upper Cholesky factor ``U`` of ``h^-1`` (``h^-1 = U^T U``; ``h`` symmetric positive
    definite, or a stack of them): the inverse of the lower factor of ``h`` with its order reversed,
    reversed back (one factorization and one inverse instead of GPTQ's two and two)."""
    reversed_lower = np.linalg.cholesky(h[..., ::-1, ::-1])
    return np.ascontiguousarray(np.linalg.inv(reversed_lower)[..., ::-1, ::-1])


def _damped_factor(h: Array) -> Array:
    """:func:`_upper_inverse_factor` of ``h`` (``[K, K]``, or a stack of them) once each input that
    was always zero has a diagonal of 1 (its weights rounded to nearest, alone) and ``DAMPING`` times
    the mean of the diagonal is added to it."""
    h = np.array(h, np.float64)
    k = np.arange(h.shape[-1])
    diagonal = h[..., k, k]
    diagonal[diagonal <= 0] = 1.0
    h[..., k, k] = diagonal + DAMPING * diagonal.mean(axis=-1, keepdims=True)
    return _upper_inverse_factor(h)


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
