"""``fold-batchnorm``: inference ``BatchNormalization`` folds into the Conv, ConvTranspose, Gemm or MatMul before it.

With ``s = scale / sqrt(var + epsilon)`` per channel, the producer's weights are
multiplied by ``s`` along its output-channel axis and its bias becomes
``(bias - mean) * s + beta`` (Gemm: ``(beta_attr * C - mean) * s + beta``). A
MatMul (2-d input and weight) gets a following ``Add`` for the bias. Folded
weights are new initializers, so weights shared with other nodes are untouched;
the old ones are dropped when nothing else reads them.
A batch norm is left alone when it trains, its producer's output has other
uses, or any parameter or weight is not constant. Recurses into subgraphs.

Invariant after: no BatchNormalization reads the only output of a Conv,
ConvTranspose, Gemm or 2-d MatMul with constant weights and constant statistics.

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


def _fold(bn: ir.Node) -> bool:
    x = bn.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None or x is None or not any(is_op(producer, op) for op in _PRODUCERS):
        return False
    if len(x.uses()) != 1 or x.is_graph_output() or _attr(bn, "training_mode", 0):
        return False
    if any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return False
    params = [constant(v) for v in bn.inputs[1:5]]
    weight_value = producer.inputs[1]
    weight = constant(weight_value)
    if any(p is None for p in params) or weight is None or weight_value is None:
        return False
    if producer.op_type == "MatMul" and not _rank2(producer.inputs[0]):
        return False
    bias_value = producer.inputs[2] if len(producer.inputs) > 2 else None
    old_bias = constant(bias_value)
    if bias_value is not None and old_bias is None:
        return False  # a computed bias cannot absorb the shift
    gamma, beta, mean, var = (np.asarray(p, dtype=np.float64).reshape(-1) for p in params)
    scale = gamma / np.sqrt(var + _attr(bn, "epsilon", 1e-5))
    new_weight = _scaled_weight(producer, weight.astype(np.float64), scale)
    if new_weight is None:
        return False
    graph = producer.graph
    assert graph is not None and isinstance(graph, ir.Graph)
    dtype = weight.dtype
    producer.replace_input_with(1, new_initializer(graph, f"{weight_value.name}_bn", new_weight.astype(dtype)))
    if producer.op_type == "Gemm":
        c = np.zeros(scale.shape) if old_bias is None else old_bias.astype(np.float64) * _attr(producer, "beta", 1.0)
        new_bias = (c - mean) * scale + beta
        producer.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    else:
        b = np.zeros(scale.shape) if old_bias is None else old_bias.astype(np.float64)
        new_bias = (b - mean) * scale + beta
    bias = new_initializer(graph, f"{bn.outputs[0].name or 'bn'}_bias", new_bias.astype(dtype))
    if producer.op_type == "MatMul":
        add = ir.Node("", "Add", inputs=[x, bias], num_outputs=1)
        result = add.outputs[0]
        adopt_name(bn.outputs[0], result)
        graph.insert_after(producer, add)
    else:
        if len(producer.inputs) < 3:
            producer.resize_inputs(3)
        producer.replace_input_with(2, bias)
        result = x
    take_over(bn, result, name=result is x)  # (a MatMul's new Add has the name already)
    return True


class FoldBatchNorm(NodeRewrite):
    name = "fold-batchnorm"
    op_type = "BatchNormalization"

    def rewrite(self, node: ir.Node) -> bool:
        return _fold(node)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = super().call(model)
        if result.modified:  # the unfolded weights and statistics, unless something else reads them
            RemoveUnusedNodesPass()(model)
        return result


PASS = FoldBatchNorm
