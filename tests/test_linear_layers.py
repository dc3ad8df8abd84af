"""Linear layers on 3-d inputs with static shapes: ONNX Runtime rewrites ``MatMul -> Add`` into
``Reshape -> Gemm -> Reshape`` before fusing QDQ, which can leave the Gemm in float. requant's
output keeps both kinds of layer int8 (a quantized output: QGemm; a float output: MatMulIntegerToFloat,
which requant writes itself with the bias), and lint names a layer that ONNX Runtime runs as a float
Gemm."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import requant
from requant.report.lint import lint

S, D, F = 16, 32, 64


def _feed_forward() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.2, (D, F)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.1, (F,)).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 0.2, (F, D)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.1, (D,)).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="mm2"),
        helper.make_node("Add", ["m2", "b2"], ["y"], name="add2"),
    ]
    graph = helper.make_graph(
        nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, S, D])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray, level: Any = ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> Any:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _quantized() -> tuple[onnx.ModelProto, np.ndarray]:
    calibration = np.random.default_rng(1).normal(size=(16, S, D)).astype(np.float32)
    quantized = requant.quantize(_feed_forward(), {"x": calibration}, measure=False)
    report = quantized.report["lint"]
    assert report["int8_kernels"] == {"QGemm": 1, "MatMulIntegerToFloat": 1}
    assert report["asked_to_be_quantized_but_float"] == []
    return ir.serde.serialize_model(quantized.model), calibration


def test_static_3d_linear_layers_run_as_int8_kernels_computing_what_the_qdq_graph_says() -> None:
    model, _ = _quantized()
    x = np.random.default_rng(2).normal(size=(1, S, D)).astype(np.float32)
    fused = _run(model, x)
    written = _run(model, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)  # every op as written, in float
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    hidden_scale = float(weights["r1_scale"])
    w2 = weights["w2_quantized"].astype(np.float64) * weights["w2_scale"].astype(np.float64)
    # the int8 kernels may round the hidden layer one step apart from float math: that step times a column
    bound = hidden_scale * np.abs(w2).sum(axis=0).max() + 1e-4
    assert np.abs(fused - written).max() <= bound
    assert np.abs(fused - _run(_feed_forward(), x)).max() < 0.2  # and close to the float model


def _as_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with requant's MatMulIntegerToFloat (bias included) written back as the QDQ form other
    tools write: DequantizeLinear -> MatMul -> Add, the bias a vector."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMulIntegerToFloat":
            continue
        a, w, a_scale, w_scale, a_zero, w_zero, bias = node.input
        qdq = [
            helper.make_node("DequantizeLinear", [a, a_scale, a_zero], [f"{a}_dq"]),
            helper.make_node("DequantizeLinear", [w, w_scale, w_zero], [f"{w}_dq"], axis=1),
            helper.make_node("MatMul", [f"{a}_dq", f"{w}_dq"], [f"{node.name}_out"], name=node.name),
            helper.make_node("Add", [f"{node.name}_out", bias], list(node.output)),
        ]
        qdq[2].metadata_props.extend(node.metadata_props)  # the quantizer's decision, for lint
        del graph.node[index]
        for offset, new in enumerate(qdq):
            graph.node.insert(index + offset, new)
        break
    return model


def test_the_bias_added_in_matmulintegertofloat_gives_the_qdq_forms_numbers() -> None:
    model, _ = _quantized()
    assert [n.op_type for n in model.graph.node].count("Add") == 1  # the first layer's: its sum is quantized
    x = np.random.default_rng(3).normal(size=(1, S, D)).astype(np.float32)
    fused, written = _run(model, x), _run(_as_qdq(model), x)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    bias = np.abs(weights["b2"]).max()
    assert np.abs(fused - written).max() <= 4 * np.finfo(np.float32).eps * (np.abs(written).max() + bias)


def test_lint_names_a_linear_layer_onnx_runtime_runs_as_a_float_gemm() -> None:
    model = _as_qdq(_quantized()[0])  # the QDQ form with a vector bias: ONNX Runtime makes it a Gemm first
    result = lint(model)
    assert result.int8_kernels == {"QGemm": 1}
    assert result.asked_but_float == ["MatMul 'mm2' (runs as Gemm 'mm2/MatMulAddFusion')"]
