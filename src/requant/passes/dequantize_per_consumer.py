"""``dequantize-per-consumer``: each consumer of a ``DequantizeLinear`` gets its own copy.

For models that arrive already quantized (QDQ): a DequantizeLinear feeding two
ops ties their quantization together, and ONNX Runtime fuses a DQ into an int8
kernel only when that kernel is its sole consumer. The first consumer (or a
graph output) keeps the original; the copies share its inputs and carry its
annotation. Recurses into subgraphs.

Invariant after: every DequantizeLinear output has at most one use.

Before::

    %d: tensor<4xf32> = DequantizeLinear(%q, %s, %z)
    %a: tensor<4xf32> = Relu(%d)
    %b: tensor<4xf32> = Neg(%d)

After::

    %d: tensor<4xf32> = DequantizeLinear(%q, %s, %z)
    %a: tensor<4xf32> = Relu(%d)
    %d_1: tensor<4xf32> = DequantizeLinear(%q, %s, %z)
    %b: tensor<4xf32> = Neg(%d_1)
"""

from __future__ import annotations

import onnx_ir as ir

from requant.ir.annotations import transfer_annotation
from requant.passes._base import NodeRewrite
from requant.passes._rewrite import all_nodes, is_op

__all__ = ["PASS", "DequantizePerConsumer"]


def _split(dq: ir.Node) -> bool:
    out = dq.outputs[0]
    uses = list(out.uses())
    keep = 0 if out.is_graph_output() else 1
    if len(uses) <= keep:
        return False
    graph = dq.graph
    assert graph is not None
    for i, use in enumerate(uses[keep:], start=1):
        copy = ir.Node(
            dq.domain,
            dq.op_type,
            inputs=list(dq.inputs),
            attributes=list(dq.attributes.values()),
            num_outputs=1,
            name=f"{dq.name}_{i}" if dq.name else None,
        )
        new = copy.outputs[0]
        new.name = f"{out.name}_{i}" if out.name else None
        new.shape, new.type = out.shape, out.type
        transfer_annotation(out, new)
        graph.insert_before(use.node, copy)
        use.node.replace_input_with(use.idx, new)
    return True


class DequantizePerConsumer(NodeRewrite):
    name = "dequantize-per-consumer"
    op_type = "DequantizeLinear"

    def rewrite(self, node: ir.Node) -> bool:
        return _split(node)

    def ensures(self, model: ir.Model) -> None:
        shared = [
            str(n.outputs[0].name)
            for n in all_nodes(model)
            if is_op(n, "DequantizeLinear") and len(n.outputs[0].uses()) + n.outputs[0].is_graph_output() > 1
        ]
        self.fail_unless(shared, "DequantizeLinear outputs with more than one consumer remain")


PASS = DequantizePerConsumer
