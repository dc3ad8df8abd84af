"""``zero-biases``: every Conv and Gemm with a constant float weight has a bias, a zero one where it had none.

Bias correction gives a kernel's quantization shift back through its int32 bias
(:mod:`requant.transforms.bias_correction`): a kernel without a bias kept its shift. torch's dynamo exporter
leaves out the bias of a convolution whose folded batch norm's bias is zero (fresh statistics): a
``transformers`` RegNet had 9 of its 13 convolutions without one, and its int8 output was 40.96 dB from float
against 41.87 dB for the TorchScript export of the same model, whose convolutions all have (zero) biases. An
int8 kernel adds its int32 bias at no measurable cost. A Conv gets ``[C_out]`` zeros (its weight's first
dimension), a Gemm (``beta`` 1) ``[N]`` zeros; a weight that is not a float initializer, or of unknown shape, is
left alone. Recurses into subgraphs.

Invariant after: every such Conv and Gemm has a bias input.

Before::

    %Y: tensor<1x4x8x8xf32> = Conv(%X, %W)

After::

    %W_bias: tensor<4xf32> = initializer dense<[0.0, 0.0, 0.0, 0.0]>
    %Y: tensor<1x4x8x8xf32> = Conv(%X, %W, %W_bias)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from requant.ir.queries import fresh_name
from requant.passes._base import Pass
from requant.passes._rewrite import all_nodes, is_op

__all__ = ["PASS", "ZeroBiases"]

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _outputs(node: ir.Node) -> int | None:
    """The output channels of a Conv or Gemm (beta 1) without a bias and with a float initializer weight, else
    None."""
    conv, gemm = is_op(node, "Conv"), is_op(node, "Gemm")
    if not (conv or gemm) or len(node.inputs) < 2 or (len(node.inputs) > 2 and node.inputs[2] is not None):
        return None
    weight = node.inputs[1]
    if weight is None or not weight.is_initializer() or weight.const_value is None or weight.dtype not in FLOATS:
        return None
    shape = weight.const_value.shape.numpy()  # an initializer's: every dimension known
    if conv:
        return int(shape[0]) if len(shape) >= 3 else None
    if node.attributes.get_float("beta", 1.0) != 1.0 or len(shape) != 2:
        return None
    return int(shape[0] if node.attributes.get_int("transB", 0) else shape[1])


def _unbiased(model: ir.Model) -> list[tuple[ir.Node, int]]:
    return [(node, n) for node in all_nodes(model) if node.graph is not None and (n := _outputs(node)) is not None]


class ZeroBiases(Pass):
    name = "zero-biases"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        found = _unbiased(model)
        for node, channels in found:
            graph, weight = node.graph, node.inputs[1]
            assert graph is not None and weight is not None  # (_outputs)
            name = fresh_name(f"{weight.name}_bias", set(graph.initializers))
            assert weight.dtype is not None  # (_outputs: one of FLOATS)
            data = np.zeros(channels, weight.dtype.numpy())
            bias = ir.Value(name=name, shape=ir.Shape([channels]), type=weight.type,
                            const_value=ir.Tensor(data, name=name))  # fmt: skip
            graph.register_initializer(bias)
            if len(node.inputs) < 3:
                node.resize_inputs(3)
            node.replace_input_with(2, bias)
        return ir.passes.PassResult(model, bool(found))

    def finds(self, model: ir.Model) -> list[str]:
        return [str(node.name) for node, _ in _unbiased(model)]


PASS = ZeroBiases
