"""Equalization on an ATen graph: a depthwise convolution's small input channels scaled up against the
convolution before it, as :mod:`requant.transforms.equalization` does on ONNX (the factors are its
:func:`~requant.transforms.equalization.channel_factors`; the reasoning, ReLU6 included, is there).

A chain is ``conv2d -> [relu | hardtanh(0, m) | clamp(0, m)] -> conv2d`` with ``groups`` equal to its
channels in the *prepared* module (``prepare_pt2e`` folds batch norms into the convs: the exported
graph has ``conv2d -> batch_norm -> hardtanh``), each value read by the next node alone (its observer
between), each weight and bias a constant of its own. The first conv's weight rows and bias are
multiplied by ``s_c``, the depthwise conv's rows divided by it; both weights are observed per output
channel, which absorbs the factors exactly (a chain whose weight is quantized per tensor is left
alone). It runs before calibration: the observers have seen nothing yet. The channels' maxima are the
float model's on the first calibration samples, read in the pass that probes the join rule's ranges
(:func:`~requant.pt2e.quantizer.look_at_outputs`), by depthwise conv name (the names survive
``prepare_pt2e``; batch norm folding changes the values in their last digits).

The prepared module's parameters are replaced, not written into (they may be the float program's,
which every comparison reads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule, Node

from requant.pt2e.quantizer import aten_name
from requant.transforms.equalization import Equalized, channel_factors
from requant.transforms.smoothing import channel_spread

__all__ = [
    "FACTORS",
    "Chain",
    "channel_maxima",
    "constant",
    "depthwise_chains",
    "depthwise_inputs",
    "equalize",
    "per_channel_weight",
    "replace_constant",
    "unscaled",
]

# a prepared (and converted) module's meta: node name -> its channels' factors against float, shaped to divide its
# value by (equalization's on axis 1 of a conv's output; smoothing's on the last axis of a linear layer's input)
FACTORS = "requant.channel_factors"

_FROM_ZERO = ("hardtanh", "hardtanh_", "clamp")  # an activation through which scaling passes when its floor is 0


@dataclass(frozen=True)
class Chain:
    conv: Node
    activation: Node | None
    depthwise: Node
    weights: tuple[Node, Node]  # the two weights' constants (get_attr), behind their observers


def _observed(node: Any) -> Any:
    """What an observer node observes (``node`` itself when it is not an observer's call)."""
    return node.args[0] if isinstance(node, Node) and node.op == "call_module" and node.args else node


def per_channel_weight(module: GraphModule, conv: Node) -> Node | None:
    """The constant behind ``conv``'s weight, when it is read by ``conv`` alone through an observer per
    output channel (axis 0)."""
    observer, weight = conv.args[1], _observed(conv.args[1])
    if not isinstance(observer, Node) or observer.op != "call_module" or list(observer.users) != [conv]:
        return None
    axis = getattr(module.get_submodule(str(observer.target)), "ch_axis", None)
    ok = isinstance(weight, Node) and weight.op == "get_attr" and list(weight.users) == [observer] and axis == 0
    return weight if ok else None


def _scale_free(node: Node) -> bool:
    name = aten_name(node)
    if name in ("relu", "relu_", "relu6"):
        return True
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min", node.kwargs.get("min_val"))
    return name in _FROM_ZERO and isinstance(low, (int, float)) and low == 0


def _is_depthwise(node: Node) -> bool:
    weight = _observed(node.args[1]) if aten_name(node) == "conv2d" and len(node.args) >= 7 else None
    shape = tuple(weight.meta["val"].shape) if isinstance(weight, Node) and "val" in weight.meta else ()
    return len(shape) == 4 and shape[1] == 1 and node.args[6] == shape[0] and shape[0] > 1


def depthwise_inputs(module: GraphModule) -> dict[str, str]:
    """The float module's depthwise convs' inputs: conv name -> the name of the node it reads."""
    return {n.name: n.args[0].name for n in module.graph.nodes if _is_depthwise(n) and isinstance(n.args[0], Node)}


def _zero_padding(node: Node) -> bool:
    """``aten.pad(x, pads, "constant", 0)`` or ``constant_pad_nd(x, pads, 0)``."""
    name, rest = aten_name(node), list(node.args[2:])
    if name == "pad":
        return rest[:1] in ([], ["constant"]) and rest[1:2] in ([], [0], [0.0], [None])
    return name == "constant_pad_nd" and rest[:1] in ([], [0], [0.0])


def _source(depthwise: Node) -> tuple[Any, bool]:
    """What the depthwise conv reads through observers and zero padding (scaled zeros stay zeros;
    EfficientNet-Lite's "same" padding is an ``aten.pad`` before its strided depthwise convs), and whether
    each node on the way has one reader."""
    x, reader, single = depthwise.args[0], depthwise, True
    while isinstance(x, Node) and (x.op == "call_module" or _zero_padding(x)):
        single, reader, x = single and list(x.users) == [reader], x, x.args[0]
    return x, single and isinstance(x, Node) and list(x.users) == [reader]


def depthwise_chains(prepared: GraphModule) -> tuple[list[Chain], list[tuple[str, str]]]:
    """Every conv -> [activation from 0] -> [zero padding] -> depthwise conv chain of the prepared module
    (batch norms folded, observers between), in graph order; and the depthwise convs that are not one, and
    why."""
    chains, others = [], []
    for node in prepared.graph.nodes:
        if node.op != "call_function" or not _is_depthwise(node):
            continue
        x, single = _source(node)
        activation = x if single and x.op == "call_function" and _scale_free(x) else None
        conv = activation.args[0] if activation is not None else x
        weights = (per_channel_weight(prepared, conv), per_channel_weight(prepared, node)) if single else (None, None)
        bias = conv.args[2] if isinstance(conv, Node) and len(conv.args) > 2 else None
        if not single or not isinstance(conv, Node) or aten_name(conv) != "conv2d" or len(conv.users) != 1:
            others.append((node.name, "its input is not a convolution's (or its activation's) alone"))
        elif (conv.args[6] if len(conv.args) > 6 else 1) != 1 or None in weights:
            others.append((node.name, "a weight is shared, grouped or not quantized per output channel"))
        elif bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr" and len(bias.users) == 1):
            others.append((node.name, "the convolution's bias is not a constant of its own"))
        else:
            chains.append(Chain(conv, activation, node, weights))  # type: ignore[arg-type]
    return chains, others


def channel_maxima(inputs: dict[str, str]) -> tuple[dict[str, torch.Tensor], Callable[[Node, torch.Tensor], None]]:
    """The largest magnitude per channel of each depthwise conv's input (``inputs``: conv -> input name),
    by conv name, filled by the returned ``look`` (for :func:`~requant.pt2e.quantizer.look_at_outputs`)."""
    readers: dict[str, list[str]] = {}
    for conv, name in inputs.items():
        readers.setdefault(name, []).append(conv)
    maxima: dict[str, torch.Tensor] = {}

    def look(node: Node, out: torch.Tensor) -> None:
        for conv in readers.get(node.name, []) if out.dim() == 4 else []:
            m = out.abs().amax(dim=(0, 2, 3))
            maxima[conv] = torch.maximum(maxima[conv], m) if conv in maxima else m

    return maxima, look


def constant(module: GraphModule, target: str) -> Any:
    """The tensor a ``get_attr`` node of ``module`` reads."""
    return functools.reduce(getattr, target.split("."), module)


def replace_constant(module: GraphModule, target: str, new: torch.Tensor) -> None:
    """The constant ``target`` of ``module`` replaced by ``new`` (a parameter when it was one)."""
    *path, name = target.split(".")
    owner = constant(module, ".".join(path)) if path else module
    old = getattr(owner, name)
    setattr(owner, name, torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new)


def _scale(module: GraphModule, target: str, factors: torch.Tensor) -> None:
    """The constant ``target`` times ``factors`` along its first axis."""
    old = constant(module, target)
    replace_constant(module, target, old.detach() * factors.reshape((-1,) + (1,) * (old.dim() - 1)).to(old.dtype))


def unscaled(module: GraphModule, name: str, value: np.ndarray) -> np.ndarray:
    """``value``, the node ``name``'s output in ``module`` (prepared or converted), with the channel factors
    equalization or smoothing scaled it by divided out: what the float model computes there."""
    factors = module.meta.get(FACTORS, {}).get(name)
    return value if factors is None else value / factors


def equalize(prepared: GraphModule, chains: list[Chain], maxima: dict[str, torch.Tensor]) -> list[Equalized]:
    """Scale each chain of ``prepared`` by the factors of its depthwise input's channel maxima; the factors
    of the values scaled are kept in its ``meta`` (``FACTORS``, by node name: :func:`unscaled`)."""
    records = []
    scaled_values = prepared.meta.setdefault(FACTORS, {})
    for chain in chains:
        names = (chain.conv.name, chain.activation.name if chain.activation is not None else None, chain.depthwise.name)
        source = chain.activation or chain.conv
        found = maxima.get(chain.depthwise.name)
        if found is None:
            records.append(Equalized(*names, source.name, skipped="no value was observed"))
            continue
        m = np.nan_to_num(found.double().numpy(), nan=0.0, posinf=0.0)
        s = channel_factors(m)
        if not (s > 1).any():
            spread = channel_spread(m)
            why = "no channel's maximum is below the largest's headroom"
            records.append(Equalized(*names, source.name, int(m.size), 0, 1.0, spread, spread, why))
            continue
        factors = torch.from_numpy(s)
        scaled = ((chain.weights[0], factors), (chain.conv.args[2], factors), (chain.weights[1], 1 / factors))
        for constant, f in scaled:
            if isinstance(constant, Node):
                _scale(prepared, str(constant.target), f)
        for value in (chain.conv, chain.activation):
            if value is not None:
                scaled_values[value.name] = s.reshape(1, -1, 1, 1)  # a conv2d's output: channels on axis 1
        records.append(Equalized(*names, source.name, int(m.size), int((s > 1).sum()), float(s.max()),
                                 channel_spread(m), channel_spread(m * s)))  # fmt: skip
    return records
