"""A squeeze-and-excitation gate: the ops between a spatial mean and the Mul that scales the trunk by their result.

MobileNetV3, PP-LCNet, RegNetY and PP-OCR's detector squeeze a feature map to one value per channel (a spatial
mean: ``GlobalAveragePool``, or ``ReduceMean`` over the spatial axes), run those ``C`` values through a small
network (1x1 convolutions, a Relu, a HardSigmoid or Sigmoid), and multiply the map by the result, channel by
channel. Each of those ops reads and writes ``N x C x 1 x 1`` values: in float they cost a few microseconds
whatever the map's size, and int8 saves nothing there, but rounds the gate at every step (PP-OCR's detector:
the gate's hidden Relu at 10.6 dB SQNR against float, the gated map 5.3 dB under its input). The ONNX Runtime
table computes them in float where they stand (``float_ops``): the mean before them stays int8 (it reads the
whole map; its int8 result is dequantized for the gate), and so does the gating Mul (it quantizes the gate
once, as its input). Measured on PP-OCR's small detector (``bench/bench_zoo.py``: 64 photo crops to
calibrate, 100 others), its GELUs already float: the output 21.3 -> 22.0 dB against float, latency 0.66x ->
0.65x float's (the same, within the runs' noise).

:func:`in_gate` names such an op: its data input and output are per-channel values (every axis after the
channel one of size 1), it reads a spatial mean through ops of the same kind, and its result reaches, through
ops of the same kind, a ``Mul`` whose other input is a whole map.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["REASON", "gate_ops", "in_gate"]

REASON = (
    "a squeeze-and-excitation gate (per-channel values between a spatial mean and the Mul they scale the map "
    "by): float costs microseconds there, int8 would round the gate at every step"
)
MAX_HOPS = 8  # ops of a gate between its mean and its Mul, at most
MEANS = ("GlobalAveragePool", "ReduceMean")


def _per_channel(value: ir.Value | None) -> bool:
    """A value of rank 3 or more whose every axis after the channel one has size 1 (``N x C x 1 x 1``)."""
    shape = value.shape if value is not None else None
    if shape is None or len(shape) < 3:
        return False
    return all(isinstance(d, int) and d == 1 for d in list(shape)[2:])


def _map(value: ir.Value | None) -> bool:
    """A value of rank 3 or more with some axis after the channel one larger than 1 (or not known)."""
    shape = value.shape if value is not None else None
    return shape is not None and len(shape) >= 3 and not _per_channel(value)


def _from_mean(node: ir.Node) -> bool:
    """Whether ``node``'s data input comes from a spatial mean of a map through per-channel ops only."""
    for _ in range(MAX_HOPS):
        value = node.inputs[0] if node.inputs else None
        producer = value.producer() if value is not None and _per_channel(value) else None
        if producer is None:
            return False
        if producer.op_type in MEANS and producer.domain in ("", "ai.onnx"):
            return _map(producer.inputs[0] if producer.inputs else None)
        node = producer
    return False


def _to_gated_mul(node: ir.Node) -> bool:
    """Whether ``node``'s result reaches, through per-channel ops each read once, a Mul by a map."""
    for _ in range(MAX_HOPS):
        out = node.outputs[0]
        readers = out.consumers()
        if len(readers) != 1 or out.is_graph_output() or not _per_channel(out):
            return False
        (reader,) = readers
        if reader.op_type == "Mul" and any(_map(v) for v in reader.inputs if v is not out):
            return True
        node = reader
    return False


def in_gate(node: ir.Node) -> str | None:
    """:data:`REASON` where ``node`` is one of a squeeze-and-excitation gate's per-channel ops, else None."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or not node.outputs or len(node.outputs) != 1:
        return None
    if not (_per_channel(node.inputs[0]) and _per_channel(node.outputs[0])):
        return None
    return REASON if _from_mean(node) and _to_gated_mul(node) else None


def gate_ops(graph: ir.Graph) -> dict[str, str]:
    """The named per-channel ops of every squeeze-and-excitation gate of ``graph``, with :data:`REASON`."""
    return {str(n.name): REASON for n in graph if n.name and in_gate(n)}
