"""``fold-constants``: subgraphs that compute from constants only are evaluated into initializers.

onnxscript's constant folder does the evaluation (with ONNX's reference
semantics, size limits and all); the nodes it leaves dead are then removed.
Recurses into subgraphs.

Invariant after: no node whose inputs are all constant remains, unless folding
it was refused for size; nothing unused remains.

Before::

    %W: tensor<3x4xf32> = initializer dense<...>
    %two: tensor<f32> = initializer dense<2.0>
    %W2: tensor<3x4xf32> = Mul(%W, %two)
    %Y: tensor<Nx4xf32> = MatMul(%X, %W2)

After::

    %W2: tensor<3x4xf32> = initializer dense<...>
    %Y: tensor<Nx4xf32> = MatMul(%X, %W2)
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import RemoveUnusedNodesPass

from requant.passes._base import Pass

__all__ = ["PASS", "FoldConstants"]


class FoldConstants(Pass):
    name = "fold-constants"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # the folder logs every value it cannot fold at INFO; that is noise here
        quiet = logging.getLogger("onnxscript.optimizer._constant_folding")
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            folded = onnxscript.optimizer.fold_constants(model, onnx_shape_inference=False)
        finally:
            quiet.setLevel(level)
        cleaned = RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, bool(folded.modified) or cleaned.modified)


PASS = FoldConstants
