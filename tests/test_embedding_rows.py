"""An int8 embedding table whose rows only float ops read becomes GatherBlockQuantized rows
(requant.backends.embedding_rows): LAC's tagger's shape, a table, a Transpose, a float GRU, an int8 MatMul."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import requant
from requant.backends.embedding_rows import BLOCK
from requant.report.latency import session

ROWS, WIDTH, TOKENS = 64, 64, 12


def _tagger(direct: bool) -> onnx.ModelProto:
    """Token ids -> embedding rows (each row its own range: 0.05-3) -> a GRU -> an int8 MatMul; ``direct``:
    the MatMul reads the rows themselves."""
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((ROWS, WIDTH)) * rng.uniform(0.05, 3, (ROWS, 1))).astype(np.float32)
    w = (rng.standard_normal((WIDTH if direct else 8, 5)) * 0.3).astype(np.float32)
    inits = [nh.from_array(table, "table"), nh.from_array(w, "w"), nh.from_array(np.array([1], np.int64), "one")]
    gather = h.make_node("Gather", ["table", "ids"], ["rows"], name="gather")
    if direct:
        nodes, out = [gather, h.make_node("MatMul", ["rows", "w"], ["y"], name="mm")], [1, TOKENS, 5]
    else:
        inits += [nh.from_array((rng.standard_normal((1, 24, WIDTH)) * 0.3).astype(np.float32), "W"),
                  nh.from_array((rng.standard_normal((1, 24, 8)) * 0.3).astype(np.float32), "R")]  # fmt: skip
        nodes = [
            gather,
            h.make_node("Transpose", ["rows"], ["t"], perm=[1, 0, 2], name="tr"),
            h.make_node("GRU", ["t", "W", "R"], ["all", "last"], hidden_size=8, name="gru"),
            h.make_node("Squeeze", ["all", "one"], ["sq"], name="sq"),
            h.make_node("MatMul", ["sq", "w"], ["y"], name="mm"),
        ]
        out = [TOKENS, 1, 5]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", TensorProto.INT64, [1, TOKENS])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def _ids(count: int) -> list[dict[str, Any]]:
    return [{"ids": np.random.default_rng(i).integers(0, ROWS, (1, TOKENS)).astype(np.int64)} for i in range(count)]


def test_a_table_read_by_float_ops_only_is_gathered_in_rows_of_its_own_scales() -> None:
    model, data = _tagger(direct=False), _ids(16)
    result = requant.quantize(model, data, measure=False, method="minmax")
    nodes = list(result.model.graph)
    (gather,) = [n for n in nodes if n.op_type == "GatherBlockQuantized"]
    assert gather.domain == "com.microsoft" and gather.attributes.get_int("block_size") == BLOCK
    assert gather.attributes.get_int("bits") == 8
    # the rows reach the GRU float: no QuantizeLinear -> DequantizeLinear between them
    assert [n.op_type for n in nodes[nodes.index(gather) + 1 :][:2]] == ["Transpose", "GRU"]
    (record,) = result.report["embedding_rows"]
    assert record["table"] == "table" and (record["n"], record["k"]) == (ROWS, WIDTH)
    assert "embedding tables in 8-bit blocks of 32 along each row" in result.report["summary"]
    # each gathered row within half a step of its own block's scale (rows 0.05-3: one scale would be 60x coarser)
    table = nh.to_array(next(t for t in model.graph.initializer if t.name == "table"))
    exposed = ir.to_proto(result.model)
    exposed.graph.output.append(onnx.ValueInfoProto(name=gather.outputs[0].name))
    runner = session(exposed)
    for sample in data[:4]:
        rows = runner.run([str(gather.outputs[0].name)], sample)[0][0]
        want = table[sample["ids"][0]]
        steps = np.ptp(want.reshape(TOKENS, -1, BLOCK), axis=2, keepdims=True) / 255
        err = np.abs(rows - want).reshape(TOKENS, -1, BLOCK)
        assert np.all(err <= steps / 2 + 1e-6)


def test_a_table_an_int8_kernel_reads_keeps_one_scale() -> None:
    result = requant.quantize(_tagger(direct=True), _ids(16), measure=False, method="minmax")
    ops = [n.op_type for n in result.model.graph]
    assert "GatherBlockQuantized" not in ops and "Gather" in ops
    assert result.report["embedding_rows"] == []
