"""``fuse-l2-normalize``: a row divided by its L2 norm, written out, becomes one ``LpNormalization``.

PyTorch's ``F.normalize(x, dim=-1)`` (a sentence embedding's last step) exports as::

    %norm = ReduceL2(%x) {axes = [-1], keepdims = 1}
    %safe = Clip(%norm, eps)          (optional)
    %wide = Expand(%safe, %shape)     (optional)
    %y = Div(%x, %wide)

Legal when the norm is over the last axis only, keeping it; ``eps`` a constant number no larger than
1e-6 (the fused op divides by the norm itself: the two differ only on rows whose norm is below it);
and nothing but the next op reads each value inside.

Invariant after: no such chain remains.

After::

    %y = LpNormalization(%x) {axis = -1, p = 2}
"""

from __future__ import annotations

import onnx_ir as ir

from requant.passes._base import Pass
from requant.passes._rewrite import constant, is_op, only_reader, reduces_last_axis, replace_chain

__all__ = ["PASS", "FuseL2Normalize", "find"]

LARGEST_EPSILON = 1e-6


def _chain(norm: ir.Node) -> list[ir.Node] | None:
    x = norm.inputs[0]
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if x is None or not reduces_last_axis(norm, rank):
        return None
    nodes, current = [norm], norm.outputs[0]
    for op_type in ("Clip", "Expand"):
        step = only_reader(current, op_type)
        if step is None:
            continue
        if op_type == "Clip":
            low = constant(step.inputs[1]) if len(step.inputs) > 1 and step.inputs[1] is not None else None
            high = step.inputs[2] if len(step.inputs) > 2 else None
            if low is None or low.size != 1 or float(low.reshape(-1)[0]) > LARGEST_EPSILON or high is not None:
                return None
        nodes.append(step)
        current = step.outputs[0]
    div = only_reader(current, "Div")
    if div is None or div.inputs[0] is not x or div.inputs[1] is not current:
        return None
    return [*nodes, div]


def find(model: ir.Model) -> list[list[ir.Node]]:
    """The written-out L2 normalizations of ``model``'s main graph."""
    return [c for node in list(model.graph) if is_op(node, "ReduceL2") and (c := _chain(node)) is not None]


class FuseL2Normalize(Pass):
    name = "fuse-l2-normalize"
    recurses_into_subgraphs = False
    into = "one LpNormalization (p 2: a row over its L2 norm, written out)"

    def finds(self, model: ir.Model) -> list[str]:
        return [f"{c[0].op_type} '{c[0].name}'" for c in find(model)]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        chains = find(model)
        for nodes in chains:
            attributes = [ir.AttrInt64("axis", -1), ir.AttrInt64("p", 2)]
            replace_chain(nodes, ir.Node("", "LpNormalization", [nodes[0].inputs[0]], attributes, num_outputs=1,
                                         name=nodes[0].name or None))  # fmt: skip
        return ir.passes.PassResult(model, bool(chains))


PASS = FuseL2Normalize
