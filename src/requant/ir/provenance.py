"""Where a node came from: the PyTorch module path and class a front door recorded on it, which
float value a QuantizeLinear quantizes when its input is not that value (a clamp it makes redundant
was dropped: ``requant.backends.qdq``), why an ``Identity`` is a rescale (propagation put it where an op
bound to one type got two: ``requant.propagation.propagate``), and by how much equalization scaled a value's channels
(``requant.transforms.equalization``): what ``requant compare`` needs to match a requant output's
tensors with the float model's."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

__all__ = [
    "CHANNEL_FACTORS_KEY",
    "MODULE_CLASS_KEY",
    "MODULE_PATH_KEY",
    "QUANTIZES_KEY",
    "RESCALE_KEY",
    "channel_factors",
    "module_class",
    "module_path",
    "quantizes",
    "set_channel_factors",
]

MODULE_PATH_KEY = "requant.module_path"
MODULE_CLASS_KEY = "requant.module_class"
QUANTIZES_KEY = "requant.quantizes"
RESCALE_KEY = "requant.rescale"  # on an Identity propagation inserted: why it rescales
CHANNEL_FACTORS_KEY = "requant.channel_factors"  # on a value: "C;c:f,c:f" (channel count; factors other than 1)


def module_path(node: ir.Node) -> str | None:
    """The module path recorded for ``node`` (``features.0.conv``; ``""`` for the root), or None."""
    return node.metadata_props.get(MODULE_PATH_KEY)


def module_class(node: ir.Node) -> str | None:
    """The module class recorded for ``node`` (``torch.nn.modules.conv.Conv2d``), or None."""
    return node.metadata_props.get(MODULE_CLASS_KEY)


def quantizes(node: ir.Node) -> str:
    """The name of the float value a QuantizeLinear quantizes: recorded, or its input's."""
    recorded = node.metadata_props.get(QUANTIZES_KEY)
    if recorded:
        return recorded
    return str(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else ""


def set_channel_factors(value: ir.Value, factors: npt.NDArray[np.float64] | None) -> None:
    """Record on ``value`` that channel ``c`` (axis 1) of it is ``factors[c]`` times the float model's
    (only the factors other than 1 are written); None forgets it."""
    if factors is None:
        value.metadata_props.pop(CHANNEL_FACTORS_KEY, None)
        return
    pairs = ",".join(f"{c}:{float(f)!r}" for c, f in enumerate(factors) if f != 1.0)
    value.metadata_props[CHANNEL_FACTORS_KEY] = f"{len(factors)};{pairs}"


def channel_factors(value: ir.Value) -> npt.NDArray[np.float64] | None:
    """The factors :func:`set_channel_factors` recorded on ``value``, one per channel, or None."""
    text = value.metadata_props.get(CHANNEL_FACTORS_KEY)
    if not text:
        return None
    count, _, pairs = text.partition(";")
    factors = np.ones(int(count), np.float64)
    for pair in filter(None, pairs.split(",")):
        channel, _, factor = pair.partition(":")
        factors[int(channel)] = float(factor)
    return factors
