"""``fold-constants``: subgraphs that compute from constants only are evaluated into initializers.

onnxscript's constant folder does the evaluation (with ONNX's reference
semantics, size limits and all); the nodes it leaves dead are then removed.
Recurses into subgraphs.

Invariant after: no node whose inputs are all constant remains, unless folding
it was refused for size; nothing unused remains.

Importing onnxscript costs 0.2 s (its opsets and ONNX's reference ops), as much as
quantizing a small model; a graph where the folder would find nothing to do (the
common exported CNN: its only shape arithmetic reads the dynamic batch size) does
not import it. ``_may_fold`` decides that conservatively, mirroring what the folder
of onnxscript 0.7 rewrites: a node on constants, a ``Shape`` with a static dimension,
a ``Gather``/``Reshape``/``Abs`` on shape values, and the ops it simplifies by rule.

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
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from requant.passes._base import Pass

__all__ = ["PASS", "FoldConstants"]


class FoldConstants(Pass):
    name = "fold-constants"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not _may_fold(model):
            return RemoveUnusedNodesPass()(model)
        import onnxscript.optimizer

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


# Ops onnxscript's folder may rewrite whatever their inputs (Cast to its own type, If on a
# constant, sequences, ...): their presence alone runs the folder.
_RULE_OPS = frozenset(
    {"Cast", "CastLike", "If", "Loop", "Scan", "Size", "Identity", "Dropout", "Expand", "Constant", "Add", "Abs"}
    | {"SequenceConstruct", "SequenceAt", "ConcatFromSequence", "SplitToSequence"}
)
_ShapeValue = list[Any]  # a 1-d int64 tensor's known elements: ints, or dims (symbolic) of some tensor


def _may_fold(model: ir.Model) -> bool:
    """False only when onnxscript's folder would leave ``model`` as it is (see the module's docstring)."""
    if model.functions:
        return True
    known: dict[int, _ShapeValue] = {}  # id(value) -> its shape value
    for node in model.graph:
        if any(isinstance(a.value, ir.Graph) or a.type == ir.AttributeType.GRAPHS for a in node.attributes.values()):
            return True
        inputs = list(node.inputs)
        if not inputs or all(v is not None and v.const_value is not None for v in inputs):
            return True
        if node.op_type in _RULE_OPS and (node.op_type not in ("Add", "Abs") or any(id(v) in known for v in inputs)):
            return True
        value = _shape_value(node, known)
        if value is _FOLDS:
            return True
        if value is not None and node.outputs:
            known[id(node.outputs[0])] = value
    return False


_FOLDS: _ShapeValue = []  # _shape_value's answer (compared by identity) when the folder would replace the node


def _values(value: ir.Value | None, known: dict[int, _ShapeValue]) -> _ShapeValue | None:
    if value is None:
        return None
    if id(value) in known:
        return known[id(value)]
    tensor = value.const_value
    if tensor is not None and tensor.dtype == ir.DataType.INT64 and len(tensor.shape) == 1:
        return [int(x) for x in tensor.numpy()]
    return None


def _shape_value(node: ir.Node, known: dict[int, _ShapeValue]) -> _ShapeValue | None:
    """The node's output as a shape value, ``_FOLDS`` when the folder would rewrite the node, or None."""
    op, inputs = node.op_type, list(node.inputs)
    if op == "Shape":
        shape = inputs[0].shape if inputs[0] is not None else None
        if shape is None:
            return None
        dims = list(shape.dims)[node.attributes.get_int("start", 0) : node.attributes.get_int("end", None)]
        return _FOLDS if all(isinstance(d, int) for d in dims) else dims
    if op == "Concat":
        if len(inputs) == 1 or any(v is not None and v.shape is not None and 0 in v.shape.dims for v in inputs):
            return _FOLDS
        parts = [_values(v, known) for v in inputs]
        if node.attributes.get_int("axis", None) != 0 or any(p is None for p in parts):
            return None
        return [d for p in parts for d in p]  # type: ignore[union-attr]
    if op in ("Reshape", "Squeeze"):
        data = _values(inputs[0], known)
        if op == "Reshape" and len(inputs) > 1:
            target = _values(inputs[1], known)
            shape = inputs[0].shape if inputs[0] is not None else None
            if target is not None and shape is not None and len(target) == len(shape) and _same(shape.dims, target):
                return _FOLDS
        return data
    if op == "Gather":
        data = _values(inputs[0], known)
        index = inputs[1].const_value if len(inputs) > 1 and inputs[1] is not None else None
        if data is None or index is None or node.attributes.get_int("axis", 0) != 0 or len(index.shape) != 1:
            return None
        positions = [int(i) for i in index.numpy()]
        if any(not -len(data) <= i < len(data) for i in positions):
            return _FOLDS  # out of range: the folder reports it
        picked = [data[i] for i in positions]
        return _FOLDS if all(isinstance(d, int) for d in picked) else picked
    return None


def _same(dims: Any, target: _ShapeValue) -> bool:
    """Whether the folder could take the two as the same shape (it compares them as tuples)."""
    return all(a == b or not (isinstance(a, int) and isinstance(b, int)) for a, b in zip(dims, target, strict=True))
