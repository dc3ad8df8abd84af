"""``remove-identity``: ``Identity`` nodes are bypassed, keeping annotations and the model's interface.

Recurses into subgraphs and local functions. An Identity whose output is a
graph output and whose input is not computed in the same graph (a graph input,
an initializer, a subgraph's outer-scope value) or is another output stays:
removing it would rename the model's interface, or make a subgraph return an
outer value directly (ONNX Runtime and ONNX's checker reject that).

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
from requant.passes._rewrite import all_nodes, bypass, is_op, keeps_interface

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
            if is_op(n, "Identity")
            and n.inputs[0] is not None
            and not (n.outputs[0].is_graph_output() and keeps_interface(n, n.inputs[0]))
        ]
        self.fail_unless(left, "Identity nodes that could be removed remain")


PASS = RemoveIdentity
