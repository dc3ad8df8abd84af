"""A detector's stem and head: the parts of it the method choice keeps float whole (results too).

The stem: the convolutions that read the image, or a map at half its resolution, and their activations.

A YOLO's first two convolutions (Ultralytics' ``model.0`` and ``model.1``, each a Conv and a SiLU's Sigmoid and
Mul) turn the image into maps at half and a quarter of its resolution: edge responses, sparse and large (a
SiLU output of -0.28..56.5 on photos in a YOLOv8s), whose 256 steps (per tensor) either clip the edges a box is
placed by or round the rest.

:func:`stem_ops` names them in a model whose first input is an image (``N x C x H x W`` with ``H`` and ``W``
known): every Conv whose data input is a map at least half the image's height and width, and the ops after
them that read only their results (and constants) until the next kernel. The method choice keeps them float
whole for a detector, their results too (:func:`requant.stages.choose.choose_method`): the convolution that reads
the stem's result then reads float and computes in float as well (``model.2``'s first), and placement prices the
activation after it as reading a float convolution (on the zoo's YOLOs: float, as cheaper). Measured on the zoo's
YOLO exports (``bench/bench_zoo.py``): docs/benchmarks.md.

The head: :func:`head_ops` names the ops its outputs are computed from without a kernel between (:func:`behind`:
the decode, the class scores' Sigmoid, the Concat, Reshape and Split of the head's maps) and the kernels they
start from (a YOLO's last 1x1 convolution of each branch, the DFL's). Their results are what a user counts: a
detection is a class logit crossing the threshold, and an int8 logit steps ~0.1 over its range (-20..5), 0.02 in
score at the threshold; those kernels are 1x1 convolutions to a few channels, cheap in float (a YOLOv8s's: 0.3 %
of its multiply-adds; a head whose kernels are more than ``HEAD_SHARE`` keeps them int8).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx_ir as ir

from requant.ir.queries import kernel_macs

__all__ = ["HEAD_SHARE", "KERNELS", "REASON", "behind", "head_ops", "stem_ops"]

REASON = "a detector's stem (the convolutions reading the image or a map at half its resolution, and their activations)"
HEAD_SHARE = 0.02  # a detector's last kernels stay float while their multiply-adds are at most this share of all
KERNELS = ("Conv", "ConvTranspose", "MatMul", "Gemm")  # a stem's activations end where one of these reads them


def _spatial(value: ir.Value | None) -> tuple[int, int] | None:
    """The height and width of an ``N x C x H x W`` value whose height and width are known, else None."""
    shape = value.shape if value is not None else None
    if shape is None or len(shape) != 4:
        return None
    h, w = shape[2], shape[3]
    return (h, w) if isinstance(h, int) and isinstance(w, int) and h > 1 and w > 1 else None


def stem_ops(model: ir.Model) -> list[str]:
    """The names of the stem's ops (see the module's docstring), in graph order; none without an image input."""
    image = next((size for v in model.graph.inputs if (size := _spatial(v)) is not None), None)
    if image is None:
        return []
    height, width = image
    names: list[str] = []
    floated: set[ir.Value] = set()
    for node in model.graph:
        if _reads_fine_map(node, height, width) or (node.op_type not in KERNELS and _reads_only(node, floated)):
            names.append(node.name or "")
            floated.update(node.outputs)
    return [n for n in names if n]


def _reads_fine_map(node: ir.Node, height: int, width: int) -> bool:
    """Whether ``node`` is a Conv whose data input is at least half the image's height and width."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return False
    size = _spatial(node.inputs[0])
    return size is not None and 2 * size[0] >= height and 2 * size[1] >= width


def _reads_only(node: ir.Node, floated: set[ir.Value]) -> bool:
    """Whether ``node`` reads some of ``floated`` and otherwise only constants."""
    given = [v for v in node.inputs if v is not None]
    constant = [v.const_value is not None or v.is_initializer() for v in given]
    return any(v in floated for v in given) and all(v in floated or c for v, c in zip(given, constant, strict=True))


def behind(graph: ir.Graph, outputs: Collection[str] | None = None) -> frozenset[str]:
    """The names of the values the graph outputs named ``outputs`` (None: every one) are computed from without a
    kernel (:data:`KERNELS`) between, the kernels' outputs included; constants left out."""
    found: set[str] = set()
    todo = [v for v in graph.outputs if outputs is None or v.name in outputs]
    while todo:
        value = todo.pop()
        if value.name in found:
            continue
        found.add(str(value.name))
        node = value.producer()
        if node is not None and node.op_type not in KERNELS:
            todo.extend(x for x in node.inputs if x is not None and x.const_value is None)
    return frozenset(found)


def head_ops(model: ir.Model, outputs: Collection[str]) -> list[str]:
    """The names of the ops that compute the values :func:`behind` the head's ``outputs`` finds, in graph order;
    the kernels they start from too, unless their multiply-adds are more than ``HEAD_SHARE`` of the model's
    kernels' (a head of wide 3x3 convolutions: int8 pays there; those kernels' results stay int8)."""
    values = behind(model.graph, outputs)
    found = [n for n in model.graph if n.name and any(o.name in values for o in n.outputs)]
    kernels = [n for n in found if n.op_type in KERNELS]
    total = sum(kernel_macs(n) or 0 for n in model.graph if n.op_type in KERNELS)
    if sum(kernel_macs(n) or 0 for n in kernels) > HEAD_SHARE * total:
        found = [n for n in found if n not in kernels]
    return [str(n.name) for n in found]
