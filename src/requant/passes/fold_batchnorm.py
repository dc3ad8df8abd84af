"""``fold-batchnorm``: inference ``BatchNormalization`` folds into the Conv, ConvTranspose, Gemm or MatMul before it.

With ``s = scale / sqrt(var + epsilon)`` per channel, the producer's weights are
multiplied by ``s`` along its output-channel axis and its bias becomes
``(bias - mean) * s + beta`` (Gemm: ``(beta_attr * C - mean) * s + beta``). A
MatMul (2-d input and weight) gets a following ``Add`` for the bias. Folded
weights are new initializers, so weights shared with other nodes are untouched;
the old ones are dropped when nothing else reads them.
A batch norm reading a channel ``Concat`` (axis 1) of Conv, ConvTranspose or
Gemm outputs, each read only there, folds into each of them, its channels'
share (TransNetV2's blocks: four dilated 3-d convolutions, concatenated, then a
batch norm); the Concat's output becomes the batch norm's. Left float, it
costs a per-channel Mul and Add, each quantized, after the Concat's own
rounding. A batch norm is left alone when it trains, a producer's output has
other uses, or any parameter or weight is not constant. Recurses into
subgraphs.

Invariant after: no BatchNormalization reads the only output of a Conv,
ConvTranspose, Gemm or 2-d MatMul with constant weights and constant statistics,
nor a channel Concat of only such outputs.

Before::

    %c: tensor<1x8x4x4xf32> = Conv(%X, %W, %B)
    %Y: tensor<1x8x4x4xf32> = BatchNormalization(%c, %gamma, %beta, %mean, %var)

After::

    %Y: tensor<1x8x4x4xf32> = Conv(%X, %W_bn, %B_bn)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from requant.passes._base import NodeRewrite
from requant.passes._rewrite import adopt_name, constant, is_op, new_initializer, take_over

__all__ = ["PASS", "FoldBatchNorm"]

Array = npt.NDArray[np.float64]
_PRODUCERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_CONCAT_PRODUCERS = ("Conv", "ConvTranspose", "Gemm")


def _attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else float(attr.value)


def _scaled_weight(producer: ir.Node, weight: Array, scale: Array) -> Array | None:
    op = producer.op_type
    if op == "Conv":
        return weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    if op == "ConvTranspose":
        group = int(_attr(producer, "group", 1))
        per_group = weight.shape[1]
        grouped = weight.reshape((group, weight.shape[0] // group, per_group, *weight.shape[2:]))
        factor = scale.reshape((group, 1, per_group) + (1,) * (weight.ndim - 2))
        return (grouped * factor).reshape(weight.shape)
    if op == "Gemm":
        return weight * (scale[:, None] if _attr(producer, "transB", 0) else scale[None, :])
    if op == "MatMul" and weight.ndim == 2:
        return weight * scale[None, :]
    return None


def _rank2(value: ir.Value | None) -> bool:
    return value is not None and value.shape is not None and len(value.shape) == 2


def _statistics(bn: ir.Node) -> tuple[Array, Array, Array] | None:
    """The batch norm's per-channel ``(scale, beta, mean)``, ``scale = gamma / sqrt(var + epsilon)``; None
    when it trains, reads a computed parameter or has a second output someone reads."""
    if _attr(bn, "training_mode", 0) or any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return None
    params = [constant(v) for v in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, dtype=np.float64).reshape(-1) for p in params)
    return gamma / np.sqrt(var + _attr(bn, "epsilon", 1e-5)), beta, mean


def _foldable(x: ir.Value | None, producers: tuple[str, ...] = _PRODUCERS) -> ir.Node | None:
    """The producer of ``x`` when the batch norm's factors can go into its constant weight and bias: one of
    ``producers``, ``x`` its only output read once, its bias constant or absent."""
    producer = x.producer() if x is not None else None
    if producer is None or x is None or not any(is_op(producer, op) for op in producers):
        return None
    weight = constant(producer.inputs[1])
    if len(x.uses()) != 1 or x.is_graph_output() or weight is None:
        return None
    if producer.op_type == "MatMul" and (weight.ndim != 2 or not _rank2(producer.inputs[0])):
        return None
    bias_value = producer.inputs[2] if len(producer.inputs) > 2 else None
    if bias_value is not None and constant(bias_value) is None:
        return None  # a computed bias cannot absorb the shift
    return producer


def _channels(producer: ir.Node) -> int:
    """How many output channels ``producer`` (a foldable kernel) computes, read from its weight."""
    weight = constant(producer.inputs[1])
    assert weight is not None
    if producer.op_type == "ConvTranspose":
        return int(weight.shape[1]) * int(_attr(producer, "group", 1))
    if producer.op_type == "Gemm" and _attr(producer, "transB", 0):
        return int(weight.shape[0])
    return int(weight.shape[0] if producer.op_type == "Conv" else weight.shape[-1])


def _fold_into(producer: ir.Node, statistics: tuple[Array, Array, Array], bn_output: ir.Value, name: str) -> ir.Value:
    """Multiply ``producer``'s weight by ``scale`` and shift its bias (named ``name``): the value now
    computing the batch norm's result (its output, or a MatMul's new ``Add``, named as ``bn_output``)."""
    scale, beta, mean = statistics
    graph = producer.graph
    assert graph is not None and isinstance(graph, ir.Graph)
    weight_value, x = producer.inputs[1], producer.outputs[0]
    weight = constant(weight_value)
    assert weight is not None and weight_value is not None
    new_weight = _scaled_weight(producer, weight.astype(np.float64), scale)
    assert new_weight is not None
    dtype = weight.dtype
    producer.replace_input_with(1, new_initializer(graph, f"{weight_value.name}_bn", new_weight.astype(dtype)))
    old_bias = constant(producer.inputs[2]) if len(producer.inputs) > 2 else None
    b = np.zeros(scale.shape) if old_bias is None else old_bias.astype(np.float64)
    if producer.op_type == "Gemm":
        b = b * _attr(producer, "beta", 1.0)
        producer.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    bias = new_initializer(graph, name, ((b - mean) * scale + beta).astype(dtype))
    if producer.op_type != "MatMul":
        if len(producer.inputs) < 3:
            producer.resize_inputs(3)
        producer.replace_input_with(2, bias)
        return x
    add = ir.Node("", "Add", inputs=[x, bias], num_outputs=1)
    adopt_name(bn_output, add.outputs[0])
    graph.insert_after(producer, add)
    return add.outputs[0]


def _fold(bn: ir.Node) -> bool:
    statistics, x = _statistics(bn), bn.inputs[0]
    producer = _foldable(x)
    if statistics is None or producer is None or x is None:
        return False
    result = _fold_into(producer, statistics, bn.outputs[0], f"{bn.outputs[0].name or 'bn'}_bias")
    take_over(bn, result, name=result is x)  # (a MatMul's new Add has the name already)
    return True


def _fold_through_concat(bn: ir.Node) -> bool:
    """A batch norm reading a channel ``Concat`` of kernels' only outputs: each kernel takes its channels'
    factors, and the Concat's output becomes the batch norm's."""
    statistics, x = _statistics(bn), bn.inputs[0]
    concat = x.producer() if x is not None else None
    if statistics is None or x is None or concat is None or not is_op(concat, "Concat"):
        return False
    shape = x.shape or bn.outputs[0].shape
    axis = int(_attr(concat, "axis", 0))
    if (axis if shape is None else axis % len(shape)) != 1 or len(x.uses()) != 1 or x.is_graph_output():
        return False
    producers = [p for v in concat.inputs if (p := _foldable(v, _CONCAT_PRODUCERS)) is not None]
    counts = [_channels(p) for p in producers]
    if len(producers) != len(concat.inputs) or sum(counts) != len(statistics[0]):
        return False
    (scale, beta, mean), name, start = statistics, bn.outputs[0].name or "bn", 0
    for producer, count in zip(producers, counts, strict=True):
        own = slice(start, start + count)
        _fold_into(producer, (scale[own], beta[own], mean[own]), bn.outputs[0], f"{name}_{start}_bias")
        start += count
    take_over(bn, x)
    return True


class FoldBatchNorm(NodeRewrite):
    name = "fold-batchnorm"
    op_type = "BatchNormalization"

    def rewrite(self, node: ir.Node) -> bool:
        return _fold(node) or _fold_through_concat(node)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = super().call(model)
        if result.modified:  # the unfolded weights and statistics, unless something else reads them
            RemoveUnusedNodesPass()(model)
        return result


PASS = FoldBatchNorm
