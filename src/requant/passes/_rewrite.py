"""Small rewrite helpers shared by passes: constants, new initializers, bypassing a node."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.ir.annotations import load_annotations, replace_value
from requant.ir.queries import DEFAULT_DOMAINS, constant, fresh_name, graph_values, is_op

__all__ = [
    "DEFAULT_DOMAINS",
    "adopt_name",
    "all_nodes",
    "bypass",
    "constant",
    "drop_if_unused",
    "is_op",
    "keeps_interface",
    "new_initializer",
    "only_reader",
    "other_input",
    "reduces_last_axis",
    "replace_chain",
    "take_over",
    "with_opset",
]


def all_nodes(model: ir.Model, functions: bool = False) -> Iterator[ir.Node]:
    """Nodes of the main graph and every subgraph, and of local functions if asked.

    A snapshot: safe to rewrite while iterating.
    """
    graphs: list[ir.Graph | ir.Function] = [model.graph, *(model.functions.values() if functions else ())]
    return iter([node for graph in graphs for node in ir.traversal.RecursiveGraphIterator(graph)])


def with_opset(model: ir.Model, version: int) -> ir.Model:
    """``model`` converted to the default domain's opset ``version`` by ONNX's version converter (a new
    model), its nodes' metadata (module paths, decisions), which the converter drops, and its values'
    annotations put back."""
    kept = {n.name: dict(n.metadata_props) for n in model.graph if n.name and n.metadata_props}
    proto = onnx.version_converter.convert_version(ir.serde.serialize_model(model), version)
    converted = ir.serde.deserialize_model(proto)
    for node in converted.graph:
        node.metadata_props.update(kept.get(node.name or "", {}))
    load_annotations(converted)
    return converted


def new_initializer(graph: ir.Graph, base_name: str, array: npt.NDArray[np.generic]) -> ir.Value:
    """Register ``array`` as an initializer of ``graph`` under a name not used there yet."""
    name = fresh_name(base_name, {v.name for v in graph_values(graph)})
    data = np.asarray(array)  # a 0-d array stays 0-d (np.ascontiguousarray makes it 1-d: a scalar's rank changed)
    tensor = ir.Tensor(data if data.flags.c_contiguous else data.copy(), name=name)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def drop_if_unused(graph: ir.Graph, value: ir.Value) -> bool:
    """Remove initializer ``value`` from ``graph`` when nothing reads it any more and it is not part of
    the graph's interface; whether it went."""
    if value.uses() or not value.is_initializer() or value.is_graph_input() or value.is_graph_output():
        return False
    graph.initializers.pop(str(value.name))
    return True


def adopt_name(old: ir.Value, new: ir.Value) -> None:
    """Give ``new`` (a fresh node's output, before insertion) the name of the ``old`` value it replaces.

    Otherwise the graph names it ``val_N`` on insertion, and users lose the name they know.
    """
    name = old.name
    old.name = None
    new.name = name


def take_over(node: ir.Node, new: ir.Value, name: bool = True) -> None:
    """``new`` computes what ``node``'s output did (a fold into its producer): it takes that output's
    readers, its shape and type where they are known, and, with ``name`` and unless either is a graph
    output, its name (tools comparing by name find it); ``node`` goes."""
    old = node.outputs[0]
    new.shape, new.type = old.shape or new.shape, old.type or new.type
    if name and not new.is_graph_output() and not old.is_graph_output():
        adopt_name(old, new)
    replace_value(old, new)
    graph = node.graph
    assert graph is not None
    graph.remove(node, safe=True)


def only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node reading ``value``, when it is an ``op_type`` and the value is no graph output."""
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1 or not is_op(uses[0].node, op_type):
        return None
    reader: ir.Node = uses[0].node
    return reader


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a two-input ``node`` (an Add, Mul, Div...) that is not ``value``; None when ``value`` is neither."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    return b if a is value else a if b is value else None


def reduces_last_axis(node: ir.Node, rank: int | None) -> bool:
    """A Reduce op over the last axis only (an attribute; an input from opset 18), keeping it (``-1``,
    or ``rank - 1`` where the rank is known)."""
    if node.attributes.get_int("keepdims", 1) != 1:
        return False
    given = constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    attribute = node.attributes.get("axes")
    axes = given.reshape(-1).tolist() if given is not None else attribute.as_ints() if attribute is not None else []
    return len(axes) == 1 and (int(axes[0]) == -1 or (rank is not None and int(axes[0]) == rank - 1))


def replace_chain(nodes: list[ir.Node], fused: ir.Node) -> None:
    """``fused`` (a new node) computes what the chain ``nodes`` did: it goes before the last one and
    takes its output's readers, name, shape and type, and the first one's metadata; the chain goes."""
    last = nodes[-1]
    graph = last.graph
    assert graph is not None
    old, new = last.outputs[0], fused.outputs[0]
    fused.metadata_props.update(nodes[0].metadata_props)
    adopt_name(old, new)
    new.shape, new.type = old.shape, old.type
    graph.insert_before(last, fused)
    replace_value(old, new)
    graph.remove(list(reversed(nodes)), safe=True)


def bypass(node: ir.Node, input_index: int = 0, output_index: int = 0) -> bool:
    """Remove ``node`` by wiring its output to its input (keeping annotations); False if not safe.

    Not safe when the output is an output of its graph and the input is not computed by a node of
    that same graph (a graph input, an initializer, a value of an outer graph a subgraph reads) or
    is another graph output: renaming it would change the model's interface, or leave a subgraph
    returning an outer value directly, which ONNX Runtime and ONNX's checker reject.
    """
    graph = node.graph
    source, result = node.inputs[input_index], node.outputs[output_index]
    if graph is None or source is None:
        return False
    if result.is_graph_output() and keeps_interface(node, source):
        return False
    if any(o.uses() or o.is_graph_output() for i, o in enumerate(node.outputs) if i != output_index):
        return False
    replace_value(result, source)
    graph.remove(node, safe=True)
    return True


def keeps_interface(node: ir.Node, source: ir.Value) -> bool:
    """``node``'s output, a graph output, cannot be replaced by ``source`` (see :func:`bypass`)."""
    producer = source.producer()
    return producer is None or producer.graph is not node.graph or source.is_graph_output()
