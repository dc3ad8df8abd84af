"""An expectation over bins: a Softmax whose probabilities are weighted by the bins' indices 0, 1, ..., n-1.

YOLOv8 and YOLO11 decode each side of a box this way (Ultralytics' DFL, "distribution focal loss"): 16
logits per side from the head's last box convolution, a Softmax over them, then a 1x1 convolution whose
weights are ``0, 1, ..., 15`` (the distance in grid cells), later times the stride (8 to 32 pixels). A step
of the logits' int8 type moves the expectation by a fraction of a cell and the box by pixels; the
probabilities' uint8 steps add to it. Ultralytics keeps these ops out of INT8 in its own exports (TensorRT:
the head's ``.2/Conv`` layers and the DFL in FP16; OpenVINO: the head out of NNCF's scope).

:func:`in_bin_expectation` names the ops of such a decode: the Softmax, the kernel (or ``Mul``) that weights
its output by the ramp, and the kernels writing the Softmax's logits (through the reshapes, transposes,
slices and concats between them). The ONNX Runtime table keeps them float, their inputs too (``float_kernels``:
the activation before the box convolution is not rounded either, as for a node the user names float, where
nothing else reads it).
Measured on Ultralytics exports (opset 18, 100 letterboxed photo crops; mean corner shift from float's boxes
after NMS, ``bench/`` zoo data): the face-emotion YOLOv8 at 320 2.26 -> 0.38 px, the two-class YOLOv8s at 640
4.8 -> 4.05 px for 0.36x -> 0.41x float's latency (three 1x1 convolutions of 64 channels and the decode in
float); YOLO11n-seg at 640 5.0 -> 5.1 px, no gain (its error comes from before the head: keeping the box
branch's middle convolutions float too gave 3.2 px, the whole head 2.9 px at 0.60x on the YOLOv8s).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from requant.ir.queries import constant

__all__ = ["LOGIT_KERNELS", "REASON", "in_bin_expectation", "kept_float"]

LOGIT_KERNELS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
RAMP_OPS = ("Conv", "MatMul", "Gemm", "Mul")
MOVES = ("Reshape", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Flatten")  # values unchanged
REASON = (
    "an expectation over bins (a YOLO box decode: its Softmax, the 0..n-1 weights after it, the kernels writing "
    "its logits): a step of the logits' int8 type moves a box by pixels"
)
MIN_BINS = 4
MAX_HOPS = 8  # moves between the logits' kernel and the Softmax, at most


def _ramp(node: ir.Node) -> bool:
    """Whether ``node`` weights by a constant ``0, 1, ..., n-1`` (n >= ``MIN_BINS``): its second input (or, for
    ``Mul``, either)."""
    if node.op_type not in RAMP_OPS or node.domain not in ("", "ai.onnx"):
        return False
    for value in node.inputs[1:2] if node.op_type != "Mul" else node.inputs[:2]:
        shape = value.shape if value is not None else None
        if shape is not None and sum(d != 1 for d in shape) > 1:  # a ramp is a vector: no weight matrix is read
            continue
        weights = constant(value)
        if weights is not None and weights.size >= MIN_BINS:
            flat = weights.reshape(-1)
            if np.array_equal(flat, np.arange(flat.size)):
                return True
    return False


def _after(node: ir.Node) -> Iterator[ir.Node]:
    """The nodes reading ``node``'s outputs, through moves (at most ``MAX_HOPS``)."""
    frontier, seen = [node], {id(node)}
    for _ in range(MAX_HOPS):
        found = [c for n in frontier for out in n.outputs for c in out.consumers() if id(c) not in seen]
        seen.update(id(c) for c in found)
        yield from found
        frontier = [c for c in found if c.op_type in MOVES]
        if not frontier:
            return


def _before(node: ir.Node) -> Iterator[ir.Node]:
    """The nodes writing ``node``'s first input, through moves (every input of a Concat; at most ``MAX_HOPS``)."""
    frontier = [node]
    for _ in range(MAX_HOPS):
        found: list[ir.Node] = []
        for n in frontier:
            inputs = n.inputs if n.op_type == "Concat" else n.inputs[:1]
            found += [p for v in inputs if v is not None and (p := v.producer()) is not None]
        yield from found
        frontier = [p for p in found if p.op_type in MOVES]
        if not frontier:
            return


def _decoding_softmax(node: ir.Node) -> bool:
    return node.op_type == "Softmax" and any(_ramp(n) for n in _after(node) if n.op_type in RAMP_OPS)


def in_bin_expectation(node: ir.Node) -> bool:
    """Whether ``node`` is part of an expectation over bins (see the module's docstring)."""
    if node.op_type == "Softmax":
        return _decoding_softmax(node)
    if _ramp(node):
        return any(_decoding_softmax(n) for n in _before(node))
    if node.op_type in LOGIT_KERNELS:
        return any(_decoding_softmax(n) for n in _after(node) if n.op_type == "Softmax")
    return False


def kept_float(node: ir.Node) -> str | None:
    """Why a support table keeps ``node`` float with its input (:data:`REASON`), or None: only where nothing
    else reads that input (YOLO's box branch); a logits kernel sharing its input with an int8 kernel stays
    float on the quantized input instead (the table's check rejects it), so the other keeps its int8 input."""
    data = node.inputs[0] if node.inputs else None
    alone = data is None or len(data.consumers()) <= 1
    return REASON if alone and in_bin_expectation(node) else None
