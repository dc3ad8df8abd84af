"""Questions about nodes and values that passes, targets and quantizers all ask."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

__all__ = [
    "DEFAULT_DOMAINS",
    "clamp_bounds",
    "computes_floats",
    "constant",
    "dequantized_constant",
    "fresh_name",
    "graph_values",
    "is_op",
    "kernel_macs",
    "op_name",
    "pads_with_zero",
    "static_elements",
    "subgraphs",
    "weighted_layers",
]

DEFAULT_DOMAINS = ("", "ai.onnx")


def is_op(node: ir.Node, op_type: str) -> bool:
    """Whether ``node`` is the standard ONNX operator ``op_type``."""
    return node.op_type == op_type and node.domain in DEFAULT_DOMAINS


def op_name(node: ir.Node) -> str:
    """``Conv`` for a standard operator, ``com.microsoft.QGemm`` for others."""
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def fresh_name(base: str, taken: set[str | None]) -> str:
    """``base``, or ``base_1``, ``base_2``... the first not in ``taken``; it is added to ``taken``."""
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def static_elements(value: ir.Value, dims: Mapping[str, int] | None = None) -> int | None:
    """The elements of ``value`` per sample, where its shape is known (a symbolic dimension, such as
    the batch, counts as ``dims`` names it, else 1); None when it has no shape."""
    if value.shape is None:
        return None
    count = 1
    for d in value.shape:
        count *= d if isinstance(d, int) else (dims or {}).get(str(d), 1)
    return count


def kernel_macs(node: ir.Node, dims: Mapping[str, int] | None = None) -> int | None:
    """A kernel's (Conv, MatMul, Gemm) multiply-adds per run: its output's elements times each one's reduction
    length; None where a shape is unknown. ``dims``: as :func:`static_elements` counts them."""
    if len(node.inputs) < 2 or not node.outputs:
        return None
    out, weight = static_elements(node.outputs[0], dims), node.inputs[1].shape if node.inputs[1] is not None else None
    if out is None or weight is None or not all(isinstance(d, int) for d in weight) or len(weight) < 2:
        return None
    w = [d for d in weight if isinstance(d, int)]
    if node.op_type == "Conv":
        return out * math.prod(w[1:])
    if node.op_type == "ConvTranspose":  # each input element times its weights' (C_out / group) x kernel
        read = static_elements(node.inputs[0], dims) if node.inputs[0] is not None else None
        return read * math.prod(w[1:]) if read is not None else None
    transposed = node.op_type == "Gemm" and bool(node.attributes.get_int("transB", 0))
    return out * (w[-1] if transposed else w[-2])


def graph_values(graph: ir.Graph) -> list[ir.Value]:
    """The graph's inputs, initializers and node outputs, in that order; not those of subgraphs
    (``requant.ir.annotations.iter_values`` walks those too): quantization works on the main graph."""
    return [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]


def weighted_layers(graph: ir.Graph) -> tuple[int, int]:
    """How many linear layers (``MatMul`` or ``Gemm`` with a constant weight) and convolutions
    (``Conv``, ``ConvTranspose``) ``graph`` has."""
    convs = sum(1 for n in graph if n.op_type in ("Conv", "ConvTranspose"))
    linear = sum(
        1 for n in graph if n.op_type in ("MatMul", "Gemm") and len(n.inputs) > 1 and constant(n.inputs[1]) is not None
    )
    return linear, convs


def constant(value: ir.Value | None) -> npt.NDArray[np.generic] | None:
    """The value's data if it is a constant (an initializer or a ``Constant`` node's output)."""
    if value is None:
        return None
    if value.const_value is not None and (value.is_initializer() or value.producer() is None):
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and is_op(producer, "Constant") and "value" in producer.attributes:
        tensor = producer.attributes["value"].as_tensor()
        return tensor.numpy()
    return None


def computes_floats(node: ir.Node) -> bool:
    """Whether ``node`` computes on float tensors: its first output's element type, or where that is not
    known its first input's, is a floating-point one. An op on integers (a shape computation's ``Div`` of
    int64 sizes) has nothing to quantize, and no float rewrite of it holds (int64 ``x / 2`` is not
    ``x * 0.5``)."""
    for value in (*node.outputs[:1], *node.inputs[:1]):
        if value is not None and value.dtype is not None:
            return value.dtype.is_floating_point()
    return False


def clamp_bounds(node: ir.Node) -> tuple[float, float] | None:
    """A Relu's or Clip's bounds (None for another op, or if a bound is not a constant)."""
    if is_op(node, "Relu"):
        return 0.0, float("inf")
    if not is_op(node, "Clip"):
        return None
    bounds = []
    for index, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is not None:
            data = constant(value)
            if data is None or data.size != 1:
                return None
            bounds.append(float(data.reshape(-1)[0]))
        else:
            attribute = node.attributes.get(name)  # opset < 11
            bounds.append(attribute.as_float() if attribute is not None else default)
    return bounds[0], bounds[1]


def dequantized_constant(value: ir.Value | None) -> ir.Node | None:
    """The ``DequantizeLinear`` producing ``value`` from stored (constant) integers: a quantized weight
    or bias; None otherwise."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.inputs[0] is None:
        return None
    return node if node.inputs[0].const_value is not None else None


def subgraphs(attr: ir.Attr) -> list[ir.Graph]:
    """The graphs an attribute holds: an If's branch, a Loop's body, a Scan's; none for other kinds."""
    if attr.is_ref():
        return []
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.as_graph()]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.as_graphs())
    return []


def pads_with_zero(pad: ir.Node) -> bool:
    """A ``Pad`` in constant mode whose fill value is absent or a constant 0 (which a quantized type's
    zero point stands for exactly)."""
    mode = pad.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return False
    if len(pad.inputs) > 2 and pad.inputs[2] is not None:
        value = constant(pad.inputs[2])
        return value is not None and not np.any(np.asarray(value) != 0)
    return True
