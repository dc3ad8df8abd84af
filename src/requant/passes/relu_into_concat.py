"""``relu-into-concat``: a ``Relu`` of a ``Concat`` becomes a Relu of each of its inputs, concatenated.

An elementwise op commutes with Concat, so this computes the same values. It is
done where each input of the Concat is read only there and produced by a node
(not a graph input or constant), so each new Relu can join the kernel before it:
each kernel's int8 output then covers its own non-negative range (TransNetV2's
blocks: four 3-d convolutions, concatenated, a batch norm folded into them, a
Relu), where a Relu after the Concat leaves the Concat's output one int8 scale
over the negative values too, which the Relu then drops. The Concat's output
takes the Relu's name and its readers. Recurses into subgraphs.

Invariant after: no Relu reads the only use of a Concat output whose inputs are
each read only by that Concat and each the output of a node.

Before::

    %c: tensor<1x8x4x4xf32> = Concat(%a, %b) {axis = 1}
    %Y: tensor<1x8x4x4xf32> = Relu(%c)

After::

    %a_relu: tensor<1x4x4x4xf32> = Relu(%a)
    %b_relu: tensor<1x4x4x4xf32> = Relu(%b)
    %Y: tensor<1x8x4x4xf32> = Concat(%a_relu, %b_relu) {axis = 1}
"""

from __future__ import annotations

import onnx_ir as ir

from requant.ir.queries import fresh_name, graph_values
from requant.passes._base import NodeRewrite
from requant.passes._rewrite import is_op, take_over

__all__ = ["PASS", "ReluIntoConcat"]


def _distributable(concat: ir.Node) -> bool:
    return all(
        v is not None and v.producer() is not None and len(v.uses()) == 1 and not v.is_graph_output()
        for v in concat.inputs
    )


def _distribute(relu: ir.Node) -> bool:
    x = relu.inputs[0]
    concat = x.producer() if x is not None else None
    if x is None or concat is None or not is_op(concat, "Concat") or len(x.uses()) != 1 or x.is_graph_output():
        return False
    if not _distributable(concat):
        return False
    graph = relu.graph
    assert graph is not None
    taken: set[str | None] = {v.name for v in graph_values(graph)}
    for index, value in enumerate(list(concat.inputs)):
        assert value is not None
        name = fresh_name(f"{value.name or 'concat_input'}_relu", taken)
        new = ir.Node("", "Relu", inputs=[value], num_outputs=1, name=f"{relu.name or 'Relu'}_{index}")
        new.outputs[0].name, new.outputs[0].shape, new.outputs[0].type = name, value.shape, value.type
        graph.insert_before(concat, new)
        concat.replace_input_with(index, new.outputs[0])
    take_over(relu, x)
    return True


class ReluIntoConcat(NodeRewrite):
    name = "relu-into-concat"
    op_type = "Relu"

    def rewrite(self, node: ir.Node) -> bool:
        return _distribute(node)


PASS = ReluIntoConcat
