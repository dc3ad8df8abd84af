"""``unshare-biases``: each kernel's constant bias is its own initializer.

An int8 kernel's bias is stored in int32 at the scale of its input times its weights', so two
kernels cannot share one: a shared bias quantizes at one kernel's scale, and ONNX Runtime runs the
other kernel in float (its QDQ fusion needs that product). Exporters share identical constants:
torch's TorchScript exporter gives every convolution whose folded batch norm has a zero bias (any
model with fresh statistics; a transformers RegNet with random weights had 7 of 13 convolutions run
in float for it) the same initializer. A bias read by several ``Conv``, ``ConvTranspose`` or
``Gemm`` nodes is copied for each reader after the first. Recurses into subgraphs.

Invariant after: no initializer is the bias of two kernels.

Before::

    %A: tensor<1x4x8x8xf32> = Conv(%X, %W1, %b)
    %B: tensor<1x4x8x8xf32> = Conv(%A, %W2, %b)

After::

    %A: tensor<1x4x8x8xf32> = Conv(%X, %W1, %b)
    %B: tensor<1x4x8x8xf32> = Conv(%A, %W2, %b_1)
"""

from __future__ import annotations

import onnx_ir as ir

from requant.ir.queries import fresh_name
from requant.passes._base import Pass
from requant.passes._rewrite import all_nodes, is_op

__all__ = ["PASS", "UnshareBiases"]

KERNELS = ("Conv", "ConvTranspose", "Gemm")


def _bias(node: ir.Node) -> ir.Value | None:
    if not any(is_op(node, k) for k in KERNELS) or len(node.inputs) < 3:
        return None
    bias = node.inputs[2]
    return bias if bias is not None and bias.is_initializer() and bias.const_value is not None else None


def _later_readers(model: ir.Model) -> list[tuple[ir.Node, ir.Value]]:
    """Each kernel (with its bias) whose bias initializer a kernel before it already reads."""
    seen: set[int] = set()
    later = []
    for node in all_nodes(model):
        bias = _bias(node)
        if bias is not None and node.graph is not None:
            if id(bias) in seen:
                later.append((node, bias))
            seen.add(id(bias))
    return later


class UnshareBiases(Pass):
    name = "unshare-biases"
    recurses_into_subgraphs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        later = _later_readers(model)
        for node, bias in later:
            graph, data = node.graph, bias.const_value
            assert graph is not None and data is not None  # (_later_readers)
            name = fresh_name(str(bias.name), set(graph.initializers))
            copy = ir.Value(name=name, shape=bias.shape, type=bias.type,
                            const_value=ir.Tensor(data.numpy().copy(), name=name))  # fmt: skip
            graph.register_initializer(copy)
            node.replace_input_with(2, copy)
        return ir.passes.PassResult(model, bool(later))

    def finds(self, model: ir.Model) -> list[str]:
        return [str(node.name) for node, _ in _later_readers(model)]


PASS = UnshareBiases
