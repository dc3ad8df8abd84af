"""``remove-dropout``: inference-mode ``Dropout`` nodes are bypassed.

A Dropout is removed when it is not in training mode (no ``training_mode``
input, or a constant false one) and its mask output is unused; in inference
it is the identity. Recurses into subgraphs and local functions.

Invariant after: every remaining Dropout trains, or has its mask used, or joins
two interface values.

Before::

    %D: tensor<2xf32> = Dropout(%A) {ratio = 0.5}
    %Y: tensor<2xf32> = Neg(%D)

After::

    %Y: tensor<2xf32> = Neg(%A)
"""

from __future__ import annotations

import onnx_ir as ir

from requant.passes._base import NodeRewrite
from requant.passes._rewrite import bypass, constant

__all__ = ["PASS", "RemoveDropout"]


def _inference(node: ir.Node) -> bool:
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return True
    training = constant(node.inputs[2])
    return training is not None and not bool(training)


class RemoveDropout(NodeRewrite):
    name = "remove-dropout"
    op_type = "Dropout"
    include_functions = True

    def rewrite(self, node: ir.Node) -> bool:
        return _inference(node) and bypass(node)


PASS = RemoveDropout
