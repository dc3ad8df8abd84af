"""Placement: where int8 ends, by modelled cost. Groups of int8 ops that cost more than float are kept float.

After the quantizers have annotated a model, the ops that would run as int8 ops besides the kernels
(elementwise ops, pools, and the layout ops between them) form connected *groups*: ops whose data
inputs and outputs are all quantized, linked by the values between them. Each group is priced both
ways with the target's cost model (:mod:`requant.targets.costs`):

- int8, as annotated: each op's int8 cost, a QuantizeLinear for each value entering from a float
  producer (a graph input, a float op), a DequantizeLinear for each float reader of a value leaving;
- float: each op's float cost, a DequantizeLinear for each read of a value an int8 kernel writes,
  a QuantizeLinear for a float value (made in the group or by a float op) that an int8 kernel reads
  (float readers read a float value as it is).

A group that is clearly cheaper in float (``FLOAT_MARGIN``) is kept float (:func:`place` returns
its nodes; the API annotates the model again with them as ``FLOAT_PLACED``, which asks nothing of
their ports, so the kernels around them stay int8). Float computes the same ops without rounding,
so such a group is both faster and closer to the float model. Each group's decision is reported with
both prices. A value whose shape is symbolic past the batch (a text detector's height and width) is
sized at the first calibration sample's shapes (:func:`sample_sizes`); one still unsized leaves its
group as annotated, and said so; so is a lone op ONNX Runtime fuses into its int8 op whatever requant
writes. A group writing a graph output goes float when float is modelled no dearer (a tie included):
the output then leaves without its int8 rounding (TransNetV2's two Sigmoids of 100 probabilities,
0.6 us either way, cost it 1/255 steps).

Values are counted per sample, at batch 1 (the cost model's measurements); other symbolic dimensions
take the first calibration sample's sizes, where ONNX's shape inference follows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.ir.annotations import request
from requant.ir.queries import DEFAULT_DOMAINS, constant, static_elements
from requant.ir.requests import NoQuant
from requant.ir.traits import WEIGHTED, data_inputs
from requant.quantizers.pattern_quantizer import ANNOTATED_KEY, KEPT_FLOAT_KEY, asks_for_int8
from requant.targets.costs import CostModel

__all__ = ["FLOAT_MARGIN", "Placement", "place", "price_kept_float", "sample_sizes"]

SHARED = "SharedSpecQuantizer"  # its mark on the data-movement ops it annotates

# a group goes float only when modelled at most this fraction of its int8 cost: the model is within
# about 10 % of ONNX Runtime in context (bench/bench_placement.py: a Sigmoid, Tanh, Sigmoid chain
# between int8 convs modelled 3 % cheaper in float measured 1.5 % dearer)
FLOAT_MARGIN = 0.9


@dataclass
class Placement:
    """One group of int8 ops between kernels and where it runs: ``placed`` is ``"int8"`` or ``"float"``
    (or ``"as annotated"`` with ``why`` when it could not be priced); modelled microseconds both ways."""

    nodes: list[str]
    ops: list[str]
    placed: str
    int8_us: float | None = None
    float_us: float | None = None
    why: str = ""
    by: str = "cost"  # "cost": placement decided; "table": the target's table kept it float, priced here

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "ops": self.ops,
            "placed": self.placed,
            "int8_us": None if self.int8_us is None else round(self.int8_us, 2),
            "float_us": None if self.float_us is None else round(self.float_us, 2),
            "why": self.why,
            "by": self.by,
        }


def _quantized(value: ir.Value | None) -> bool:
    r = request(value) if value is not None else None
    return r is not None and not isinstance(r, NoQuant)


def _member(node: ir.Node, costs: CostModel) -> bool:
    """Whether ``node`` runs as an int8 op (or moves int8 values) between conversions as annotated."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type in WEIGHTED or not _int8(node):
        return False
    if not (node.op_type in costs.int8_ops or node.op_type in costs.free):
        return False
    inputs = [node.inputs[i] for i in data_inputs(node)]
    outputs = [o for o in node.outputs if o.uses() or o.is_graph_output()]
    data = [v for v in inputs if v is not None and constant(v) is None]
    return bool(data) and bool(outputs) and all(_quantized(v) for v in data + outputs)


def _int8(node: ir.Node | None) -> bool:
    """Whether a quantizer annotated ``node`` to run in int8: a kernel pattern (Conv, Conv -> Clip,
    MatMulIntegerToFloat...), an int8 op, or a data-movement op sharing its input's quantization."""
    if node is None or KEPT_FLOAT_KEY in node.metadata_props:
        return False
    mark = str(node.metadata_props.get(ANNOTATED_KEY, ""))
    return asks_for_int8(mark) or mark == SHARED


def _groups(members: list[ir.Node]) -> list[list[ir.Node]]:
    """``members`` in connected groups (linked by a value one writes and another reads), in graph order."""
    index = {n: i for i, n in enumerate(members)}
    parent = list(range(len(members)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for node in members:
        for out in node.outputs:
            for user, _ in out.uses():
                if user in index:
                    parent[find(index[user])] = find(index[node])
    groups: dict[int, list[ir.Node]] = {}
    for node in members:
        groups.setdefault(find(index[node]), []).append(node)
    return list(groups.values())


def _size(value: ir.Value | None, sizes: Mapping[str, int]) -> int | None:
    """``value``'s elements at batch 1: where a dimension but the first is symbolic (a sequence or image size,
    which would price everything at one element), its elements at the first calibration sample's shapes
    (``sizes``), else None."""
    if value is None or value.shape is None:
        return None
    if any(not isinstance(d, int) for d in list(value.shape)[1:]):
        return sizes.get(str(value.name))
    return static_elements(value)


def _elements(node: ir.Node, sizes: Mapping[str, int]) -> int | None:
    """What ``node``'s cost scales with: its output's elements (its input's for GlobalAveragePool)."""
    return _size(node.inputs[0] if node.op_type == "GlobalAveragePool" else node.outputs[0], sizes)


def _folded(node: ir.Node) -> bool:
    """A Mul by one positive constant: in int8 the QDQ writer folds it into the scale its readers take
    (``requant.backends.qdq``), so it costs nothing."""
    if node.op_type != "Mul" or node.outputs[0].is_graph_output():
        return False
    factors = [constant(v) for v in node.inputs if v is not None]
    return any(f is not None and f.size == 1 and float(f.reshape(-1)[0]) > 0 for f in factors)


def _reads(value: ir.Value, inside: set[ir.Node]) -> tuple[int, int, int]:
    """How many times ``value`` is read inside the group, by int8 kernels outside it, and in float
    outside it (a graph output counts as a float read)."""
    inside_reads = int8_reads = float_reads = 0
    for user, _ in value.uses():
        if user in inside:
            inside_reads += 1
        elif _int8(user):
            int8_reads += 1
        else:
            float_reads += 1
    return inside_reads, int8_reads, float_reads + int(value.is_graph_output())


def _fused_anyway(node: ir.Node, inside: set[ir.Node], costs: CostModel) -> bool:
    """Whether ONNX Runtime would fuse ``node`` into its int8 op even if kept float: every data input
    read through a DequantizeLinear (an int8 kernel writes it) and every output read only by int8
    kernels, through a QuantizeLinear."""
    if node.op_type not in costs.fused_alone:
        return False
    for i in data_inputs(node):
        v = node.inputs[i]
        if v is None or constant(v) is not None:
            continue
        if v.producer() in inside or not _int8(v.producer()):
            return False
    for out in node.outputs:
        reads_inside, reads_int8, reads_float = _reads(out, inside)
        if reads_inside or reads_float or not reads_int8:
            return False
    return True


def _price(group: list[ir.Node], costs: CostModel, sizes: Mapping[str, int]) -> tuple[float, float] | str:
    """The group's modelled microseconds as int8 and as float; or why it cannot be priced."""
    inside = set(group)
    int8_us = float_us = 0.0
    for node in group:
        elements = _elements(node, sizes)
        if elements is None:
            return f"{node.op_type} '{node.name}' has no static shape after its batch"
        int8_us += 0.0 if _folded(node) else costs.op_us(node.op_type, True, elements)
        float_us += costs.op_us(node.op_type, False, elements)
    touched: dict[int, ir.Value] = {}
    for node in group:
        for i in data_inputs(node):
            v = node.inputs[i]
            if v is not None and constant(v) is None:
                touched.setdefault(id(v), v)
        for v in node.outputs:
            touched.setdefault(id(v), v)
    for value in touched.values():
        size = _size(value, sizes)
        if size is None:
            return f"value '{value.name}' has no static shape after its batch"
        q, dq = costs.quantize.us(size), costs.dequantize.us(size)
        producer = value.producer()
        made_inside = producer in inside
        reads_inside, reads_int8, reads_float = _reads(value, inside)
        # an int8 kernel writes it quantized (a float-output kernel, MatMulIntegerToFloat, does not: its
        # value is quantized for the group, whose price as int8 then misses that QuantizeLinear and as
        # float counts DequantizeLinears it would not need: such a group stays int8, as annotated)
        int8_producer = not made_inside and _int8(producer)
        # int8, as annotated: a float producer's value is quantized once; float readers dequantize
        if not made_inside and not int8_producer:
            int8_us += q
        int8_us += reads_float * dq
        # float: an int8 kernel's value is read through DequantizeLinears; a float one is read as it is,
        # and quantized once if an int8 kernel reads it
        if int8_producer:
            float_us += (reads_inside + reads_float) * dq
        elif reads_int8:
            float_us += q
    return int8_us, float_us


def place(model: ir.Model, costs: CostModel, sizes: Mapping[str, int] | None = None) -> list[Placement]:
    """Every group of int8 ops of the annotated ``model`` between kernels, with where it should run; ``sizes``:
    values' elements at a sample's shapes, for those whose shapes are symbolic (:func:`sample_sizes`)."""
    sizes = sizes or {}
    members = [n for n in model.graph if _member(n, costs)]
    placements = []
    for group in _groups(members):
        costed = [n for n in group if n.op_type not in costs.free]
        if not costed:  # layout ops only: the same either way
            continue
        names = [n.name or n.op_type for n in group]
        ops = [n.op_type for n in group]
        if any(not n.name for n in group):
            placements.append(Placement(names, ops, "as annotated", why="a node without a name"))
            continue
        priced = _price(group, costs, sizes)
        if isinstance(priced, str):
            placements.append(Placement(names, ops, "as annotated", why=f"not priced: {priced}"))
            continue
        int8_us, float_us = priced
        fused = [n for n in group if _fused_anyway(n, set(group), costs)]
        if float_us <= int8_us and any(o.is_graph_output() for n in group for o in n.outputs):
            why = (
                f"it writes a graph output and float costs no more: {float_us:.1f} us against {int8_us:.1f} us "
                "in int8 (modelled); float does not round the output"
            )
            placements.append(Placement(names, ops, "float", int8_us, float_us, why))
        elif fused:
            why = (
                f"ONNX Runtime fuses DequantizeLinear -> {fused[0].op_type} -> QuantizeLinear into its int8 op "
                f"whatever requant writes (modelled: {int8_us:.1f} us in int8, {float_us:.1f} us in float)"
            )
            placements.append(Placement(names, ops, "int8", int8_us, float_us, why))
        elif float_us < FLOAT_MARGIN * int8_us:
            why = f"float is cheaper: {float_us:.1f} us against {int8_us:.1f} us in int8 (modelled)"
            placements.append(Placement(names, ops, "float", int8_us, float_us, why))
        elif int8_us <= float_us:
            why = f"int8 is cheaper: {int8_us:.1f} us against {float_us:.1f} us in float (modelled)"
            placements.append(Placement(names, ops, "int8", int8_us, float_us, why))
        else:
            why = (f"float is not clearly cheaper: {float_us:.1f} us against {int8_us:.1f} us in int8 (modelled; "
                   f"within the model's error, {1 - FLOAT_MARGIN:.0%})")  # fmt: skip
            placements.append(Placement(names, ops, "int8", int8_us, float_us, why))
    return placements


def price_kept_float(model: ir.Model, costs: CostModel, sizes: Mapping[str, int] | None = None) -> list[Placement]:
    """The ops the target's table kept float (a residual sum, for accuracy) between conversions, where
    the runtime has an int8 op for them: what that decision costs, modelled, for the report."""
    sizes = sizes or {}
    priced = []
    for node in model.graph:
        reason = node.metadata_props.get(KEPT_FLOAT_KEY)
        if reason is None or node.op_type not in costs.int8_ops or node.domain not in DEFAULT_DOMAINS:
            continue
        values = [node.inputs[i] for i in data_inputs(node)] + list(node.outputs)
        if not all(_quantized(v) or constant(v) is not None for v in values if v is not None):
            continue
        name = node.name or node.op_type
        prices = _price([node], costs, sizes)
        if isinstance(prices, str):
            continue
        int8_us, float_us = prices
        why = f"kept float by the target's table ({reason.split(':')[0]})"
        if _fused_anyway(node, {node}, costs):
            why += f"; ONNX Runtime fuses it into its int8 {node.op_type} anyway (the same single rounding)"
        else:
            why += f": {float_us - int8_us:+.1f} us against its int8 op (modelled)"
        priced.append(Placement([name], [node.op_type], "float", int8_us, float_us, why, by="table"))
    return priced


def sample_sizes(model: ir.Model, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Each value's elements at batch 1 when the graph inputs have ``shapes`` (a calibration sample's), by ONNX's
    shape inference on a copy; only where the model has a symbolic dimension past the batch (a text detector's
    height and width, a sequence), else nothing. Values it cannot size are left out (priced as before: not)."""
    if all(isinstance(d, int) for v in model.graph.inputs if v.shape is not None for d in list(v.shape)[1:]):
        return {}
    proto = ir.to_proto(model)
    del proto.graph.value_info[:]
    for graph_input in proto.graph.input:
        shape = shapes.get(graph_input.name)
        if shape is None or not graph_input.type.HasField("tensor_type"):
            continue
        dims = graph_input.type.tensor_type.shape
        del dims.dim[:]
        for i, d in enumerate(shape):
            dims.dim.add().dim_value = 1 if i == 0 else int(d)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # a model ONNX's inference cannot follow (a custom domain's op): priced as before
        return {}
    sizes = {}
    for info in (*inferred.graph.value_info, *inferred.graph.output):
        dims = info.type.tensor_type.shape.dim if info.type.HasField("tensor_type") else []
        if dims and all(d.HasField("dim_value") for d in dims):
            sizes[info.name] = int(np.prod([d.dim_value for d in dims]))
    return sizes
