"""A squeeze-and-excitation gate between int8 convolutions (MobileNetV3's and PP-OCR's shape: a spatial mean, two 1x1
convolutions, a HardSigmoid, the map multiplied by the result): on ONNX Runtime the gate's per-channel ops compute
in float where they stand (requant.targets.gates), the mean and the gating Mul stay int8."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import requant
from requant.quantizers.pattern_quantizer import KEPT_FLOAT_KEY
from requant.report.latency import session
from requant.targets.gates import REASON

C, HIDDEN = 8, 4


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "w0": (rng.standard_normal((C, 3, 3, 3)) * 0.4).astype(np.float32),
        "w1": (rng.standard_normal((HIDDEN, C, 1, 1)) * 0.5).astype(np.float32),
        "b1": (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((C, HIDDEN, 1, 1)) * 0.5).astype(np.float32),
        "b2": (rng.standard_normal(C) * 0.1).astype(np.float32),
        "w3": (rng.standard_normal((4, C, 1, 1)) * 0.4).astype(np.float32),
    }


def _model() -> onnx.ModelProto:
    inits = [nh.from_array(v, k) for k, v in _weights().items()]
    nodes = [
        h.make_node("Conv", ["X", "w0"], ["x"], pads=[1, 1, 1, 1], name="trunk"),
        h.make_node("GlobalAveragePool", ["x"], ["p"], name="mean"),
        h.make_node("Conv", ["p", "w1", "b1"], ["s1"], name="squeeze"),
        h.make_node("Relu", ["s1"], ["r"], name="relu"),
        h.make_node("Conv", ["r", "w2", "b2"], ["s2"], name="excite"),
        h.make_node("HardSigmoid", ["s2"], ["g"], alpha=1 / 6, beta=0.5, name="gate"),
        h.make_node("Mul", ["x", "g"], ["y"], name="scale"),
        h.make_node("Conv", ["y", "w3"], ["Y"], name="head"),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 12, 12])],
                         [h.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4, 12, 12])], inits)  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def _data(count: int) -> list[dict[str, Any]]:
    return [{"X": np.random.default_rng(i).standard_normal((1, 3, 12, 12)).astype(np.float32)} for i in range(count)]


def test_a_gates_per_channel_ops_compute_in_float_between_int8_kernels() -> None:
    data = _data(16)
    result = requant.quantize(_model(), data, measure=False, method="minmax")
    nodes = {n.name: n for n in result.model.graph}
    assert [nodes[n].op_type for n in ("squeeze", "relu", "excite", "gate")] == ["Conv", "Relu", "Conv", "HardSigmoid"]
    for conv in ("squeeze", "excite"):  # float weights: read as they were, no DequantizeLinear
        assert nodes[conv].inputs[1].const_value is not None
    lint = result.report["lint"]
    assert lint["int8_kernels"] == {"QLinearConv": 2, "QLinearGlobalAveragePool": 1, "QLinearMul": 1}
    assert all(nodes[n].metadata_props.get(KEPT_FLOAT_KEY) == REASON for n in ("squeeze", "relu", "excite", "gate"))
    # the report lists the chain between the mean's DequantizeLinear and the Mul's QuantizeLinear as ONNX Runtime
    # runs it (each 1x1 convolution fused with the activation after it), with why
    assert lint["kept_float_by_decision"] == [f"FusedConv '{name}': {REASON}" for name in ("squeeze", "excite")]
    # the gate is the float function of the dequantized mean, not rounded on the way
    w = _weights()
    exposed = ir.to_proto(result.model)
    names = [str(nodes["squeeze"].inputs[0].name), str(nodes["gate"].outputs[0].name)]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    runner = session(exposed)
    for sample in data[:4]:
        mean, gate = runner.run(names, sample)
        hidden = np.maximum(np.einsum("oc,nc->no", w["w1"][:, :, 0, 0], mean[:, :, 0, 0]) + w["b1"], 0)
        want = np.clip((np.einsum("oc,nc->no", w["w2"][:, :, 0, 0], hidden) + w["b2"]) / 6 + 0.5, 0, 1)
        assert np.allclose(gate[:, :, 0, 0], want, rtol=1e-5, atol=1e-6)


def test_a_gate_on_tosa_is_integer_like_everything_else() -> None:
    from requant.targets.registry import get_target

    assert get_target("tosa-int8").table.float_ops is None
