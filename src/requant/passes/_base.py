"""The base of requant's passes."""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

__all__ = ["NodeRewrite", "Pass"]


class Pass(ir.passes.InPlacePass):
    """An in-place pass over an onnx-ir model.

    Subclasses set ``name`` (the file name with dashes) and say whether they
    recurse into subgraphs (``If``/``Loop``/``Scan`` bodies) and local
    functions; their docstring states the invariant that holds afterwards,
    with a short before/after. ``requires`` and ``ensures`` (from onnx-ir's
    pass base) check pre- and postconditions.
    """

    name: ClassVar[str]
    recurses_into_subgraphs: ClassVar[bool]
    # the default domain's opset the pass's rewrites need (0: any); below it the pass changes nothing,
    # and a caller that wants them raises the model's opset first where ``finds`` names something
    opset: ClassVar[int] = 0
    into: ClassVar[str] = ""  # what it rewrites ``finds`` into, for a report

    def finds(self, model: ir.Model) -> list[str]:
        """What the pass would rewrite in ``model`` at its ``opset`` (the first node of each)."""
        return []

    def __repr__(self) -> str:
        return f"<pass {self.name}>"

    def fail_unless(self, problems: list[str], what: str) -> None:
        """Raise onnx-ir's PostconditionError listing ``problems`` (for ``ensures``)."""
        if problems:
            shown = ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
            raise ir.passes.PostconditionError(f"{what}: {shown}")


class NodeRewrite(Pass):
    """A pass that visits every node of one standard op type and may rewrite it.

    Subclasses set ``op_type`` and implement ``rewrite(node) -> bool`` (True if
    it changed the model). Visits the main graph and its subgraphs, and local
    functions too when ``include_functions`` is set.
    """

    op_type: ClassVar[str]
    include_functions: ClassVar[bool] = False
    recurses_into_subgraphs = True

    def rewrite(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from requant.passes._rewrite import all_nodes, is_op

        modified = False
        for node in all_nodes(model, functions=self.include_functions):
            if is_op(node, self.op_type) and node.graph is not None:
                modified |= self.rewrite(node)
        return ir.passes.PassResult(model, modified)
