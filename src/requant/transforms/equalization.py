"""Equalization: even out the channels of a depthwise convolution's input.

In a MobileNet block, a convolution expands the channels, a ReLU6 clips them, and a depthwise
convolution filters each channel alone. The depthwise input is quantized with one scale for the
whole tensor, set by its largest channel, while most channels stay far smaller (MobileNetV2: the
largest channel maximum is 2-22x the median one) and keep a few levels. For a positive ``s_c`` per
channel,

    conv'(x)[c] = s_c conv(x)[c]    (its weight's and bias' rows times s_c)
    depthwise'(y)[c] = depthwise(y / s_c)[c]    (its channel-c weights divided by s_c)

compute the same, through a ReLU (``relu(s y) = s relu(y)``), a LeakyReLU or no activation at all.
Both weights are quantized per output channel, which absorbs the factors exactly (a depthwise
conv's channels are its output channels). With

    s_c = clip(max_y / (HEADROOM max_c), 1, MAX_SCALE)

(``max_c`` the channel's largest magnitude on the first calibration samples, ``max_y`` the tensor's),
every small channel reaches ``1 / HEADROOM`` of the tensor's range. (Nagel et al., "Data-Free
Quantization Through Weight Equalization and Bias Correction", 2019, equalize the two layers'
*weights*; here the activation's channels are evened, as the depthwise weights are per-channel.)

A clip with an upper bound (ReLU6: ``Clip(y, 0, 6)``) is not scale-free: after scaling, channel c is
cut at ``6 / s_c`` of its old values, at least ``HEADROOM`` times its calibrated maximum (``max_y <=
6``). The float model computes the same but where a channel exceeds that (EfficientNet-Lite0, whose
channels reach 6: 2 of 2,000 held-out crops change their top class, KL 1e-5); the quantized tensor's
range cuts it there anyway. Without the headroom (``s_c = max_y / max_c``) the cut fell at the
calibrated maximum itself and cost EfficientNet-Lite0 what it gained (figures at ``HEADROOM``).

A model with more linear layers than convolutions is left alone, as is a chain whose values have
other readers or whose weights are shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.observers import MinMaxObserver, Observer
from requant.calibration.runner import Kept, Progress, collect
from requant.calibration.samples import first_samples
from requant.ir.annotations import request
from requant.ir.provenance import set_channel_factors
from requant.ir.queries import clamp_bounds, constant, fresh_name, graph_values, is_op, weighted_layers
from requant.ir.requests import QuantizationSpec
from requant.targets.kernels import is_depthwise
from requant.transforms.smoothing import FLOATS, channel_spread

__all__ = [
    "MAX_SCALE",
    "Equalization",
    "Equalized",
    "channel_factors",
    "depthwise_pairs",
    "equalize_depthwise",
    "unless_per_channel",
]

MAX_SCALE = 8.0  # a channel is scaled up at most this much (a dead or nearly dead one gains nothing)
SAMPLES = 64  # the first calibration samples the channels' maxima are measured on (fewer for large inputs)
# the factor between a scaled channel's calibrated maximum and the tensor's: its values may grow this much
# beyond what calibration saw before the tensor's range (and ReLU6's bound) cuts them. Measured on the
# bench's 2,000 held-out crops (top-1 agreement / KL against float): MobileNetV2 0.901 / 0.035 without
# equalization, 0.918 / 0.022 at 1, 0.924 / 0.024 at 1.5, 0.925 / 0.024 at 2, 0.908 / 0.029 at 3;
# EfficientNet-Lite0 0.933 / 0.0079 without, 0.936 / 0.0084 at 1 (its float model itself moved: KL 0.0007,
# its channels reach ReLU6's bound), 0.942 / 0.0079 at 2.
HEADROOM = 2.0


@dataclass(frozen=True)
class Equalized:
    """One convolution -> activation -> depthwise convolution chain: what was done, or why not.

    ``spread_before`` / ``spread_after``: the tensor's largest channel maximum over its median one
    (1.0 is even); ``scaled``: the channels scaled up."""

    conv: str
    activation: str | None
    depthwise: str
    input: str
    channels: int = 0
    scaled: int = 0
    largest_factor: float = 1.0
    spread_before: float = 0.0
    spread_after: float = 0.0
    skipped: str | None = None


@dataclass(frozen=True)
class Equalization:
    """What equalization did: a record per chain, or why the model was not equalized (``not_applied``)."""

    chains: list[Equalized]
    not_applied: str | None = None
    originals: dict[str, list[tuple[ir.Value, ir.TensorProtocol]]] = dataclasses.field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class _Chain:
    conv: ir.Node
    activation: ir.Node | None
    depthwise: ir.Node
    input: ir.Value  # the depthwise conv's input


def _float_weight(node: ir.Node) -> npt.NDArray[Any] | None:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    data = constant(weight)
    if weight is None or data is None or not weight.is_initializer() or weight.dtype not in FLOATS:
        return None
    if any(u.node is not node for u in weight.uses()):  # shared with another node: not this chain's alone
        return None
    return data


def _is_depthwise(node: ir.Node) -> bool:
    """A Conv with one input and one output channel per group (weight ``[C, 1, kh, kw]``, group C) of
    its own float weight."""
    weight = _float_weight(node) if is_op(node, "Conv") else None
    return weight is not None and is_depthwise(weight.shape, node.attributes.get_int("group", 1))


def _scale_free(node: ir.Node) -> bool:
    """An activation through which scaling each channel up passes: ``f(s y) = s f(y)`` for ``s > 0``
    (LeakyRelu, Relu), or a clip from 0 (ReLU6's ``Clip(y, 0, 6)``: scaled channels keep 0 as their
    floor, and its upper bound cuts each at ``HEADROOM`` times its calibrated maximum or beyond)."""
    bounds = clamp_bounds(node)
    return is_op(node, "LeakyRelu") or (bounds is not None and bounds[0] == 0.0)


def _only_read_by(value: ir.Value, node: ir.Node) -> bool:
    return not value.is_graph_output() and all(u.node is node for u in value.uses())


def depthwise_pairs(graph: ir.Graph) -> list[_Chain]:
    """Every ``Conv -> [Relu | LeakyRelu | Clip(0, m)] -> depthwise Conv`` chain, in graph order, where
    each value is read by the next node alone and both weights are float initializers of their own."""
    chains = []
    for node in graph:
        if not _is_depthwise(node) or node.inputs[0] is None:
            continue
        x = node.inputs[0]
        activation = x.producer()
        if activation is None or not _only_read_by(x, node):
            continue
        if _scale_free(activation):
            before = activation.inputs[0]
            if before is None or not _only_read_by(before, activation):
                continue
            conv = before.producer()
        else:
            conv, activation = activation, None
        if conv is None or not is_op(conv, "Conv"):
            continue
        weight = _float_weight(conv)
        if weight is None or weight.shape[0] != constant(node.inputs[1]).shape[0]:  # type: ignore[union-attr]
            continue
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        if bias is not None and (constant(bias) is None or not bias.is_initializer() or len(bias.uses()) != 1):
            continue
        chains.append(_Chain(conv, activation, node, x))
    return chains


def _probe(model: ir.Model, chains: list[_Chain]) -> tuple[ir.Model, dict[str, str]]:
    """A copy of ``model`` that also outputs each chain input's channel maxima of magnitude, ``[N, C, 1,
    1]`` (``GlobalMaxPool``, of ``Abs`` unless a ReLU or a clip from 0 made the values non-negative),
    and the names of those outputs by input: ONNX Runtime reduces each tensor as it makes it, where
    fetching the tensors and reducing them in NumPy took twice as long (EfficientNet-Lite0: 13 MB a
    sample)."""
    probe = model.clone()  # its tensors shared: only nodes are added
    values = {str(v.name): v for v in graph_values(probe.graph)}
    taken: set[str | None] = {*values, *(n.name for n in probe.graph)}
    pooled = {}
    for chain in chains:
        x = values[str(chain.input.name)]
        if chain.activation is None or clamp_bounds(chain.activation) is None:  # not from 0 up: magnitudes
            magnitude = ir.node("Abs", [x])
            magnitude.outputs[0].name = fresh_name(f"{x.name}_magnitude", taken)
            probe.graph.append(magnitude)
            x = magnitude.outputs[0]
        pool = ir.node("GlobalMaxPool", [x])
        pool.outputs[0].name = fresh_name(f"{chain.input.name}_channel_maxima", taken)
        probe.graph.append(pool)
        pooled[str(chain.input.name)] = str(pool.outputs[0].name)
    return probe, pooled


def equalize_depthwise(
    model: ir.Model,
    data: Any,
    progress: Progress | None = None,
    ranges: dict[str, MinMaxObserver] | None = None,
    max_scale: float = MAX_SCALE,
    outputs: Kept | None = None,
) -> Equalization:
    """Equalize every depthwise conv's input in ``model`` (float, changed in place) over ``data``, when
    it has more convolutions than linear layers (a transformer has no depthwise convs to gain from).

    ``ranges``: per-channel ranges of earlier runs by value name (reused, and filled with new ones).
    ``outputs``: keeps the model's first output on the samples the channels are measured on, when
    they are measured (the float model's, before equalization changes it in its last digits).
    """
    graph = model.graph
    linear, convs = weighted_layers(graph)
    if convs <= linear:
        return Equalization([], f"not a convolutional model ({convs} convolutions, {linear} linear layers)")
    chains = depthwise_pairs(graph)
    if not chains:
        return Equalization([], "no convolution -> activation -> depthwise convolution chain")
    ranges = {} if ranges is None else ranges
    key = {id(c): f"{c.input.name}@channels" for c in chains}
    fresh = {key[id(c)]: MinMaxObserver(axis=1) for c in chains if key[id(c)] not in ranges}
    if fresh:
        probe, pooled = _probe(model, [c for c in chains if key[id(c)] in fresh])
        samples = first_samples(model, data, SAMPLES)
        by_output: dict[str, Observer] = {
            pooled[str(c.input.name)]: fresh[key[id(c)]] for c in chains if key[id(c)] in fresh
        }
        if outputs is not None and not outputs.arrays and graph.outputs:
            by_output[str(graph.outputs[0].name)] = outputs
        # maxima: the last digits (ONNX Runtime's NCHWc convs add in another order) do not matter
        collect(probe, samples, by_output, progress, optimize=True, stack=False)
        ranges.update(fresh)
    records = []
    originals: dict[str, list[tuple[ir.Value, ir.TensorProtocol]]] = {}
    for chain in chains:
        activation = str(chain.activation.name) if chain.activation is not None else None
        names = (str(chain.conv.name), activation, str(chain.depthwise.name))
        observer = ranges[key[id(chain)]]
        weight = constant(chain.conv.inputs[1])
        assert weight is not None  # depthwise_pairs checked
        if observer.lo is None or observer.hi is None or np.size(observer.hi) != weight.shape[0]:
            why = "no finite value was observed" if observer.hi is None else "its channel axis is not axis 1"
            records.append(Equalized(*names, str(chain.input.name), skipped=why))
            continue
        maxima = np.fmax(np.abs(observer.lo), np.abs(observer.hi)).astype(np.float64)
        maxima = np.where(np.isfinite(maxima), maxima, 0.0)
        s = channel_factors(maxima, max_scale)
        if not (s > 1).any():
            why = f"no channel's maximum is below 1/{HEADROOM:g} of the largest"
            records.append(Equalized(*names, str(chain.input.name), int(maxima.size), 0, 1.0, channel_spread(maxima),
                                     channel_spread(maxima), why))  # fmt: skip
            continue
        scaled = [(v, f) for v, f in zip(chain.conv.inputs[1:3], (s, s), strict=False) if v is not None]
        assert chain.depthwise.inputs[1] is not None  # depthwise_pairs checked
        scaled.append((chain.depthwise.inputs[1], 1.0 / s))
        originals[str(chain.depthwise.name)] = [(v, v.const_value) for v, _ in scaled]  # type: ignore[misc]
        for value, factors in scaled:
            _scale_rows(value, factors)
        for value in _scaled_values(chain):
            set_channel_factors(value, s)  # requant compare divides them out
        records.append(Equalized(*names, str(chain.input.name), int(maxima.size), int((s > 1).sum()), float(s.max()),
                                 channel_spread(maxima), channel_spread(maxima * s)))  # fmt: skip
    return Equalization(records, None, originals)


def channel_factors(maxima: npt.NDArray[np.float64], max_scale: float = MAX_SCALE) -> npt.NDArray[np.float64]:
    """Each channel's factor from its largest magnitude (``maxima``, finite, >= 0): the small channels
    raised to ``1 / HEADROOM`` of the largest, at most ``max_scale`` times; 1 for the others."""
    top = float(maxima.max()) if maxima.size else 0.0
    s = np.ones_like(maxima)
    live = maxima > 0
    if top > 0:
        s[live] = np.clip(top / (HEADROOM * maxima[live]), 1.0, max_scale)
    return s


def unless_per_channel(equalization: Equalization) -> Equalization:
    """``equalization`` with the chains whose weights were annotated per tensor undone (their weights
    restored): a per-tensor weight does not absorb factors per row. Weights left float are fine."""
    records = []
    for record in equalization.chains:
        kept = equalization.originals.get(record.depthwise)
        per_tensor = [str(v.name) for v, _ in (kept or [])[:1] + (kept or [])[-1:] if _per_tensor(v)]
        if kept is None or not per_tensor:
            records.append(record)
            continue
        for value, tensor in kept:
            value.const_value = tensor
        conv, depthwise = (next(iter(kept[i][0].uses())).node for i in (0, -1))  # their weights' one reader
        for scaled in (conv.outputs[0], depthwise.inputs[0]):
            if scaled is not None:
                set_channel_factors(scaled, None)
        why = f"weight '{per_tensor[0]}' is quantized per tensor: it cannot absorb a factor per channel"
        records.append(dataclasses.replace(record, scaled=0, largest_factor=1.0, spread_after=record.spread_before,
                                           skipped=why))  # fmt: skip
    return Equalization(records, equalization.not_applied)


def _scaled_values(chain: _Chain) -> list[ir.Value]:
    """The values whose channels equalization scales: the convolution's output, and the activation's."""
    return [chain.conv.outputs[0], *([chain.activation.outputs[0]] if chain.activation is not None else [])]


def _per_tensor(weight: ir.Value) -> bool:
    asked = request(weight)
    return isinstance(asked, QuantizationSpec) and not (asked.granularity == "per_axis" and asked.axis == 0)


def _scale_rows(value: ir.Value | None, factors: npt.NDArray[np.float64]) -> None:
    """Multiply row ``c`` (axis 0) of the float constant ``value`` by ``factors[c]``."""
    assert value is not None
    data = np.asarray(constant(value), np.float64)
    scaled = data * factors.reshape((-1,) + (1,) * (data.ndim - 1))
    value.const_value = ir.Tensor(scaled.astype(np.float32), name=value.name)
