"""The shared-spec quantizer: data-movement ops take the quantization of their data input.

Reshape, Transpose, Flatten, Squeeze/Unsqueeze, Concat, Split, Slice, Gather (on activations),
MaxPool, Max/Min, Pad, Resize... change no values, so their outputs get ``SharedSpec`` of their
data input, and a chain of them (Reshape -> Transpose -> Reshape) shares one set of parameters.
It runs last, in graph order. An output that already carries a plain spec equal to its input's
(a consumer asked for the same thing) is tied to the input too: the same request, one set of
parameters, no requantize. The edge cases are decided explicitly and reported:

- an input that is float (no request, or ``NoQuant``): the op stays float;
- a Gather whose data is a constant table (an embedding lookup) and whose output a quantized op
  reads: the table is stored quantized with the spec that op asked for (its parameters from the
  table's own values), and the output shares them, so ONNX Runtime gathers int8 rows; when only
  float ops read the output, the table stays float;
- a Concat (or Max/Min) whose inputs ask for different parameters: the output shares the
  first input's; propagation requantizes the others;
- a zero ``Pad`` reading an unquantized value, whose output a kernel reads quantized: its input
  gets that request and the output shares it (the Pad moves integers; see ``_quantize_before_pad``);
- an unquantized value read only through a tree of layout-only ops (a Focus stem's strided Slices
  and their Concat), whose ends kernels read with one per-tensor request: the value gets that
  request and the tree shares it (``_quantize_before_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from requant.ir.annotations import element_name, request, set_request
from requant.ir.queries import DEFAULT_DOMAINS, constant, graph_values, pads_with_zero, static_elements
from requant.ir.requests import NoQuant, QuantizationSpec, Request, SharedSpec
from requant.ir.traits import DATA_MOVEMENT, LAYOUT_ONLY, data_inputs
from requant.quantizers.pattern_quantizer import QuantizeState
from requant.quantizers.records import NodeDecision, QuantizerRecord
from requant.types import FLOAT_FORMATS

# an embedding table whose rows only float ops read: stored as uint8 (a quarter of the bytes),
# ONNX Runtime gathers uint8 rows and dequantizes just those
_TABLE = QuantizationSpec("uint8")

__all__ = ["SharedSpecQuantizer"]


def _root(value: ir.Value, by_name: dict[str, ir.Value]) -> Request | None:
    """The request a chain of shared specs leads to (the first non-shared one)."""
    seen = set()
    r = request(value)
    while isinstance(r, SharedSpec) and r.other not in seen:
        seen.add(r.other)
        source = by_name.get(r.other)
        r = request(source) if source is not None else None
    return r


def _quantize_before_pad(node: ir.Node) -> None:
    """A zero Pad reading a value nothing quantizes, whose output a kernel reads quantized: quantize
    before the Pad instead of after it, with the same request.

    The same numbers (a zero point stands for 0 exactly), but the Pad then moves the integers: ONNX
    Runtime keeps a float Pad between DequantizeLinear and QuantizeLinear, and quantizing the
    smaller input costs less. (The channel padding of ``PAD_CONV_CHANNELS`` makes these.)
    """
    source, out = node.inputs[0], node.outputs[0]
    if source is None or request(source) is not None or not pads_with_zero(node):
        return
    wanted = request(out)
    if isinstance(wanted, QuantizationSpec) and wanted.granularity == "per_tensor":
        set_request(source, wanted)


def _layout_ends(source: ir.Value) -> list[ir.Value] | None:
    """The values at the ends of the tree of layout-only ops reading ``source`` and nothing else: each
    the first value a quantizer asked for; None when any part of the tree is not that (a float reader,
    a graph output, an op reading another value too, a value a kernel wants as float)."""
    inside, nodes = {id(source)}, {}
    ends: list[ir.Value] = []
    pending = [source]
    while pending:
        value = pending.pop()
        if value.is_graph_output() or not value.uses():
            return None
        for use in value.uses():
            node = use.node
            moves = node.op_type in LAYOUT_ONLY and node.domain in DEFAULT_DOMAINS
            if not moves or use.idx not in data_inputs(node):  # not a move, or a shape or axes input
                return None
            if id(node) in nodes:
                continue
            nodes[id(node)] = node
            for out in node.outputs:
                wanted = request(out)
                if wanted is not None and not isinstance(wanted, QuantizationSpec):
                    return None
                inside.add(id(out))
                (ends if wanted is not None else pending).append(out)
    for node in nodes.values():  # a Concat with a value from elsewhere: that value is quantized apart
        if not all(node.inputs[i] is not None and id(node.inputs[i]) in inside for i in data_inputs(node)):
            return None
    return ends


def _quantize_before_layout(source: ir.Value) -> None:
    """An unquantized value read only through layout-only ops whose ends kernels read quantized with
    one per-tensor request: quantize the value instead, with that request, when the ends together
    hold at least its elements (a crop is cheaper to quantize after it).

    The same numbers where the ends hold the value's elements (a Focus stem: four strided Slices and
    their Concat), but the ops then move bytes: on ddddocr's YOLOX-style detector, ONNX Runtime's six
    float Slices took 0.58-0.81 ms of a 21 ms int8 model, as uint8 0.44-0.48 ms (AVX2 kernels)."""
    if request(source) is not None or element_name(source.dtype) not in FLOAT_FORMATS:
        return
    ends = _layout_ends(source)
    if not ends:
        return
    wanted = {request(e) for e in ends}
    spec = wanted.pop() if len(wanted) == 1 else None
    if not isinstance(spec, QuantizationSpec) or spec.granularity != "per_tensor":
        return
    counts = [static_elements(v) for v in (source, *ends)]
    if any(c is None for c in counts) or sum(c for c in counts[1:] if c) < (counts[0] or 0):
        return
    set_request(source, spec)


@dataclass(frozen=True)
class SharedSpecQuantizer:
    """Shares parameters across the data-movement ops listed in ``ops``."""

    ops: tuple[str, ...] = tuple(DATA_MOVEMENT)

    def describe(self) -> str:
        return "SharedSpecQuantizer"

    def annotate(self, model: ir.Model, state: QuantizeState) -> QuantizerRecord:
        record = QuantizerRecord("SharedSpecQuantizer", f"OpType({', '.join(self.ops)})", "SHARED", "DATA_MOVEMENT")
        graph = model.graph
        values = graph_values(graph)
        by_name = {v.name: v for v in values if v.name}
        for value in values:
            _quantize_before_layout(value)
        for node in model.graph:
            if node.op_type not in self.ops or node.domain not in DEFAULT_DOMAINS:
                continue
            record.selected += 1
            if (earlier := state.already(node)) is not None:
                record.decisions.append(earlier)
                continue
            name = node.name or node.op_type
            sources = [node.inputs[i] for i in data_inputs(node)]
            if node.op_type == "Gather" and constant(sources[0]) is not None:
                record.decisions.append(self._embedding(node, sources[0], state))
                continue
            if node.op_type == "Pad":
                _quantize_before_pad(node)
            reason = self._float_reason(node, sources)
            if reason:
                record.decisions.append(NodeDecision([name], node.op_type, "rejected", reason))
                continue
            first = sources[0]
            assert first is not None and first.name
            decision = NodeDecision([name], node.op_type, "accepted", inputs={first.name: str(request(first))})
            if len({str(request(s)) for s in sources if s is not None}) > 1:
                decision.reason = f"inputs ask for different parameters: the output shares '{first.name}'s"
            for out in node.outputs:
                wanted = SharedSpec(first.name)
                existing = request(out)
                # An equal plain spec (a consumer's input request) is tied to the input: the same
                # request, with one set of parameters instead of a requantize. Anything else stays.
                if existing is None or existing == _root(first, by_name):
                    set_request(out, wanted)
                decision.outputs[str(out.name)] = str(request(out))
            state.mark(node, self.describe())
            record.decisions.append(decision)
        return record

    def _embedding(self, node: ir.Node, table: ir.Value | None, state: QuantizeState) -> NodeDecision:
        """A Gather from a constant table: quantize the table as its output's reader asks, and share."""
        assert table is not None and table.name
        name, out = node.name or node.op_type, node.outputs[0]
        wanted = request(out)
        note = "an embedding: the table is stored quantized with its reader's request, the rows share it"
        if wanted is None and out.uses():  # read by float ops no quantizer kept float on purpose (a LayerNorm)
            wanted = _TABLE
            note = "an embedding read in float: the table is stored uint8, its rows are gathered and dequantized"
        if not isinstance(wanted, QuantizationSpec) or wanted.granularity != "per_tensor":
            reason = f"gathers from a constant table '{table.name}' (an embedding) whose rows are read as float"
            return NodeDecision([name], node.op_type, "rejected", reason)
        if request(table) is None:
            set_request(table, wanted)
        set_request(out, SharedSpec(table.name))
        state.mark(node, self.describe())
        return NodeDecision(
            [name],
            node.op_type,
            "accepted",
            note,
            {table.name: str(request(table))},
            {str(out.name): str(request(out))},
        )

    @staticmethod
    def _float_reason(node: ir.Node, sources: list[ir.Value | None]) -> str:
        # a data-movement op always has data, and onnx-ir names every value of a graph
        assert sources and all(v is not None and v.name for v in sources), node
        for value in sources:
            assert value is not None
            r = request(value)
            if r is None or isinstance(r, NoQuant):
                return f"input '{value.name}' is float: the op stays between float values"
        return ""
