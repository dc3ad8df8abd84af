"""An int8 MatMul with a float output and a bias becomes ONNX Runtime's ``MatMulIntegerToFloat`` with it.

ONNX Runtime fuses ``DequantizeLinear -> MatMul`` with a float output into its ``MatMulIntegerToFloat``
(``com.microsoft``) but leaves the bias ``Add`` after it a node of its own, although the kernel takes
a bias and adds it in its output loop. A transformer has one such Add per linear layer whose bias
no later fusion takes (the attention's query, key and value): 18 of all-MiniLM-L6-v2's nodes,
about 8 % of its int8 run (measured interleaved, AVX2 kernels: 0.88 -> 0.80 ms, two threads).
ONNX Runtime's own fusion that does take the bias reads ``MatMulInteger -> Cast -> Mul -> Add``, but
only when the scales' product is not a constant (dynamic quantization): constant folding takes it
apart first. So requant writes the fused op itself, as it writes ``DynamicQuantizeLSTM``:

    DequantizeLinear(a_q; a_s, a_z) -> MatMul <- DequantizeLinear(w_q; w_s, w_z)  -> Add(bias)
    =>  MatMulIntegerToFloat(a_q, w_q, a_s, w_s, a_z, w_z, bias)

The same integers and the same kernel; the bias is added in the kernel's output loop (a float sum
of the same two numbers). The node keeps the MatMul's name and metadata (its quantizer's decision),
and the Add's output. Left alone (the QDQ form stays): a sum read only by a ``QuantizeLinear`` where
ONNX Runtime makes the pair a QGemm (a 2-d or static input), a weight that is not a constant matrix with one scale per
tensor or per column, an activation with more than one scale, storage other than 8 bits, a bias that
is not a float vector of the output's width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.backends.dynamic_lstm import MS_DOMAIN
from requant.ir.queries import constant, is_op
from requant.passes._rewrite import adopt_name, drop_if_unused, new_initializer

__all__ = ["write_matmul_integer_to_float"]

_EIGHT_BITS = (ir.DataType.UINT8, ir.DataType.INT8)


def _dequantized(value: ir.Value | None) -> ir.Node | None:
    """The ``DequantizeLinear`` producing ``value`` from 8-bit integers with one scale per tensor or
    per axis (no blocks), with its scale and zero point given."""
    node = value.producer() if value is not None else None
    if node is None or not is_op(node, "DequantizeLinear") or len(node.inputs) < 3:
        return None
    stored, scale, zero = node.inputs[:3]
    if stored is None or scale is None or zero is None or stored.dtype not in _EIGHT_BITS:
        return None
    if node.attributes.get_int("block_size", 0) or constant(scale) is None or scale.dtype != ir.DataType.FLOAT:
        return None
    return node


def _bias(add: ir.Node, matmul_out: ir.Value, width: int) -> npt.NDArray[Any] | None:
    """The Add's other operand as a float vector of ``width``, if it is a constant one (shape ``[N]``,
    or ``[1, ..., 1, N]``)."""
    others = [v for v in add.inputs if v is not matmul_out]
    data = constant(others[0]) if len(others) == 1 and others[0] is not None else None
    if data is None or data.dtype != np.float32 or data.size != width or data.shape[-1:] != (width,):
        return None
    return data.reshape(width)


def _becomes_gemm(a: ir.Value | None) -> bool:
    """Whether ONNX Runtime rewrites ``MatMul -> Add`` reading ``a`` into a Gemm before its QDQ fusion
    (``a`` 2-d, or its shape static): a quantized sum then runs as a QGemm. Otherwise (a transformer's
    ``[batch, sequence, features]``) it fuses only the MatMul, and the Add runs in float before the
    QuantizeLinear."""
    shape = a.shape if a is not None else None
    return shape is not None and (len(shape) == 2 or all(isinstance(d, int) for d in shape))


def _rewrite(graph: ir.Graph, matmul: ir.Node) -> bool:
    a_dq, w_dq = (_dequantized(v) for v in matmul.inputs[:2])
    out = matmul.outputs[0]
    if a_dq is None or w_dq is None or out.is_graph_output() or len(matmul.inputs) != 2:
        return False
    a_type, w_type = (dq.inputs[0].dtype if dq.inputs[0] is not None else None for dq in (a_dq, w_dq))
    if a_type == ir.DataType.INT8 and w_type != ir.DataType.INT8:
        return False  # the kernel's types: int8 activations take int8 weights only
    a_scale, w_scale, weight = constant(a_dq.inputs[1]), constant(w_dq.inputs[1]), constant(w_dq.inputs[0])
    if a_scale is None or a_scale.size != 1 or weight is None or weight.ndim != 2 or w_scale is None:
        return False
    if w_scale.size != 1 and (w_scale.shape != (weight.shape[1],) or w_dq.attributes.get_int("axis", 1) not in (1, -1)):
        return False  # one scale per column, or one for the matrix: what the kernel reads
    uses = list(out.uses())
    if len(uses) != 1 or not is_op(uses[0].node, "Add"):
        return False
    add = uses[0].node
    result = add.outputs[0]
    quantized = result.uses() and all(is_op(u.node, "QuantizeLinear") for u in result.uses())
    if not result.is_graph_output() and quantized and _becomes_gemm(matmul.inputs[0]):
        return False  # quantized sum: ONNX Runtime makes the pair a QGemm
    bias = _bias(add, out, weight.shape[1])
    if bias is None:
        return False
    given = next(v for v in add.inputs if v is not out)
    assert given is not None
    if given.is_initializer() and len(given.uses()) == 1 and given.shape is not None and len(given.shape) == 1:
        bias_value = given  # already the kernel's vector
    else:
        bias_value = new_initializer(graph, f"{given.name or 'bias'}_vector", bias)
    (a, a_scale_v, a_zero), (w, w_scale_v, w_zero) = a_dq.inputs[:3], w_dq.inputs[:3]
    inputs = [a, w, a_scale_v, w_scale_v, a_zero, w_zero, bias_value]
    fused = ir.Node(MS_DOMAIN, "MatMulIntegerToFloat", inputs, num_outputs=1, name=matmul.name)
    fused.metadata_props.update(matmul.metadata_props)
    new = fused.outputs[0]
    new.shape, new.type = result.shape, result.type
    adopt_name(result, new)
    result.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.insert_before(matmul, fused)
    graph.remove([matmul, add], safe=True)
    drop_if_unused(graph, given)
    for dq in (a_dq, w_dq):
        if not dq.outputs[0].uses() and not dq.outputs[0].is_graph_output():
            graph.remove(dq, safe=True)
    return True


def write_matmul_integer_to_float(model: ir.Model) -> int:
    """Rewrite every int8 MatMul of the main graph with a float output and a constant bias ``Add`` as a
    ``MatMulIntegerToFloat`` with its bias; returns how many."""
    graph = model.graph
    count = sum(_rewrite(graph, node) for node in [n for n in graph if is_op(n, "MatMul")])
    if count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return count
