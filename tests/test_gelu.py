"""A GELU written out with erf between two int8 convolutions (PP-OCR's detector's shape, PaddlePaddle's order of
its ops): ordered as ONNX Runtime fuses it (requant.passes.order_gelu), kept float whole by the ONNX Runtime
table, and written as ONNX Runtime's one Gelu kernel reading the dequantized convolution output
(requant.backends.fused_gelu)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import requant
from requant.report.latency import session

CHANNELS = 6


def _model() -> onnx.ModelProto:
    """Conv -> x * (1 + erf(x / sqrt 2)) * 0.5 (PaddlePaddle's order) -> Conv, opset 14."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((CHANNELS, 3, 3, 3)) * 0.4).astype(np.float32)
    w2 = (rng.standard_normal((4, CHANNELS, 1, 1)) * 0.4).astype(np.float32)
    scalars = {"sqrt2": math.sqrt(2.0), "one": 1.0, "half": 0.5}
    inits = [nh.from_array(w1, "w1"), nh.from_array(w2, "w2")]
    inits += [nh.from_array(np.array(v, np.float32), k) for k, v in scalars.items()]
    nodes = [
        h.make_node("Conv", ["X", "w1"], ["x"], pads=[1, 1, 1, 1], name="conv1"),
        h.make_node("Div", ["x", "sqrt2"], ["t"], name="div"),
        h.make_node("Erf", ["t"], ["e"], name="erf"),
        h.make_node("Add", ["e", "one"], ["s"], name="add"),
        h.make_node("Mul", ["x", "s"], ["m"], name="mul"),
        h.make_node("Mul", ["m", "half"], ["g"], name="mul_half"),
        h.make_node("Conv", ["g", "w2"], ["Y"], name="conv2"),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 12, 12])],
                         [h.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4, 12, 12])], inits)  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 14)], ir_version=8)


def _data(count: int) -> list[dict[str, Any]]:
    return [{"X": np.random.default_rng(i).standard_normal((1, 3, 12, 12)).astype(np.float32)} for i in range(count)]


def test_a_written_out_gelu_between_int8_convolutions_runs_as_one_float_gelu() -> None:
    model, data = _model(), _data(16)
    result = requant.quantize(model, data, measure=False, method="minmax")
    nodes = list(result.model.graph)
    ops = [n.op_type for n in nodes]
    assert "Erf" not in ops and "Div" not in ops
    (gelu,) = [n for n in nodes if n.op_type == "Gelu"]
    assert gelu.domain == "com.microsoft"
    dequantize = gelu.inputs[0].producer()
    assert dequantize is not None and dequantize.op_type == "DequantizeLinear"
    assert [u.node.op_type for u in gelu.outputs[0].uses()] == ["QuantizeLinear"]
    assert ops.count("QLinearConv") + ops.count("Conv") == 2
    (kept,) = result.report["lint"]["kept_float_by_decision"]
    assert kept.startswith("Gelu 'mul_half': a GELU written out with erf: its five ops run as ONNX Runtime's one")
    # the GELU of the dequantized values, unrounded: the float function of its input (one step of rounding
    # inside it would be an error of scale / 2 or more)
    exposed = ir.to_proto(result.model)
    exposed.graph.output.extend(onnx.ValueInfoProto(name=str(v.name)) for v in (gelu.inputs[0], gelu.outputs[0]))
    runner = session(exposed)
    names = [str(gelu.inputs[0].name), str(gelu.outputs[0].name)]
    for sample in data[:4]:
        x, y = runner.run(names, sample)
        want = x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
        assert np.allclose(y, want, rtol=1e-5, atol=1e-6)


def test_onnx_runtime_runs_the_written_gelu_as_one_kernel(tmp_path: Any) -> None:
    result = requant.quantize(_model(), _data(16), measure=False, method="minmax")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ops.count("Gelu") == 1 and "Erf" not in ops and "Mul" not in ops
