"""``fold-pad``: a zero ``Pad`` of the spatial axes folds into the ``Conv`` that reads it.

A Pad folds when its mode is ``constant``, its value is absent or a constant 0, its pads are
constant, non-negative and zero on the batch and channel axes (no ``axes`` input), its only
reader is a Conv's data input, and that Conv's ``auto_pad`` is ``NOTSET``. The Conv's ``pads``
grow by the Pad's. Exporters write such a Pad for TensorFlow-style "same" padding
(EfficientNet-Lite0 has 17); left alone, it sits in float between a DequantizeLinear and a
QuantizeLinear in the quantized model, which ONNX Runtime runs as three extra ops. Recurses into
subgraphs.

Invariant after: no constant-zero spatial Pad is the only input of a Conv it could fold into.

Before::

    %p: tensor<1x3x6x6xf32> = Pad(%X, %pads)     // pads = [0, 0, 1, 1, 0, 0, 1, 1]
    %Y: tensor<1x8x4x4xf32> = Conv(%p, %W) {pads = [0, 0, 0, 0]}

After::

    %Y: tensor<1x8x4x4xf32> = Conv(%X, %W) {pads = [1, 1, 1, 1]}
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from requant.ir.queries import pads_with_zero
from requant.passes._base import NodeRewrite
from requant.passes._rewrite import constant, is_op

__all__ = ["PASS", "FoldPad"]


def _zero_pads(node: ir.Node) -> list[int] | None:
    """The Pad's pads if it is a constant zero pad that only touches spatial axes, else None."""
    if not pads_with_zero(node) or (len(node.inputs) > 3 and node.inputs[3] is not None):  # or an axes input
        return None
    pads = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if pads is None:
        return None
    pads_list = [int(p) for p in np.asarray(pads).reshape(-1)]
    rank = len(pads_list) // 2
    if rank < 3 or any(p < 0 for p in pads_list):
        return None
    begins, ends = pads_list[:rank], pads_list[rank:]
    if begins[:2] != [0, 0] or ends[:2] != [0, 0]:
        return None
    return begins[2:] + ends[2:]


def _fold(pad: ir.Node) -> bool:
    out = pad.outputs[0]
    if out.is_graph_output() or len(out.uses()) != 1:
        return False
    conv, index = next(iter(out.uses()))
    if not is_op(conv, "Conv") or index != 0:
        return False
    auto_pad = conv.attributes.get("auto_pad")
    if auto_pad is not None and auto_pad.as_string() != "NOTSET":
        return False
    extra = _zero_pads(pad)
    if extra is None:
        return False
    old = conv.attributes.get("pads")
    current = list(old.as_ints()) if old is not None else [0] * len(extra)
    if len(current) != len(extra):
        return False
    conv.attributes["pads"] = ir.AttrInt64s("pads", [a + b for a, b in zip(current, extra, strict=True)])
    conv.replace_input_with(0, pad.inputs[0])
    graph = pad.graph
    assert graph is not None
    graph.remove(pad, safe=True)
    return True


class FoldPad(NodeRewrite):
    name = "fold-pad"
    op_type = "Pad"

    def rewrite(self, node: ir.Node) -> bool:
        return _fold(node)


PASS = FoldPad
