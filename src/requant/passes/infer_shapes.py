"""``infer-shapes``: ONNX's shape and type inference fills in every value's type and shape.

Symbolic dimensions (batch, sequence) keep their names. Inference problems do
not stop the pipeline (values stay as they were). Recurses into subgraphs.

The shapes a model declares for its inner values (its ``value_info``: an exporter's
claims) are not trusted: ONNX's inference keeps a declared shape whose rank
differs from what the node computes (ONNX Runtime warns, "falling back to lenient
merge"), and requant copied such a claim into every model it wrote (an Unsqueeze
of a scalar declared ``[1, 1]`` stayed so in the quantized model). So the inner
values' shapes are inferred from the graph alone; a declared shape is kept only
where inference finds none, a declared dimension where the inferred one is
anonymous.

Invariant after: values ONNX can infer have a type and the shape the graph
computes.

Before::

    %M: ? = MatMul(%X, %W)

After::

    %M: tensor<Nx4xf32> = MatMul(%X, %W)
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from requant.passes._base import Pass

__all__ = ["PASS", "InferShapes"]


class InferShapes(Pass):
    name = "infer-shapes"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        declared = {}
        for graph in model.graphs():  # the inner values' declared shapes, set aside (the interface keeps its own)
            interface = {id(v) for v in (*graph.inputs, *graph.outputs)}
            for node in graph:
                for value in node.outputs:
                    if value.shape is not None and id(value) not in interface:
                        declared[id(value)] = (value, value.shape)
                        value.shape = None
        result = ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        changed = False
        for value, shape in declared.values():
            value.shape = _merged(value.shape, shape)
            changed |= value.shape != shape
        return ir.passes.PassResult(model, result.modified or changed)


def _merged(inferred: ir.Shape | None, declared: ir.Shape) -> ir.Shape:
    """The graph's shape, with what the declaration adds where inference found less: the whole declaration
    when nothing was inferred, and a declared dimension where the inferred one (same rank) is unknown."""
    if inferred is None:
        return declared
    if inferred.rank() != declared.rank():
        return inferred  # the declaration is wrong
    pairs = zip(inferred, declared, strict=True)
    dims = [i if isinstance(i, int) or not _anonymous(i) or _anonymous(d) else d for i, d in pairs]
    return ir.Shape(dims)


def _anonymous(dim: object) -> bool:
    """An unknown dimension with no name of the model's (ONNX's inference names them ``unk__N``)."""
    return not isinstance(dim, int) and (dim is None or str(dim) in ("", "None") or str(dim).startswith("unk__"))


PASS = InferShapes
