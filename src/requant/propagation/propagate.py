"""Propagate: resolve fixed, shared and derived requests into types, after calibration.

In a fixed order that does not depend on which node or quantizer came first: fixed requests,
then shared ones (each follows its chain to a value with a type), then the target's same-scale
constraints (its table's ``same_scale``, :mod:`requant.targets.constraints`: where an op that must
read and write one type got two, a rescale goes before it, or the runtime's float op is recorded),
then the target's constraint on
int8 kernels' weights (:mod:`requant.encoding.weight_encoding`: no int16 pair may saturate),
then derived ones (a bias:
scale = input scale x weight scale, per channel when the weight is, int32, zero point 0). A bias
whose quantized value would not leave room in int32 for the kernel's accumulation (tiny weight
scales: BN-folded dead channels) raises that channel's weight scale just enough, and says so.
The room is ``K * max|input - zero point| * max|weight|`` for a reduction over ``K`` products:
ONNX Runtime's int8 kernels add the bias to an int32 accumulator, which wraps around (a bias of
-2^31 + 10 plus a negative sum becomes a large positive output: measured on EfficientNet-Lite0's
stem, whose two dead channels then output 6.0 instead of 0). A bias whose input is kept float
(a ``NoQuant`` request, from a ``None`` config) stays float too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.calibration.observers import CalibrationError
from requant.encoding.weight_encoding import EncodingMemo, WeightEncoding, encode_weights, rescale_stored
from requant.ir.annotations import element_name, quant_type, request, set_parameter_type, set_quant_type, set_request
from requant.ir.provenance import RESCALE_KEY
from requant.ir.queries import DEFAULT_DOMAINS, fresh_name, graph_values
from requant.ir.requests import DerivedSpec, FixedSpec, NoQuant, QuantizationSpec, SharedSpec
from requant.ir.traits import data_inputs
from requant.quantizers.pattern_quantizer import KEPT_FLOAT_KEY
from requant.targets.constraints import MIN_STEPS, RUNTIME_FLOAT, Join, SameScale
from requant.targets.kernels import KernelModel, softmax_length
from requant.types import (
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedType,
    UniformType,
    from_range,
    with_scales,
)

__all__ = ["Propagated", "Propagation", "propagate"]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Propagated:
    """A type given by propagation, and why."""

    value: str
    type: QuantizedType | str  # the type ("float" when kept float), printed when the report is written
    why: str
    meets: str = ""  # the node where two constraints met on this value, if any
    how: str = ""  # what the target does there: "rescale" (before the op) or "float" (the runtime's op)
    # a join whose inputs cannot share its type: the join node, what the target does, each input's steps
    join: tuple[str, str, dict[str, float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"value": self.value, "type": str(self.type), "why": self.why}
        if self.join is not None:
            found["join"] = {"node": self.join[0], "how": self.join[1], "steps": self.join[2]}
        return found | ({"node": self.meets, "how": self.how} if self.meets else {})


def _bias_limit(types: list[UniformType], weight: ir.Value | None, channels: int) -> float:
    """The largest |quantized bias| that leaves the int32 accumulator room for the kernel's products."""
    if len(types) < 2 or weight is None or weight.const_value is None:
        return float(_INT32_MAX)
    x, w = types[0], types[-1]
    reduction = max(weight.const_value.size // max(channels, 1), 1)
    per_product = (x.storage_max - x.storage_min) * max(abs(w.storage_min), abs(w.storage_max))
    return float(max(_INT32_MAX - reduction * per_product, _INT32_MAX // 2))


def _scales(t: UniformType) -> np.ndarray:
    if isinstance(t, UniformQuantizedType):
        return np.array([t.scale])
    if isinstance(t, UniformQuantizedPerAxisType):
        return np.array(t.scales)
    raise CalibrationError(f"a bias can be derived from per-tensor or per-axis types, not {t}")


@dataclass(frozen=True)
class Propagation:
    """What propagation did: the types it gave (``notes``), and the weight encodings it chose."""

    notes: list[Propagated]
    encodings: list[WeightEncoding]


def _softmax_within_float(graph: ir.Graph, limit: float) -> list[Propagated]:
    """Raise a fused int8 Softmax's output scale to ``1 / floor(limit D)`` where it is finer (``D``
    values along its axis; ``KernelModel.softmax_overflow``): finer, the kernel's float product
    overflows and the row's largest probabilities come out as the zero point. A Softmax whose axis
    length is not static is left as it is."""
    notes = []
    for node in graph:
        x, y = node.inputs[0] if node.op_type == "Softmax" else None, node.outputs[0]
        t = quant_type(y)
        if x is None or not isinstance(quant_type(x), UniformQuantizedType) or not isinstance(t, UniformQuantizedType):
            continue  # not both per tensor: not a QLinearSoftmax
        dims = [d if isinstance(d, int) else None for d in x.shape] if x.shape is not None else []
        axis = node.attributes.get("axis")
        count = softmax_length(dims, axis.as_int() if axis is not None else None, graph.opset_imports.get("", 13))
        if count is None:
            continue
        top = math.floor(limit * count)
        if t.scale >= 1.0 / top:
            continue
        raised = with_scales(t, [1.0 / top])
        set_quant_type(y, raised)
        notes.append(
            Propagated(
                str(y.name),
                raised,
                f"scale raised from {t.scale:.6g} to 1/{top}: ONNX Runtime's QLinearSoftmax multiplies its largest "
                f"exp by floor(1 / scale) in float32, which overflows beyond {limit:g} x its {count} values (the "
                "row's largest probabilities came out as 0)",
            )
        )
    return notes


def _alike(a: UniformQuantizedType, b: UniformQuantizedType) -> bool:
    """One type for an integer op (the lowering's tolerance on a scale stored as float32)."""
    same = (a.storage, a.zero_point) == (b.storage, b.zero_point)
    return same and math.isclose(a.scale, b.scale, rel_tol=1e-6)


def _rescale_before(
    graph: ir.Graph, node: ir.Node, index: int, to: UniformQuantizedType, why: str, taken: set[str | None]
) -> ir.Value:
    """An ``Identity`` before ``node``'s input ``index`` whose output has the type ``to``: a rescale
    (``RESCALE_KEY`` on it says why). Returns its output, which ``node`` now reads. ``taken``: the
    graph's names (values and nodes), which the new ones join."""
    x = node.inputs[index]
    assert x is not None
    name = node.name or node.op_type
    out = ir.Value(name=fresh_name(f"{name}_input_{index}_rescaled", taken), shape=x.shape, type=x.type)
    rescale = ir.Node("", "Identity", [x], outputs=[out], name=fresh_name(f"{name}_rescale_{index}", taken))
    rescale.metadata_props[RESCALE_KEY] = why
    graph.insert_before(node, rescale)
    node.replace_input_with(index, out)
    set_quant_type(out, to)
    set_request(out, SharedSpec(str(node.outputs[0].name)))
    return out


def _where_types_meet(graph: ir.Graph, same_scale: Mapping[str, SameScale]) -> list[Propagated]:
    """Each op bound to one type (``same_scale``) whose data input and output got different ones:
    where the target rescales, a rescale before the op brings the input to the output's type (the
    output's: what the op's readers were calibrated or configured for); where its runtime computes
    the op in float between conversions, that is recorded."""
    notes = []
    taken: set[str | None] = {v.name for v in graph_values(graph)} | {n.name for n in graph}
    for node in list(graph):
        rule = same_scale.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        t = quant_type(node.outputs[0]) if rule is not None and rule.binds(node) and node.outputs else None
        if not isinstance(t, UniformQuantizedType):
            continue
        assert rule is not None
        name = node.name or node.op_type
        for index in data_inputs(node):
            x = node.inputs[index]
            s = quant_type(x) if x is not None else None
            if x is None or not isinstance(s, UniformQuantizedType) or _alike(s, t):
                continue
            met = f"{node.op_type} '{name}' reads '{x.name}' as {s} and writes {t}: {rule.why}"
            if rule.meet == RUNTIME_FLOAT:
                notes.append(Propagated(str(x.name), t, met, name, rule.meet))
                continue
            why = f"{node.op_type} '{name}': input '{x.name}' rescaled to the output's type ({rule.why})"
            rescaled = _rescale_before(graph, node, index, t, why, taken)
            notes.append(Propagated(str(rescaled.name), t, f"{met}; a rescale before it", name, rule.meet))
    return notes


def propagate(
    model: ir.Model,
    kernels: KernelModel | None = None,
    memo: EncodingMemo | None = None,
    same_scale: Mapping[str, SameScale] | None = None,
    joins: Mapping[str, Join] | None = None,
) -> Propagation:
    """Give every value with a fixed, shared or derived request its type; returns what was done.

    With a target's ``same_scale`` constraints (its table's), the ops they bind are checked once the
    shared types are known (:func:`_where_types_meet`). With a target's ``kernels`` model, the
    weights of its int8 kernels are checked (and where they could saturate, re-encoded) before the
    biases are derived from their scales (``memo``: see
    :func:`~requant.encoding.weight_encoding.encode_weights`).
    """
    graph = model.graph
    values = graph_values(graph)
    by_name = {str(v.name): v for v in values if v.name}
    notes = _fixed(values)
    if kernels is not None and kernels.softmax_overflow is not None:
        notes += _softmax_within_float(graph, kernels.softmax_overflow)
    notes += _widened(graph, by_name)
    notes += _shared(values, by_name)
    if joins:
        notes += _joins(graph, values, by_name, joins)
    if same_scale:
        notes += _where_types_meet(graph, same_scale)
    encodings = encode_weights(model, kernels, memo) if kernels is not None else []
    for value in values:
        r = request(value)
        if isinstance(r, DerivedSpec):
            notes += _derived(value, r, by_name)
    return Propagation(notes, encodings)


def _fixed(values: list[ir.Value]) -> list[Propagated]:
    """Each value with a fixed request typed with its parameters."""
    notes = []
    for value in values:
        r = request(value)
        if isinstance(r, FixedSpec):
            fixed = r.quant_type(element_name(value.dtype) or "f32")
            set_quant_type(value, fixed)
            notes.append(Propagated(str(value.name), fixed, "fixed parameters"))
    return notes


def _root(value: ir.Value, by_name: Mapping[str, ir.Value]) -> ir.Value:
    """The value a chain of shared requests from ``value`` ends at."""
    seen = {str(value.name)}
    current = value
    while True:
        r = request(current)
        if not isinstance(r, SharedSpec):
            return current
        if r.other in seen:
            raise CalibrationError(f"shared requests form a cycle through {sorted(seen)}")
        seen.add(r.other)
        nxt = by_name.get(r.other)
        if nxt is None:
            raise CalibrationError(f"value '{current.name}' shares '{r.other}', which does not exist")
        current = nxt


def _shares(value: ir.Value, other: ir.Value, by_name: Mapping[str, ir.Value]) -> bool:
    """Whether ``value``'s chain of shared requests passes through ``other`` (the Slices after a join
    share the join's output, which may itself share its first input)."""
    current: ir.Value | None = value
    seen: set[str] = set()
    while current is not None and isinstance(r := request(current), SharedSpec) and r.other not in seen:
        seen.add(r.other)
        current = by_name.get(r.other)
        if current is other:
            return True
    return False


def _shared(values: list[ir.Value], by_name: Mapping[str, ir.Value]) -> list[Propagated]:
    """Each value with a shared request typed as the value it shares (through chains of them)."""
    notes = []
    for value in values:
        if isinstance(request(value), SharedSpec):
            source = _root(value, by_name)
            shared = quant_type(source)
            if shared is None:
                raise CalibrationError(f"value '{value.name}' shares '{source.name}', which got no type")
            set_quant_type(value, shared)
            notes.append(Propagated(str(value.name), shared, f"shared with '{source.name}'"))
    return notes


WIDENED = ("Concat", "Max", "Min")  # data movement of several inputs: the output shares its first input's type
_DTYPES = {"i8": "int8", "u8": "uint8", "i16": "int16", "u16": "uint16"}


def _widened(graph: ir.Graph, by_name: Mapping[str, ir.Value]) -> list[Propagated]:
    """A Concat (Max, Min) whose output shares its first input's type, where another input reaches past that
    type's range by more than a step: the output gets a type of its own over every input's range (the shared
    quantizer's choice of the first input's type, made before ranges are known, clipped the others:
    TransNetV2's join of 0-2.4 colour histograms with 0-15 convolution features at 2.78, 11.5 dB)."""
    notes = []
    for node in graph:
        if node.op_type not in WIDENED or node.domain not in DEFAULT_DOMAINS or not node.outputs:
            continue
        out, first = node.outputs[0], node.inputs[0]
        r = request(out)
        if first is None or not isinstance(r, SharedSpec) or r.other != first.name:
            continue
        root = _root(first, by_name)
        types = [quant_type(_root(x, by_name)) for x in node.inputs if x is not None]
        t, spec = quant_type(root), request(root)
        if not isinstance(t, UniformQuantizedType) or t.storage not in _DTYPES:
            continue
        ranges = [u.float_range for u in types if isinstance(u, UniformQuantizedType)]
        if len(ranges) != len(types):
            continue
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        own_lo, own_hi = t.float_range
        if lo >= own_lo - t.scale and hi <= own_hi + t.scale:
            continue
        widened = from_range(lo, hi, t.storage, t.expressed, symmetric=t.zero_point == 0 and t.storage_min < 0)
        set_request(out, spec if isinstance(spec, QuantizationSpec) else QuantizationSpec(_DTYPES[t.storage]))
        set_quant_type(out, widened)
        name = str(node.name or node.op_type)
        notes.append(Propagated(str(out.name), widened, f"{node.op_type} '{name}': its inputs reach "
                                f"[{lo:.4g}, {hi:.4g}], past its first input's type ({own_lo:.4g} to {own_hi:.4g}): "
                                "the output gets its own type over all of them"))  # fmt: skip
    return notes


def _steps(t: UniformQuantizedType, within: UniformQuantizedType) -> float:
    """How many steps of ``within`` the whole range of ``t`` spans."""
    return round((t.storage_max - t.storage_min) * t.scale / within.scale, 2)


def _joins(
    graph: ir.Graph, values: list[ir.Value], by_name: Mapping[str, ir.Value], joins: Mapping[str, Join]
) -> list[Propagated]:
    """Each join of the target's (a Concat) with an input spanning fewer than ``MIN_STEPS`` steps of its
    output's type: what the input says would be lost there (a detector's probabilities beside pixel
    coordinates: under one step). Where the target computes the join in float, its output and the
    values sharing its type lose their types: the join runs in float between its inputs' conversions,
    each input keeping its own type (the node is marked kept float, with why, for lint). Recorded
    either way, with each input's steps."""
    notes = []
    for node in graph:
        rule = joins.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        out = node.outputs[0] if rule is not None and node.outputs else None
        t = quant_type(out) if out is not None else None
        if rule is None or out is None or not isinstance(t, UniformQuantizedType):
            continue
        steps = {str(x.name): _steps(s, t) for x in node.inputs
                 if x is not None and isinstance(s := quant_type(x), UniformQuantizedType)}  # fmt: skip
        if not steps or min(steps.values()) >= MIN_STEPS:
            continue
        worst = min(steps, key=lambda name: steps[name])
        name = str(node.name or node.op_type)
        why = (f"{node.op_type} '{name}' joins inputs that cannot share one int8 type: '{worst}' spans "
               f"{steps[worst]:g} steps of its output's type (fewer than {MIN_STEPS}); {rule.why}")  # fmt: skip
        kept = rule.meet == RUNTIME_FLOAT
        notes.append(Propagated(str(out.name), "float" if kept else t, why, join=(name, rule.meet, steps)))
        if kept:
            sharing = [v for v in values if isinstance(request(v), SharedSpec) and _shares(v, out, by_name)]
            for value in (out, *sharing):
                set_quant_type(value, None)
                set_request(value, NoQuant())
            node.metadata_props[KEPT_FLOAT_KEY] = why
    return notes


def _derived(value: ir.Value, r: DerivedSpec, by_name: Mapping[str, ir.Value]) -> list[Propagated]:
    """A bias typed with the product of its sources' scales (its weight's raised where the bias would
    not fit int32), or kept float with an input kept float."""
    sources = [by_name.get(s) for s in r.sources]
    found = [quant_type(s) if s is not None else None for s in sources]
    types = [t for t in found if isinstance(t, UniformType)]
    if len(types) != len(found):
        missing = [name for name, t in zip(r.sources, found, strict=True) if not isinstance(t, UniformType)]
        kept_float = [s for s in sources if s is not None and isinstance(request(s), NoQuant)]
        if kept_float:  # another quantizer (or the user) keeps the input float: so is the bias
            names = ", ".join(f"'{s.name}'" for s in kept_float)
            return [Propagated(str(value.name), "float", f"kept float: {names} is kept float")]
        raise CalibrationError(f"bias '{value.name}' is derived from {missing}, which got no uniform type")
    scale = np.ones(1)
    for t in types:
        scale = scale * _scales(t)
    notes: list[Propagated] = []
    data = value.const_value.numpy().astype(np.float64).reshape(-1) if value.const_value is not None else None
    if data is not None:
        scale = _room_for_bias(value, data, scale, r.sources[-1], sources[-1], types, notes)
    expressed = element_name(value.dtype) or "f32"
    if expressed == "f32":  # the model stores f32 scales; the bias is quantized with exactly those
        scale = scale.astype(np.float32).astype(np.float64)
    storage = {"int32": "i32", "int16": "i16", "int8": "i8"}.get(r.dtype, "i32")
    derived: UniformType
    if scale.size == 1:
        derived = UniformQuantizedType(storage, expressed, float(scale[0]))
    else:
        derived = UniformQuantizedPerAxisType(storage, expressed, 0, [float(s) for s in scale])
    set_parameter_type(value, derived)
    return [*notes, Propagated(str(value.name), derived, f"product of the scales of {', '.join(r.sources)}")]


def _room_for_bias(
    value: ir.Value,
    data: np.ndarray,
    scale: np.ndarray,
    weight_name: str,
    weight: ir.Value | None,
    types: list[UniformType],
    notes: list[Propagated],
) -> np.ndarray:
    """The bias's scale per channel, its weight's scale raised (and noted) where the bias would not fit
    int32 with room for the accumulation."""
    if scale.size not in (1, data.size) and data.size % scale.size == 0:
        # a grouped ConvTranspose: its weight's axis 1 holds the output channels of one group, the
        # bias those of all (output channel c reads scale c mod the group's channels)
        scale = np.tile(scale, data.size // scale.size)
    scale = np.broadcast_to(scale, data.shape).copy() if scale.size == 1 else scale
    needed = np.abs(data) / _bias_limit(types, weight, data.size)
    tight = scale < needed
    if not tight.any():
        return scale
    assert weight is not None  # it has a uniform type, so it was found
    wtype = types[-1]
    factor = np.where(tight, needed / scale * (1 + 1e-6), 1.0)
    new_scales = _scales(wtype) * (factor if factor.size == _scales(wtype).size else factor.max())
    adjusted = with_scales(wtype, new_scales)
    set_parameter_type(weight, adjusted)
    rescale_stored(weight, wtype, adjusted)
    why = f"weight scale raised so bias '{value.name}' fits int32 with room for the accumulation"
    notes.append(Propagated(weight_name, adjusted, why))
    return scale * factor
