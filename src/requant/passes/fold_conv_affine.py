"""``fold-conv-affine``: a constant ``Mul``, ``Div``, ``Add`` or ``Sub`` after a Conv folds into its weights and bias.

A factor ``c`` that is one number, or one per output channel (shape ``[C, 1, ...]`` or
``[1, C, 1, ...]``), multiplies the weights of that channel and its bias (``Div``: divides them); an
offset of that shape adds to the bias (``Sub``: subtracts). Paddle's exporter writes a learnable
affine block (PP-LCNet's "LAB": ``Mul`` by a scalar, then ``Add`` of one) after every conv of
PP-OCRv4's detector, and some exporters write a conv's bias as an ``Add``. Left in, each is one more
tensor to quantize between the conv and its reader (the conv's output rounded before the offset
moves it: PP-OCRv4's detector lost up to 11 dB of SQNR at one such conv) and one more int8 op to run.

Left alone: a Conv whose output has other readers or is a graph output, a weight or bias that is
not constant, a constant that varies along another axis than the channels (or would broadcast the
output to a larger shape), ``c - x`` and ``c / x``. Folded weights and biases are new initializers;
the old ones go when nothing else reads them. Repeats until nothing folds, so ``Mul`` then ``Add``
both go. Recurses into subgraphs.

Before::

    %c: tensor<1x8x4x4xf32> = Conv(%X, %W, %B)
    %m: tensor<1x8x4x4xf32> = Mul(%c, %a)
    %Y: tensor<1x8x4x4xf32> = Add(%m, %b)

After::

    %Y: tensor<1x8x4x4xf32> = Conv(%X, %W_scaled, %Y_bias)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from requant.passes._base import Pass
from requant.passes._rewrite import all_nodes, constant, is_op, new_initializer, take_over

__all__ = ["PASS", "FoldConvAffine"]

Array = npt.NDArray[np.float64]
_OPS = ("Mul", "Div", "Add", "Sub")


def _per_channel(data: npt.NDArray[np.generic], rank: int, channels: int) -> Array | None:
    """``data`` as one number per output channel (``[channels]``), if it broadcasts against a conv
    output of ``rank`` along the channel axis only."""
    if data.ndim > rank:
        return None
    shape = (1,) * (rank - data.ndim) + data.shape
    if any(size != 1 for axis, size in enumerate(shape) if axis != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(np.asarray(data, np.float64).reshape(-1), (channels,))


def _fold(conv: ir.Node) -> bool:
    out = conv.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output() or len(conv.inputs) < 2:
        return False
    node, index = uses[0].node, uses[0].idx
    if not any(is_op(node, op) for op in _OPS) or len(node.inputs) != 2:
        return False
    if None not in (node.outputs[0].dtype, out.dtype) and node.outputs[0].dtype != out.dtype:
        return False
    if node.op_type in ("Sub", "Div") and index != 0:
        return False  # c - x, c / x: not affine in the conv's weights alone
    weight_value, bias_value = conv.inputs[1], conv.inputs[2] if len(conv.inputs) > 2 else None
    weight, old_bias = constant(weight_value), constant(bias_value)
    other = constant(node.inputs[1 - index])
    if weight is None or weight_value is None or other is None or (bias_value is not None and old_bias is None):
        return False
    if weight.dtype.kind != "f":
        return False
    channels = weight.shape[0]
    factor = _per_channel(other, weight.ndim, channels)  # (a conv's output has its weight's rank)
    if factor is None:
        return False
    w, b = weight.astype(np.float64), np.zeros(channels) if old_bias is None else old_bias.astype(np.float64)
    if node.op_type in ("Mul", "Div"):
        if node.op_type == "Div" and not np.all(factor != 0):
            return False
        factor = factor if node.op_type == "Mul" else 1.0 / factor
        w, b = w * factor.reshape((-1,) + (1,) * (w.ndim - 1)), b * factor
    else:
        b = b + factor if node.op_type == "Add" else b - factor
    graph = conv.graph
    assert graph is not None and isinstance(graph, ir.Graph)
    result = node.outputs[0]
    if node.op_type in ("Mul", "Div"):
        conv.replace_input_with(1, new_initializer(graph, f"{weight_value.name}_scaled", w.astype(weight.dtype)))
    if len(conv.inputs) < 3:
        conv.resize_inputs(3)
    conv.replace_input_with(2, new_initializer(graph, f"{result.name or 'conv'}_bias", b.astype(weight.dtype)))
    take_over(node, out)
    return True


class FoldConvAffine(Pass):
    name = "fold-conv-affine"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for conv in [n for n in all_nodes(model) if is_op(n, "Conv")]:
            while conv.graph is not None and _fold(conv):
                modified = True
        if modified:  # the unfolded weights and constants, unless something else reads them
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified)


PASS = FoldConvAffine
