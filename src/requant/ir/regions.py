"""Logical kernels: the ``quant.region`` of the MLIR RFC, as calls of ONNX local functions.

A region wraps a group of float ops that a target runs as one kernel (Conv then
Relu, MatMul then Add...). It becomes one node in the ``requant.kernels`` domain
calling a local function whose body is the original ops. The call's inputs and
outputs are the kernel's *ports*: quantization is decided there and only there,
so a port's annotation is simply the annotation of the call's input or output
value. A model with regions still runs in ONNX Runtime (it inlines the
functions) and computes the same thing.

Identical kernels (same ops, attributes and wiring) share one function
definition; the kernel name is kept in the function's metadata, so two
different bodies asked for under one name get ``name`` and ``name_1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.annotations import replace_value, transfer_annotation
from requant.ir.queries import fresh_name

__all__ = ["KERNEL_DOMAIN", "Region", "RegionError", "form_region", "inline_regions", "regions"]

KERNEL_DOMAIN = "requant.kernels"
_KERNEL_KEY = "requant.kernel"


class RegionError(RequantError):
    """A set of nodes cannot form a kernel (not in one graph, not convex, holds subgraphs)."""


@dataclass(frozen=True)
class Region:
    """One logical kernel: its call node, its function, its name and ports."""

    call: ir.Node
    function: ir.Function

    @property
    def kernel(self) -> str:
        """The kernel name asked for when the region was formed."""
        return self.function.metadata_props.get(_KERNEL_KEY, self.function.name)

    @property
    def inputs(self) -> tuple[ir.Value | None, ...]:
        """The input ports (values of the enclosing graph)."""
        return tuple(self.call.inputs)

    @property
    def outputs(self) -> tuple[ir.Value, ...]:
        """The output ports (values of the enclosing graph)."""
        return tuple(self.call.outputs)


def _ports(graph: ir.Graph, members: set[ir.Node]) -> tuple[list[ir.Value], list[ir.Value]]:
    inputs: list[ir.Value] = []
    outputs: list[ir.Value] = []
    for node in graph:
        if node not in members:
            continue
        for value in node.inputs:
            if value is not None and value.producer() not in members and value not in inputs:
                inputs.append(value)
        for value in node.outputs:
            if value.is_graph_output() or any(use.node not in members for use in value.uses()):
                outputs.append(value)
    return inputs, outputs


def _check_convex(members: set[ir.Node], inputs: list[ir.Value]) -> None:
    """No path may leave the region and come back: the call would depend on itself."""
    frontier = [use.node for n in members for o in n.outputs for use in o.uses() if use.node not in members]
    seen: set[ir.Node] = set()
    producers = {v.producer() for v in inputs if v.producer() is not None}
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in producers:
            raise RegionError(
                f"the nodes do not form a convex region: node '{node.name or node.op_type}' is computed from the "
                f"region and feeds it"
            )
        frontier.extend(use.node for o in node.outputs for use in o.uses() if use.node not in members)


def _body_key(function: ir.Function) -> tuple[object, ...]:
    """Structure of a function body: ops, attributes and wiring, not value names."""
    index: dict[int, tuple[int, int]] = {id(v): (-1, i) for i, v in enumerate(function.inputs)}
    key: list[object] = [len(function.inputs)]
    for n, node in enumerate(function):
        attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
        wiring = tuple(index.get(id(v), (-2, -2)) if v is not None else None for v in node.inputs)
        key.append((node.domain, node.op_type, node.overload, attrs, wiring, len(node.outputs)))
        for i, out in enumerate(node.outputs):
            index[id(out)] = (n, i)
    key.append(tuple(index.get(id(v)) for v in function.outputs))
    return tuple(key)


def _register(model: ir.Model, function: ir.Function, kernel: str) -> ir.Function:
    key = _body_key(function)
    for existing in model.functions.values():
        same_kernel = existing.domain == KERNEL_DOMAIN and existing.metadata_props.get(_KERNEL_KEY) == kernel
        if same_kernel and _body_key(existing) == key:
            return existing
    name, i = kernel, 1
    while (KERNEL_DOMAIN, name, "") in model.functions:
        name, i = f"{kernel}_{i}", i + 1
    function.name = name
    function.metadata_props[_KERNEL_KEY] = kernel
    model.functions[function.identifier()] = function
    model.opset_imports.setdefault(KERNEL_DOMAIN, 1)
    return function


def form_region(model: ir.Model, nodes: Sequence[ir.Node], kernel: str) -> Region:
    """Wrap ``nodes`` (one graph, convex) into a call of a ``requant.kernels`` function named ``kernel``."""
    if not nodes:
        raise RegionError(f"kernel '{kernel}': no nodes to wrap")
    graph = nodes[0].graph
    if not isinstance(graph, ir.Graph) or any(n.graph is not graph for n in nodes):
        raise RegionError(f"kernel '{kernel}': the nodes must all belong to one graph")
    for node in nodes:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            raise RegionError(f"kernel '{kernel}': node '{node.name or node.op_type}' holds a subgraph")
    members = set(nodes)
    inputs, outputs = _ports(graph, members)
    if not outputs:
        raise RegionError(f"kernel '{kernel}': the nodes compute nothing used outside them")
    _check_convex(members, inputs)
    ordered = [n for n in graph if n in members]

    # The body: fresh function inputs stand for the ports; the nodes themselves move in.
    params = {id(v): ir.Value(name=v.name, type=v.type, shape=v.shape) for v in inputs}
    call = ir.Node(KERNEL_DOMAIN, kernel, inputs=inputs, num_outputs=len(outputs), name=ordered[-1].name or None)
    for inner, port in zip(outputs, call.outputs, strict=True):
        port.name, port.type, port.shape = inner.name, inner.type, inner.shape
        transfer_annotation(inner, port)
        for use in list(inner.uses()):
            if use.node not in members:
                use.node.replace_input_with(use.idx, port)
        if inner.is_graph_output():
            for i, out in enumerate(graph.outputs):
                if out is inner:
                    graph.outputs[i] = port
    graph.insert_after(ordered[-1], call)
    graph.remove(ordered, safe=False)
    for node in ordered:
        for i, value in enumerate(node.inputs):
            if value is not None and id(value) in params:
                node.replace_input_with(i, params[id(value)])
    body = ir.Graph(
        [params[id(v)] for v in inputs],
        outputs,
        nodes=ordered,
        opset_imports={"": model.opset_imports.get("", 21)},
        name=kernel,
    )
    function = _register(model, ir.Function(KERNEL_DOMAIN, kernel, graph=body, attributes=[]), kernel)
    call.op_type = function.name
    graph.sort()
    return Region(call, function)


def regions(model: ir.Model) -> list[Region]:
    """Every kernel call in the model (main graph and subgraphs), in graph order."""
    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == KERNEL_DOMAIN:
            found.append(Region(node, model.functions[node.op_identifier()]))
    return found


def inline_regions(model: ir.Model) -> int:
    """Replace every kernel call by a copy of its body (keeping port names and annotations); returns how many.

    Function definitions no call uses any more are removed, and so is the domain import.
    """
    count = 0
    for region in regions(model):
        call, function = region.call, region.function
        graph = call.graph
        assert graph is not None
        taken = {v.name for v in graph.inputs} | set(graph.initializers)
        taken |= {o.name for n in graph for o in n.outputs if o.name}
        port_of = {id(inner): port for inner, port in zip(function.outputs, call.outputs, strict=True)}
        mapping: dict[int, ir.Value | None] = {
            id(param): arg for param, arg in zip(function.inputs, call.inputs, strict=True)
        }
        copies = []
        for node in function:
            attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
            copy = ir.Node(
                node.domain,
                node.op_type,
                inputs=[mapping.get(id(v)) if v is not None else None for v in node.inputs],
                attributes=attributes,
                num_outputs=len(node.outputs),
                overload=node.overload,
            )
            for old, new in zip(node.outputs, copy.outputs, strict=True):
                new.type, new.shape = old.type, old.shape
                transfer_annotation(old, new)
                port = port_of.get(id(old))
                if port is not None:  # the value users know by the port's name
                    new.name, port.name = port.name, None
                else:
                    new.name = fresh_name(old.name or "v", taken)
                mapping[id(old)] = new
            copies.append(copy)
        graph.insert_before(call, copies)
        for port, inner in zip(call.outputs, function.outputs, strict=True):
            value = mapping[id(inner)]
            assert value is not None
            replace_value(port, value)
        graph.remove(call, safe=True)
        count += 1
    used = {r.function.identifier() for r in regions(model)}
    for key in [k for k, f in model.functions.items() if f.domain == KERNEL_DOMAIN and k not in used]:
        del model.functions[key]
    if not any(f.domain == KERNEL_DOMAIN for f in model.functions.values()):
        model.opset_imports.pop(KERNEL_DOMAIN, None)
    return count
