"""The pattern quantizer: requests on the ports of the patterns a node finder selects.

For each match it asks the target's check; if accepted, the pattern's ports get the config's
requests: activation inputs (from outside the pattern), weights (with the per-channel axis of
the op), biases (derived from the actual input and weight), and the last node's outputs. Values
inside the pattern get nothing: quantization is decided at kernel boundaries only. A request
already on a port is never overwritten; a pattern with a node another quantizer annotated is
rejected as already annotated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import onnx_ir as ir

from requant.ir.annotations import request, set_request
from requant.ir.queries import constant
from requant.ir.requests import DerivedSpec, NoQuant, QuantizationSpec, Request
from requant.ir.traits import DATA_MOVEMENT, WEIGHTED, data_inputs, weight_channel_axis, weight_inputs
from requant.quantizers.config import DerivedBias, QuantizationConfig
from requant.quantizers.finders import Global, NodeFinder
from requant.quantizers.matcher import PatternMatcher
from requant.quantizers.records import NodeDecision, QuantizerRecord
from requant.targets.table import Match, Reject, SupportTable

__all__ = ["ANNOTATED_KEY", "KEPT_FLOAT_KEY", "PatternQuantizer", "QuantizeState", "asks_for_int8"]

ANNOTATED_KEY = "requant.annotated_by"
# on the nodes of a pattern the target rejected: why they stay float (lint tells these apart from
# ops left float between a dequantize and a quantize by accident)
KEPT_FLOAT_KEY = "requant.kept_float"
# marks the ops of a pattern after its kernel when the kernel's output stays float (a bias Add after
# MatMulIntegerToFloat): they compute in float by design
_FLOAT_TAIL = " after a float output"
# marks the ops of a pattern whose config does not quantize (FLOAT, FLOAT_KERNEL)
_IN_FLOAT = " in float"


def asks_for_int8(annotated_by: str) -> bool:
    """Whether a node's ``ANNOTATED_KEY`` mark asks for it to run as (part of) an int8 kernel."""
    return annotated_by.startswith("PatternQuantizer(") and not annotated_by.endswith((_FLOAT_TAIL, _IN_FLOAT))


@dataclass
class QuantizeState:
    """What the quantizers of one run share: which nodes are annotated, and by whom."""

    annotated: dict[ir.Node, str] = dataclasses.field(default_factory=dict)
    # nodes the user's specific finders select (not the global one), and which quantizers select them:
    # a pattern does not run on into a node another of them claims
    claims: dict[ir.Node, set[str]] = dataclasses.field(default_factory=dict)

    def mark(self, node: ir.Node, by: str, in_float: bool = False) -> None:
        """``node`` is annotated by ``by`` (also recorded on the node, for the printer and later runs;
        there with ``_IN_FLOAT`` when its config does not quantize)."""
        self.annotated[node] = by
        node.metadata_props[ANNOTATED_KEY] = by + (_IN_FLOAT if in_float else "")
        node.metadata_props.pop(KEPT_FLOAT_KEY, None)

    def already(self, node: ir.Node) -> NodeDecision | None:
        """The decision to record when an earlier quantizer annotated ``node``, else None."""
        by = self.annotated.get(node)
        if by is None:
            return None
        return NodeDecision([node.name or node.op_type], node.op_type, "already annotated", f"annotated by {by}")


def _weight_request(node: ir.Node, spec: Request) -> Request:
    if isinstance(spec, QuantizationSpec) and spec.granularity == "per_axis":
        return dataclasses.replace(spec, axis=weight_channel_axis(node))
    if isinstance(spec, QuantizationSpec) and spec.granularity == "blockwise" and node.op_type == "Gemm":
        trans = node.attributes.get("transB")
        return dataclasses.replace(spec, axis=1 if trans is not None and trans.as_int() else 0)
    return spec


def port_requests(
    match: Match, config: QuantizationConfig, table: SupportTable | None = None, notes: list[str] | None = None
) -> tuple[dict[ir.Value, Request], list[ir.Value]]:
    """The requests the config puts on the match's ports, and its output ports.

    ``table``'s weight rule may adjust a weight's spec for its node; its notes go to ``notes``.
    """
    inside = {id(o) for n in match.nodes for o in n.outputs}
    requests: dict[ir.Value, Request] = {}
    activations: list[ir.Value] = []
    dynamic = match.pattern.dynamic  # the kernel quantizes its activations itself: weights only
    for node in match.nodes:
        weight_index, bias_index = WEIGHTED.get(node.op_type, (None, None))
        weights = weight_inputs(node.op_type)
        weight_value = (
            node.inputs[weight_index] if weight_index is not None and weight_index < len(node.inputs) else None
        )
        for i in data_inputs(node):
            value = node.inputs[i]
            if value is None or id(value) in inside:
                continue
            if i in weights and constant(value) is not None:
                if config.weight is not None:
                    wanted = _weight_request(node, config.weight)
                    if table is not None and table.weight_rule is not None and isinstance(wanted, QuantizationSpec):
                        wanted, note = table.weight_rule(node, value, wanted)
                        if note and notes is not None and note not in notes:
                            notes.append(note)
                    requests[value] = wanted
            elif i == bias_index and weight_value is not None:
                if isinstance(config.bias, DerivedBias):
                    source = node.inputs[0]
                    if source is not None and source.name and weight_value.name:
                        requests[value] = DerivedSpec((source.name, weight_value.name), dtype=config.bias.dtype)
                elif config.bias is not None:
                    requests[value] = config.bias
            elif node is not match.nodes[0] and constant(value) is not None:
                continue  # a constant after the kernel (a MatMul's bias Add) meets its float result: float
            elif not dynamic:
                activations.append(value)
                if config.input_activation is not None:
                    requests[value] = config.input_activation
    outputs = [o for o in match.nodes[-1].outputs if o.uses() or o.is_graph_output()]
    # a kernel with a float output (MatMulIntegerToFloat) asks nothing of it: a consumer may still
    # want it quantized (the next linear layer's input)
    if config.output_activation is not None and not config.float_output and not dynamic:
        for out in outputs:
            if isinstance(config.output_activation, QuantizationSpec) and _float_result(match, out, table):
                if notes is not None:
                    notes.append(FLOAT_RESULT)
                continue
            requests[out] = config.output_activation
    return requests, outputs


FLOAT_RESULT = (
    "its output is only the model's: computed in int8 with a float output (nothing reads it rounded to 8 bits; "
    "EfficientNet-Lite0's top-1 agreement 0.943 -> 0.953 with float logits)"
)


def _float_result(match: Match, out: ir.Value, table: SupportTable | None) -> bool:
    """A kernel (one op, or a linear layer's MatMul and bias Add) whose output only the model's caller reads,
    which the target computes in int8 with a float output (its table's ``float_results``)."""
    kernel = match.nodes[0]
    if table is None or table.float_results is None or not table.float_results(kernel):
        return False
    if len(match.nodes) > 1 and [n.op_type for n in match.nodes[1:]] != ["Add"]:
        return False
    return _only_the_models(out)


def _only_the_models(out: ir.Value) -> bool:
    """Whether only the model's caller reads ``out``: a graph output nothing reads, or a value read only by ops
    already annotated to compute in float (kept float by a name or by placement: TransNetV2's output Sigmoids)
    whose outputs are graph outputs nothing reads."""
    readers = [use.node for use in out.uses()]
    if not readers:
        return out.is_graph_output()
    return all(
        r.metadata_props.get(ANNOTATED_KEY, "").endswith(_IN_FLOAT)
        and all(o.is_graph_output() and not o.uses() for o in r.outputs)
        for r in readers
    )


@dataclass(frozen=True)
class PatternQuantizer:
    """Annotates the patterns ``pattern_matcher`` finds among the nodes ``node_finder`` selects."""

    config: QuantizationConfig
    node_finder: NodeFinder
    pattern_matcher: PatternMatcher

    def describe(self) -> str:
        return f"PatternQuantizer({self.node_finder!r}, {self.config})"

    def annotate(self, model: ir.Model, state: QuantizeState) -> QuantizerRecord:
        record = QuantizerRecord(
            "PatternQuantizer", repr(self.node_finder), str(self.config), str(self.pattern_matcher.table)
        )
        selected = self.node_finder.find(model)
        record.selected = len(selected)
        fresh = [n for n in selected if n not in state.annotated]
        record.decisions.extend(d for node in selected if (d := state.already(node)) is not None)
        # a pattern may run on into nodes no quantizer has annotated yet (a Conv chosen by name takes
        # its Relu along: the kernel is the unit), unless another specific finder selects them
        me = self.describe()
        followers = [n for n in model.graph if n not in state.annotated and state.claims.get(n, {me}) <= {me}]
        matches, unmatched = self.pattern_matcher.match(fresh, followers=followers)
        for node in unmatched:
            if node.op_type in DATA_MOVEMENT:  # the shared-spec quantizer's business, not a rejection,
                if self.config.quantizes or isinstance(self.node_finder, Global):
                    record.selected -= 1
                    continue
                # unless named to be kept float: then it is, and shares nothing
                state.mark(node, me, in_float=True)
                record.decisions.append(NodeDecision([node.name or node.op_type], node.op_type, "accepted"))
                continue
            reason = f"{node.op_type} is in no pattern of {self.pattern_matcher.table}"
            record.decisions.append(NodeDecision([node.name or node.op_type], node.op_type, "rejected", reason))
        for match in matches:
            names = [n.name or n.op_type for n in match.nodes]
            verdict = match.pattern.check(match, self.config)
            if isinstance(verdict, Reject):
                record.decisions.append(NodeDecision(names, match.pattern.name, "rejected", str(verdict)))
                for node in match.nodes:
                    if node not in state.annotated:
                        node.metadata_props[KEPT_FLOAT_KEY] = str(verdict)
                continue
            notes: list[str] = []
            requests, outputs = port_requests(match, self.config, self.pattern_matcher.table, notes)
            decision = NodeDecision(names, match.pattern.name, "accepted", "; ".join(notes))
            for value, wanted in requests.items():
                existing = request(value)
                if existing is None:
                    set_request(value, wanted)
                shown = str(wanted) if existing is None or existing == wanted else f"{existing} (kept; asked {wanted})"
                (decision.outputs if value in outputs else decision.inputs)[str(value.name)] = shown
            # the ops after the kernel compute in float whenever its output is float (also after a
            # weight-only kernel, whose inputs are float too)
            float_result = isinstance(self.config.output_activation, NoQuant)
            for i, node in enumerate(match.nodes):
                tail = _FLOAT_TAIL if float_result and i > 0 else ""
                state.mark(node, self.describe() + tail, in_float=not self.config.quantizes)
            # an int8 kernel whose output a consumer's config already asked to keep float cannot run
            # as one (no int8 kernel has a float output but the float-output kind): float by decision
            forced = [f"its output {o.name} is read in float" for o in outputs if isinstance(request(o), NoQuant)]
            forced += [
                f"its input {v.name} is float"
                for v, wanted in requests.items()
                if v not in outputs and isinstance(wanted, QuantizationSpec) and isinstance(request(v), NoQuant)
            ]
            if forced and self.config.quantizes and not float_result and not self.config.float_output:
                for node in match.nodes:
                    node.metadata_props[KEPT_FLOAT_KEY] = "; ".join(forced)
            record.decisions.append(decision)
        return record
