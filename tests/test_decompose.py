"""Decompositions: the composite quantizer's first run rewrites ops the target has no int8 kernel for."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

import requant.api
from requant.frontends import load_onnx_text
from requant.passes import get_passes, run_passes
from requant.quantizers import DEFAULT_PRESET, PRESETS, Quantizer

MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,2,4,4] X) => (float[N,2,4,4] Y, float[N,2,4,4] Z) {
    W = Constant <value = float[2,2,1,1] {1.0, -0.5, 0.25, 2.0}> ()
    c = Conv(X, W)
    two = Constant <value = float {2.0}> ()
    d = Div(c, two)
    g1 = Constant <value = float[2] {1.5, 0.5}> ()
    b1 = Constant <value = float[2] {0.1, -0.2}> ()
    m1 = Constant <value = float[2] {0.0, 0.3}> ()
    v1 = Constant <value = float[2] {1.0, 4.0}> ()
    n = BatchNormalization(d, g1, b1, m1, v1)
    r = Relu(n)
    Y = Conv(r, W)
    q = Div(c, X)
    third = Constant <value = float {0.5}> ()
    Z = Sub(q, third)
}
"""


def prepared() -> ir.Model:
    model, _ = run_passes(load_onnx_text(MODEL), get_passes("canonicalize"))
    return model


def outputs(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})  # type: ignore[no-any-return]


def test_first_run_decomposes_what_a_config_selects_and_says_why() -> None:
    x = np.random.default_rng(0).uniform(0.5, 2.0, (4, 2, 4, 4)).astype(np.float32)
    model = prepared()
    before = outputs(model, x)
    done, kept = Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(model)
    assert [(d["node"], d["into"]) for d in done] == [
        ("Div 'node_1'", "Mul 'node_1'"),
        ("BatchNormalization 'node_2'", "Mul 'node_2', Add 'node_2_add'"),
        ("Sub 'node_6'", "Add 'node_6'"),
    ]
    assert done[0]["why"] == (
        "ONNXRUNTIME_CPU_SUPPORT: no int8 Div kernel; dividing by a constant is multiplying by its reciprocal"
    )
    assert kept == [
        {
            "node": "Div 'node_5'",
            "reason": "not decomposed into Mul: its second input is not a constant: "
            "Div of two activations has no int8 kernel",
        }
    ]
    assert [n.op_type for n in model.graph] == ["Conv", "Mul", "Mul", "Add", "Relu", "Conv", "Div", "Add"]
    assert {str(v) for v in model.graph.initializers} >= {"two_reciprocal", "n_scale", "n_shift", "third_negated"}
    assert not {"two", "g1", "b1", "m1", "v1", "third"} & set(model.graph.initializers)  # replaced constants go
    for a, b in zip(before, outputs(model, x), strict=True):  # the same function, in float
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_node_kept_float_is_not_decomposed() -> None:
    model = prepared()
    done, kept = (
        Quantizer().set_global(PRESETS[DEFAULT_PRESET]).set_op_type("BatchNormalization", None).decompose(model)
    )
    assert [d["node"] for d in done] == ["Div 'node_1'", "Sub 'node_6'"] and [k["node"] for k in kept] == [
        "Div 'node_5'"
    ]
    assert "BatchNormalization" in [n.op_type for n in model.graph]


def test_decomposed_ops_become_int8_kernels() -> None:
    x = np.random.default_rng(1).uniform(0.5, 2.0, (32, 2, 4, 4)).astype(np.float32)
    proto = onnx.parser.parse_model(MODEL)
    result = requant.api.quantize(proto, {"X": x}, measure=False)
    report = result.report
    assert [d["into"] for d in report["quantizers"]["decomposed"]] == [
        "Mul 'node_1'", "Mul 'node_2', Add 'node_2_add'", "Add 'node_6'",
    ]  # fmt: skip
    lint = report["lint"]
    assert lint["int8_kernels"] == {"QLinearConv": 2, "QLinearMul": 2, "QLinearAdd": 2}
    assert lint["float_between_dequantize_and_quantize"] == ["Div 'node_5'"]  # two activations: no kernel
    float_y = outputs(load_onnx_text(MODEL), x)[0]
    (int8_y, _) = outputs(result.model, x)
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in ir.to_proto(result.model).graph.initializer}
    y_scale = float(scales["Y_scale"])
    # five requantizations (c, d, the Mul, the Add+Relu, Y) of at most half a step each, carried through
    assert np.abs(int8_y - float_y).max() <= 8 * y_scale


BATCHNORMS = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,2,4,4] X, float[2] mean) => (float[N,2,4,4] A, float[N,2,4,4] B) {
    g1 = Constant <value = float[2] {1.5, 0.5}> ()
    b1 = Constant <value = float[2] {0.1, -0.2}> ()
    m1 = Constant <value = float[2] {0.0, 0.3}> ()
    v1 = Constant <value = float[2] {1.0, 4.0}> ()
    A = BatchNormalization(X, g1, b1, mean, v1)
    B, rm, rv = BatchNormalization <training_mode = 1> (X, g1, b1, m1, v1)
}
"""


def test_every_reason_a_batch_norm_is_kept() -> None:
    model, _ = run_passes(load_onnx_text(BATCHNORMS), get_passes("canonicalize"))
    done, kept = Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(model)
    assert done == []
    assert [k["reason"] for k in kept] == [
        "not decomposed into Mul -> Add: its scale, bias, mean or variance is not a constant",
        "not decomposed into Mul -> Add: it is in training mode",
    ]
