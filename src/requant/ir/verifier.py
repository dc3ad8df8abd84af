"""Structural checks of a model, run by the pass manager before and after passes.

Checked, in the main graph, every subgraph and every local function:

- every value name is defined once (graph inputs, initializers, node outputs);
- every node input and graph output is defined before it is used, in this graph or an
  enclosing one (subgraphs may use outer values);
- every node output is produced by that node;
- no subgraph returns a value of an enclosing graph directly (ONNX Runtime rejects it);
- every annotation fits its value (dtype, rank, shape: :func:`check_annotation`), every
  request too, and shared or derived requests name values the graph can see.
"""

from __future__ import annotations

import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.annotations import AnnotationError, check_annotation, check_request, quant_type, request
from requant.ir.queries import subgraphs
from requant.ir.requests import DerivedSpec, SharedSpec

__all__ = ["VerifyError", "verify_model", "verify_problems"]


class VerifyError(RequantError):
    """The IR broke an invariant; the message lists every problem found."""


def _graph_problems(
    graph: ir.Graph | ir.Function, outer: frozenset[int], where: str, outer_names: frozenset[str] = frozenset()
) -> list[str]:
    problems: list[str] = []
    names: dict[str, str] = {}
    defined: set[int] = set(outer)
    local: set[int] = set()  # defined in this graph itself

    def define(value: ir.Value, what: str) -> None:
        defined.add(id(value))
        local.add(id(value))
        if value.name:
            if value.name in names:
                problems.append(f"{where}: value name '{value.name}' is defined twice ({names[value.name]}, {what})")
            names.setdefault(value.name, what)
        t = quant_type(value)
        r = request(value)
        try:
            if t is not None:
                check_annotation(value, t)
            if r is not None:
                check_request(value, r)
        except AnnotationError as exc:
            problems.append(f"{where}: {exc}")

    for value in graph.inputs:
        define(value, "graph input")
    if isinstance(graph, ir.Graph):
        for value in graph.initializers.values():
            if id(value) not in defined:
                define(value, "initializer")
    for index, node in enumerate(graph):
        label = f"node {index} ({node.op_type}{' ' + repr(node.name) if node.name else ''})"
        for i, used in enumerate(node.inputs):
            if used is not None and id(used) not in defined:
                problems.append(f"{where}: {label} uses input {i} '{used.name}' before it is defined")
        for attr in node.attributes.values():
            for sub in subgraphs(attr):
                problems += _graph_problems(
                    sub, frozenset(defined), f"{where} > {label}.{attr.name}", frozenset(names) | outer_names
                )
        for i, value in enumerate(node.outputs):
            if value.producer() is not node:
                problems.append(f"{where}: {label} output {i} '{value.name}' has another producer")
            define(value, label)
    for i, value in enumerate(graph.outputs):
        if id(value) not in defined:
            problems.append(f"{where}: graph output {i} '{value.name}' is not defined")
        elif id(value) not in local:
            problems.append(
                f"{where}: graph output {i} '{value.name}' is a value of an enclosing graph returned directly "
                "(ONNX Runtime and ONNX's checker reject that: a node of this graph must produce it)"
            )
    problems += _request_problems(graph, set(names) | outer_names, where)
    return problems


def _request_problems(graph: ir.Graph | ir.Function, names: set[str], where: str) -> list[str]:
    """Shared and derived requests must name values this graph can see."""
    problems = []
    values = list(graph.inputs) + [o for n in graph for o in n.outputs]
    if isinstance(graph, ir.Graph):
        values += list(graph.initializers.values())
    for value in values:
        r = request(value)
        referenced = (r.other,) if isinstance(r, SharedSpec) else r.sources if isinstance(r, DerivedSpec) else ()
        for name in referenced:
            if name not in names:
                problems.append(f"{where}: value '{value.name}' asks for {r}, but no value is named '{name}'")
    return problems


def verify_problems(model: ir.Model) -> list[str]:
    """Every problem found, as readable lines (empty when the model is well formed)."""
    problems = _graph_problems(model.graph, frozenset(), f"graph '{model.graph.name or 'main'}'")
    for key in sorted(model.functions):
        func = model.functions[key]
        problems += _graph_problems(func, frozenset(), f"function '{func.domain}::{func.name}'")
    return problems


def verify_model(model: ir.Model) -> None:
    """Raise :class:`VerifyError` listing every problem, or return quietly."""
    problems = verify_problems(model)
    if problems:
        raise VerifyError(f"the IR is not well formed ({len(problems)} problems):\n  " + "\n  ".join(problems))
