"""``unique-names``: every value and node gets a name, unique in the model.

onnx-ir saves duplicate value names without complaint, and ONNX Runtime then
fails or mis-wires the model; this pass fixes names before export. Graph
inputs and outputs keep theirs. Recurses into subgraphs and local functions.

Invariant after: no two values (or nodes) share a name, and none is empty.

Before::

    %_0: tensor<2xf32> = Relu(%X)
    %A: tensor<2xf32> = Neg(%_0)

After::

    %val_0: tensor<2xf32> = Relu(%X) loc("node_Relu_0")
    %A: tensor<2xf32> = Neg(%val_0) loc("node_Neg_1")
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass

from requant.passes._base import Pass

__all__ = ["PASS", "UniqueNames"]


class UniqueNames(Pass):
    name = "unique-names"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = NameFixPass()(model)
        renamed = _rename_repeats(model)
        return ir.passes.PassResult(model, result.modified or renamed)

    def ensures(self, model: ir.Model) -> None:
        from requant.ir.annotations import iter_values

        graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        problems = []
        for graph in graphs:
            seen: set[str] = set()
            for value in iter_values(graph):
                if not value.name:
                    problems.append("a value without a name")
                elif value.name in seen:
                    problems.append(f"'{value.name}' twice")
                seen.add(value.name or "")
        self.fail_unless(problems, "value names are not unique")


def _rename_repeats(model: ir.Model) -> bool:
    """Give a fresh name to each value (and node) whose name an earlier one of the model (subgraphs
    included) already has, but the main graph's inputs and outputs: onnx-ir's NameFixPass names each
    graph on its own, and silero-vad's two If branches each got a 'v' for their LSTM's unused output."""
    from requant.ir.annotations import iter_values
    from requant.ir.queries import fresh_name

    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    interface = {id(v) for v in (*model.graph.inputs, *model.graph.outputs)}
    renamed = False
    for graph in graphs:
        values = list(iter_values(graph))
        taken = {v.name for v in values}
        seen: set[str | None] = {v.name for v in values if id(v) in interface}
        for value in values:
            if id(value) in interface:
                continue
            if value.name in seen:
                value.name = fresh_name(value.name or "val", taken)
                renamed = True
            seen.add(value.name)
        nodes = list(ir.traversal.RecursiveGraphIterator(graph))
        taken_nodes: set[str | None] = {n.name for n in nodes}
        seen_nodes: set[str | None] = set()
        for node in nodes:
            if node.name in seen_nodes:
                node.name = fresh_name(node.name or "node", taken_nodes)
                renamed = True
            seen_nodes.add(node.name)
    return renamed


PASS = UniqueNames
