"""``compute-in-float32``: a float16 or bfloat16 model computes in float32; its interface keeps its types.

ONNX Runtime's CPU int8 kernels fuse ``DequantizeLinear -> op -> QuantizeLinear`` only with float32
scales and activations: a float16 model quantized as it is keeps every op in float16 between the
conversions (slower than the float model). So the weights, constants, value types and the ``to`` /
``dtype`` of Cast, EyeLike, ConstantOfShape's value and the Random ops become float32; each float16
(bfloat16) graph input gets a ``Cast`` to float32 right after it and each such graph output a
``Cast`` back right before it, so the model takes and returns what it did. Recurses into subgraphs.

Invariant after: no value inside the graph is float16 or bfloat16, except the graph's own inputs
and outputs and the Casts at them.

Before::

    %W: tensor<2xf16> = initializer dense<[1.0, 2.0]>
    %Y: tensor<2xf16> = Mul(%X, %W)

After::

    %W: tensor<2xf32> = initializer dense<[1.0, 2.0]>
    %X_float32: tensor<2xf32> = Cast(%X) {to = 1}
    %Y_float32: tensor<2xf32> = Mul(%X_float32, %W)
    %Y: tensor<2xf16> = Cast(%Y_float32) {to = 10}
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from requant.ir.queries import fresh_name, graph_values, subgraphs
from requant.passes._base import Pass

__all__ = ["HALF", "PASS", "ComputeInFloat32"]

HALF = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_DTYPE_ATTRIBUTES = ("to", "dtype")  # Cast, EyeLike, RandomNormal(Like), RandomUniform(Like), Multinomial...


def _widen_tensor(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    return ir.tensor(np.asarray(tensor.numpy(), np.float32), name=tensor.name)


def _is_half(value: ir.Value) -> bool:
    return value.dtype in HALF


def _widen_value(value: ir.Value) -> bool:
    """A float16 value (and its data, for a constant) becomes float32; whether it was one."""
    changed = False
    if value.const_value is not None and value.const_value.dtype in HALF:
        value.const_value = _widen_tensor(value.const_value)
        changed = True
    if _is_half(value):
        value.dtype = ir.DataType.FLOAT
        changed = True
    return changed


def _widen_graph(graph: ir.Graph) -> bool:
    """Everything inside ``graph`` and its subgraphs but the graph's own inputs and outputs' types."""
    changed = False
    for value in graph.initializers.values():
        changed |= _widen_value(value)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.TENSOR and attr.as_tensor().dtype in HALF:
                node.attributes[name] = ir.AttrTensor(name, _widen_tensor(attr.as_tensor()))
                changed = True
            elif name in _DTYPE_ATTRIBUTES and attr.type == ir.AttributeType.INT and attr.as_int() in HALF:
                node.attributes[name] = ir.AttrInt64(name, ir.DataType.FLOAT)
                changed = True
            for sub in subgraphs(attr):
                for value in [*sub.inputs, *sub.initializers.values()]:
                    changed |= _widen_value(value)
        for value in node.outputs:
            changed |= _widen_value(value)
    return changed


def _cast_interface(graph: ir.Graph, half_outputs: dict[int, ir.DataType]) -> None:
    """Casts after float16 graph inputs and before the graph outputs that were float16 (``half_outputs``:
    their types, by value); the interface keeps its names and types."""
    taken = {v.name for v in graph_values(graph)}
    first = next(iter(graph), None)
    for value in graph.inputs:
        if not _is_half(value):
            continue
        uses = list(value.uses())
        cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)], num_outputs=1)
        out = cast.outputs[0]
        out.name = fresh_name(f"{value.name}_float32", taken)
        out.dtype, out.shape = ir.DataType.FLOAT, value.shape
        if first is not None:
            graph.insert_before(first, cast)
        else:
            graph.append(cast)
        for use in uses:
            use.node.replace_input_with(use.idx, out)
    for i, value in enumerate(list(graph.outputs)):
        half = half_outputs.get(id(value))
        if half is None or value.is_graph_input() or value.is_initializer():
            continue  # passed through unchanged: still what it was
        name = value.name
        value.name = fresh_name(f"{name}_float32", taken)
        cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", half)], num_outputs=1)
        out = cast.outputs[0]
        out.dtype, out.shape = half, value.shape
        graph.append(cast)
        graph.outputs[i] = out
        out.name = name


class ComputeInFloat32(Pass):
    name = "compute-in-float32"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        half_outputs = {id(v): v.dtype for v in graph.outputs if v.dtype in HALF}
        inputs_half = any(_is_half(v) for v in graph.inputs)
        changed = _widen_graph(graph)
        if changed or inputs_half or half_outputs:
            _cast_interface(graph, half_outputs)
            changed = True
        return ir.passes.PassResult(model, changed)

    def ensures(self, model: ir.Model) -> None:
        interface = {id(v) for v in [*model.graph.inputs, *model.graph.outputs]}
        left = [
            str(v.name)
            for n in ir.traversal.RecursiveGraphIterator(model.graph)
            for v in n.outputs
            if _is_half(v) and id(v) not in interface
        ]
        self.fail_unless(left, "float16 values remain inside the graph")


PASS = ComputeInFloat32
