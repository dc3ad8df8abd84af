"""A detector's stem: the convolutions that read the image, or a map at half its resolution, and their activations.

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
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["KERNELS", "REASON", "stem_ops"]

REASON = "a detector's stem (the convolutions reading the image or a map at half its resolution, and their activations)"
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
