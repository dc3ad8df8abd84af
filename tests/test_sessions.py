"""The models requant hands ONNX Runtime: a refusal is a requant error naming the stage, the node and its
inputs' shapes (never ONNX Runtime's traceback); a model that draws random numbers is compared with float
on the same noise and written as it draws; an output whose size depends on its values is compared where
float and int8 both computed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import requant
from requant.runtime import SessionError
from requant.stages import check as check_stage

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


def _with_a_bad_concat(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with a Concat of its rank-4 input and a rank-2 value (declared rank 1) as an output: no model."""
    broken = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = broken.graph
    graph.initializer.extend([nh.from_array(np.zeros(1, np.float32), "pad"), nh.from_array(np.zeros(1, np.int64), "axes")])
    graph.node.extend([
        oh.make_node("Unsqueeze", ["pad", "axes"], ["bad_pad"], name="/bad/Unsqueeze"),
        oh.make_node("Concat", [graph.input[0].name, "bad_pad"], ["bad_out"], name="/bad/Concat", axis=0),
    ])  # fmt: skip
    graph.value_info.append(oh.make_tensor_value_info("bad_pad", TensorProto.FLOAT, [1]))
    graph.output.append(oh.make_empty_tensor_value_info("bad_out"))
    return broken


def test_a_model_onnx_runtime_refuses_is_an_error_naming_the_stage_the_node_and_its_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage handing ONNX Runtime a model it refuses (here the evaluation's, made wrong on purpose) stops
    the run with a SessionError, not ONNX Runtime's Fail: the stage, the node and its inputs' shapes."""
    opened = check_stage.session
    monkeypatch.setattr(check_stage, "session", lambda proto: opened(_with_a_bad_concat(proto)))
    with pytest.raises(SessionError) as error:
        requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz", measure=False)
    message = str(error.value)
    assert message.startswith("evaluation (the quantized model against float on the evaluation data): ONNX Runtime")
    assert "at Concat '/bad/Concat'" in message
    assert "x: [batch, 1, 8, 8]" in message, message
    assert "bad_pad: [1], but its graph computes [1, 1]: this value's declared shape is wrong" in message, message
    assert "requant's fault" in message


def _noisy(noise: float) -> onnx.ModelProto:
    """y = relu(x @ W) + noise * N(0, 1) (a RandomNormalLike without a seed), and the entries of y above
    1 (a Compress: how many depends on the values)."""
    rng = np.random.default_rng(0)
    weights = nh.from_array(rng.standard_normal((32, 64)).astype(np.float32) / 4, "W")
    nodes = [
        oh.make_node("MatMul", ["x", "W"], ["m"], name="/mm"),
        oh.make_node("Relu", ["m"], ["r"], name="/relu"),
        oh.make_node("RandomNormalLike", ["r"], ["n"], name="/noise", dtype=TensorProto.FLOAT),
        oh.make_node("Mul", ["n", "scale"], ["ns"], name="/scaled"),
        oh.make_node("Add", ["r", "ns"], ["y"], name="/add"),
        oh.make_node("Reshape", ["y", "flat"], ["yf"], name="/flat"),
        oh.make_node("Greater", ["yf", "cut"], ["big"], name="/big"),
        oh.make_node("Compress", ["yf", "big"], ["above"], name="/above", axis=0),
    ]
    constants = [
        weights,
        nh.from_array(np.array(noise, np.float32), "scale"),
        nh.from_array(np.array([-1], np.int64), "flat"),
        nh.from_array(np.array(1.0, np.float32), "cut"),
    ]
    graph = oh.make_graph(
        nodes, "noisy", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64]),
         oh.make_tensor_value_info("above", TensorProto.FLOAT, ["K"])], constants,
    )  # fmt: skip
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_a_model_drawing_random_numbers_is_compared_on_the_same_noise_and_written_as_it_draws() -> None:
    """Float's and int8's runs see the same noise (each random op seeded while requant works), so the
    agreement measures quantization alone: SQNR far above the noise's own (measured 26.5 dB; noise at a third
    of the signal's scale, unseeded, gave 7.9 dB); the written model's RandomNormalLike has no seed; the
    summary says so; the Compress output, as long as its values say, is compared where both computed."""
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((1, 32)).astype(np.float32)} for _ in range(16)]
    evaluation = [{"x": rng.standard_normal((1, 32)).astype(np.float32)} for _ in range(16)]
    result = requant.quantize(_noisy(0.3), calib, eval_data=evaluation, measure=False)
    assert result.report["quantizers"]["random_seeded"] == ["/noise"]
    assert result.report["evaluation"]["sqnr_db"] > 20, result.report["evaluation"]
    written = onnx.ModelProto.FromString(ir.to_proto(result.model).SerializeToString())
    noise = next(n for n in written.graph.node if n.op_type == "RandomNormalLike")
    assert [a.name for a in noise.attribute] == ["dtype"] and not noise.metadata_props
    assert "random ops: 1 (/noise) drew from fixed seeds" in result.report["summary"]
    above = [p for p in result.report["outputs"]["parts"] if p["output"] == "above"]
    assert above[0]["shapes_differ"] >= 1 and above[0]["sqnr_db"] > 10, above  # measured: 2 samples, 23.3 dB


def test_convolutions_sharing_one_bias_initializer_all_run_int8() -> None:
    """Three convolutions reading one bias initializer (torch's TorchScript exporter shares identical zero
    biases): each gets its own int32 bias at its own scale, and ONNX Runtime runs all three int8 (before, one
    bias at the first conv's scale: the others ran in float between their DequantizeLinears)."""
    rng = np.random.default_rng(0)
    weights = [nh.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) / 8, f"W{i}") for i in range(3)]
    nodes = [
        oh.make_node("Conv", ["x", "W0", "b"], ["c0"], name="/c0", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c0"], ["r0"], name="/r0"),
        oh.make_node("Conv", ["r0", "W1", "b"], ["c1"], name="/c1", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"], name="/r1"),
        oh.make_node("Conv", ["r1", "W2", "b"], ["y"], name="/c2", pads=[1, 1, 1, 1]),
    ]
    graph = oh.make_graph(
        nodes, "shared", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 16, 16])],
        [*weights, nh.from_array(np.zeros(8, np.float32), "b")],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    calib = [{"x": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(8)]
    result = requant.quantize(model, calib, measure=False)
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 3}, result.report["lint"]["int8_kernels"]


def test_a_3d_convolution_runs_int8_in_onnx_runtime() -> None:
    """ONNX Runtime 1.31's QLinearConv runs 3-d convolutions (TransNetV2's 48: 0.40x float's latency once
    quantized); the table refused them as 1-d or 2-d only."""
    rng = np.random.default_rng(0)
    weight = nh.from_array(rng.standard_normal((8, 4, 3, 3, 3)).astype(np.float32) / 6, "W")
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "W"], ["c"], name="/c3d", pads=[1] * 6), oh.make_node("Relu", ["c"], ["y"])],
        "c3d", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 6, 8, 8])], [weight],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    calib = [{"x": rng.standard_normal((1, 4, 6, 8, 8)).astype(np.float32)} for _ in range(8)]
    result = requant.quantize(model, calib, eval_data=calib, measure=False)
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 1}, result.report["lint"]
    assert result.report["evaluation"]["sqnr_db"] > 30, result.report["evaluation"]


def test_requant_threads_caps_every_session_and_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from requant.errors import RequantError
    from requant.runtime import cpu_session

    monkeypatch.setenv("REQUANT_THREADS", "1")
    for asked in (0, 2):  # ONNX Runtime's default, and a session that asks for more (the latency measurement's)
        options = ort.SessionOptions()
        options.intra_op_num_threads = asked
        cpu_session(str(DIGITS / "digits_cnn.onnx"), options)
        assert options.intra_op_num_threads == 1
    monkeypatch.setenv("REQUANT_THREADS", "two")
    with pytest.raises(RequantError, match="REQUANT_THREADS='two': expected a whole number of threads, at least 1"):
        cpu_session(str(DIGITS / "digits_cnn.onnx"), ort.SessionOptions())
