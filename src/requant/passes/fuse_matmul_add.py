"""``fuse-matmul-add``: ``MatMul`` followed by a bias ``Add`` becomes one ``Gemm`` where that is legal.

Legal when the MatMul's input is 2-d, its weight is a constant 2-d tensor, its
result feeds only the Add, and the Add's other input is a constant that
broadcasts along the output's rows (shape ``[N]``, ``[1, N]`` or a scalar, or
exactly ``[M, N]`` when M is known). Gemm is one kernel (QGemm once quantized),
and the bias can then be quantized to int32 with the weights. Recurses into
subgraphs.

Invariant after: no such MatMul/Add pair remains.

Before::

    %M: tensor<Bx4xf32> = MatMul(%X, %W)
    %Y: tensor<Bx4xf32> = Add(%M, %bias)

After::

    %Y: tensor<Bx4xf32> = Gemm(%X, %W, %bias)
"""

from __future__ import annotations

import onnx_ir as ir

from requant.ir.annotations import replace_value
from requant.passes._base import NodeRewrite
from requant.passes._rewrite import adopt_name, constant, is_op

__all__ = ["PASS", "FuseMatMulAdd"]


def _fuse(matmul: ir.Node) -> bool:
    a, w = matmul.inputs[0], matmul.inputs[1]
    out = matmul.outputs[0]
    weight = constant(w)
    if a is None or w is None or weight is None or weight.ndim != 2:
        return False
    if a.shape is None or len(a.shape) != 2 or out.is_graph_output() or len(out.uses()) != 1:
        return False
    add = next(iter(out.uses())).node
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return False
    bias_value = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    bias = constant(bias_value)
    if bias is None or bias_value is None:
        return False
    n = weight.shape[1]
    m = a.shape[0] if isinstance(a.shape[0], int) else None
    allowed = {(), (n,), (1, n)} | ({(m, n), (m, 1)} if m is not None else set())
    if tuple(bias.shape) not in allowed:
        return False
    graph = matmul.graph
    assert graph is not None
    gemm = ir.Node("", "Gemm", inputs=[a, w, bias_value], num_outputs=1, name=matmul.name or None)
    result = gemm.outputs[0]
    adopt_name(add.outputs[0], result)
    graph.insert_before(add, gemm)
    result.shape, result.type = add.outputs[0].shape, add.outputs[0].type
    replace_value(add.outputs[0], result)
    graph.remove([add, matmul], safe=True)
    return True


class FuseMatMulAdd(NodeRewrite):
    name = "fuse-matmul-add"
    op_type = "MatMul"

    def rewrite(self, node: ir.Node) -> bool:
        return _fuse(node)


PASS = FuseMatMulAdd
