"""The second moments of a kernel's input, observed in calibration's pass for error-feedback rounding.

``H = sum x x^T`` over a convolution's input vectors in its reduction order (kernel rows, kernel
columns, then channels): what :mod:`requant.encoding.rounding` rounds each kernel's weights against.
An observer like the others (:class:`~requant.calibration.observers.Observer`): it sees arrays, never
the graph.
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

__all__ = ["MOMENTS_KEY", "InputMoments", "Patches", "measured_kernel"]

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
