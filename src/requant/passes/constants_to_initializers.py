"""``constants-to-initializers``: weights held in ``Constant`` nodes become initializers.

Quantization tools treat a ``Constant`` node's output as an activation, so its
weights get calibrated like data, which ruins accuracy on models exported that
way. Recurses into subgraphs (a subgraph's constants become its own
initializers); local functions keep theirs (functions have no initializers),
and so does a Constant that is itself a graph output (onnx-ir leaves those).

Invariant after: no ``Constant`` node in the main graph or any subgraph feeds a node.

Before::

    %W: tensor<3x4xf32> = Constant() {value = dense<...> : tensor<3x4xf32>}
    %Y: tensor<Nx4xf32> = MatMul(%X, %W)

After::

    %W: tensor<3x4xf32> = initializer dense<...>
    %Y: tensor<Nx4xf32> = MatMul(%X, %W)
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import LiftConstantsToInitializersPass

from requant.passes._base import Pass
from requant.passes._rewrite import all_nodes, is_op

__all__ = ["PASS", "ConstantsToInitializers"]


class ConstantsToInitializers(Pass):
    name = "constants-to-initializers"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        return ir.passes.PassResult(model, result.modified)

    def ensures(self, model: ir.Model) -> None:
        left = [str(n.outputs[0].name) for n in all_nodes(model) if is_op(n, "Constant") and n.outputs[0].uses()]
        self.fail_unless(left, "Constant nodes feeding other nodes remain")


PASS = ConstantsToInitializers
