"""``remove-identity``: ``Identity`` nodes are bypassed, keeping annotations and the model's interface.

Recurses into subgraphs and local functions. An Identity whose output is a
graph output and whose input is a graph input, another output or an
initializer stays: removing it would rename the model's interface.

Invariant after: every remaining Identity joins two interface values.

Before::

    %A: tensor<2xf32> = Relu(%X)
    %B: tensor<2xf32> = Identity(%A)
    %Y: tensor<2xf32> = Neg(%B)

After::

    %A: tensor<2xf32> = Relu(%X)
    %Y: tensor<2xf32> = Neg(%A)
"""

from __future__ import annotations

import onnx_ir as ir

from requant.passes._base import NodeRewrite
from requant.passes._rewrite import all_nodes, bypass, is_op

__all__ = ["PASS", "RemoveIdentity"]


class RemoveIdentity(NodeRewrite):
    name = "remove-identity"
    op_type = "Identity"
    include_functions = True

    def rewrite(self, node: ir.Node) -> bool:
        return bypass(node)

    def ensures(self, model: ir.Model) -> None:
        left = [
            str(n.outputs[0].name)
            for n in all_nodes(model, functions=True)
            if is_op(n, "Identity") and not (n.outputs[0].is_graph_output() and _interface(n.inputs[0]))
        ]
        self.fail_unless(left, "Identity nodes that could be removed remain")


def _interface(value: ir.Value | None) -> bool:
    return value is None or value.is_graph_input() or value.is_graph_output() or value.is_initializer()


PASS = RemoveIdentity
