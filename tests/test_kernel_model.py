"""The kernel model of ONNX Runtime on x86 against ONNX Runtime's own int8 kernels, bit for bit.

Each case builds one kernel with adversarial inputs (many at 255) and weights (many at +-127 and
-128), runs it in ONNX Runtime, and compares its output with requant's reference of the kernel
(``Accumulation.dot`` in the kernel model's reduction order): the reference with int16 pair sums
must match exactly, and the exact int32 one must not where pairs saturate (and the other way round
for the kernels that add in int32). Outputs are kept exact: MatMulInteger and QGemm without an
output scale give the accumulator itself; QLinearConv and QLinearMatMul requantize by a power of
two, which float32 computes exactly. What this CPU computes is the host's model
(``host_kernel_model``): int16 pairs without VNNI, exact int32 with it; either way the other
accumulation must give other outputs, so each case checks the host's rule both ways.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from requant.targets.kernels import (
    ONNXRUNTIME_X86,
    ONNXRUNTIME_X86_AMX,
    ONNXRUNTIME_X86_VNNI,
    Reduction,
    host_kernel_model,
    is_depthwise,
)
from requant.types.accumulation import INT16_PAIRS, INT32, Accumulation
from tests.host import HOST, MASKED, mlas_took_amx

RNG_SEED = 7


def _on_host(op_type: str, depthwise: bool = False) -> tuple[Accumulation, Accumulation]:
    """This CPU's accumulation of uint8 x int8 ``op_type``, and the other one."""
    rule = HOST.find(op_type, "u8", "i8", depthwise)
    assert rule is not None
    return rule.accumulation, (INT16_PAIRS if rule.accumulation is INT32 else INT32)


OUTPUTS = {"QLinearConv": TensorProto.UINT8, "QLinearMatMul": TensorProto.UINT8, "MatMulInteger": TensorProto.INT32,
           "MatMulIntegerToFloat": TensorProto.FLOAT, "QGemm": TensorProto.FLOAT}  # fmt: skip


def _session(node: Any, inputs: list[Any], inits: list[Any], optimized: bool = True, threads: int = 2) -> Any:
    output = helper.make_tensor_value_info("y", OUTPUTS[node.op_type], None)
    graph = helper.make_graph([node], "g", inputs, [output], inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _adversarial(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max + 1, shape)
    values[rng.random(shape) < 0.35] = info.max
    if info.min < 0:
        values[rng.random(shape) < 0.15] = info.min
    return values.astype(dtype)


def _scalar(name: str, value: float, dtype: Any = np.float32) -> Any:
    return numpy_helper.from_array(np.array(value, dtype), name)


def _im2col(x: np.ndarray, kernel: int, stride: int, pad: int, group: int) -> np.ndarray:
    """``[group, positions, kernel * kernel * Cin/group]``: NHWC im2col, the order MLAS reduces in
    (kernel positions row by row, then the group's input channels); padding reads 0 (the zero point)."""
    channels, height, _ = x.shape[1:]
    padded = np.pad(x[0].astype(np.int64), ((0, 0), (pad, pad), (pad, pad)))
    out = (height + 2 * pad - kernel) // stride + 1
    per_group = channels // group
    cols = np.zeros((group, out * out, kernel * kernel * per_group), np.int64)
    for g in range(group):
        for i in range(out):
            for j in range(out):
                patch = padded[g * per_group : (g + 1) * per_group, i * stride : i * stride + kernel,
                               j * stride : j * stride + kernel]  # fmt: skip
                cols[g, i * out + j] = np.moveaxis(patch, 0, -1).reshape(-1)
    return cols


def _conv_reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray, stride: int, pad: int, group: int,
                    shift: int, accumulation: Any) -> np.ndarray:  # fmt: skip
    cols = _im2col(x, w.shape[-1], stride, pad, group)
    rows = Reduction("Conv", w.shape, group=group).rows(w.astype(np.int64))
    per_group = w.shape[0] // group
    acc = np.concatenate(
        [accumulation.dot(cols[g], rows[g * per_group : (g + 1) * per_group].T) for g in range(group)], axis=1
    )  # [positions, Cout]
    scaled = (acc + bias).astype(np.float32) * np.float32(2.0**-shift)
    out = np.clip(np.rint(scaled) + 128, 0, 255).astype(np.uint8)
    side = int(np.sqrt(out.shape[0]))
    return out.T.reshape(1, w.shape[0], side, side)


CONVS = [
    # name, Cin, Cout, kernel, group, stride, size: every path MLAS has for QLinearConv
    ("pointwise (ConvSym, direct)", 16, 16, 1, 1, 1, 6),
    ("3x3 (ConvSym, indirection)", 8, 16, 3, 1, 1, 6),
    ("3x3 Cin 3 stride 2 (QGEMM: Cin not a multiple of 4)", 3, 8, 3, 1, 2, 7),
    ("3x3 Cin 5 (QGEMM: pairs cross kernel positions)", 5, 16, 3, 1, 1, 5),
    ("1x1 Cout 12 (QGEMM: Cout not a multiple of 8)", 8, 12, 1, 1, 1, 6),
    ("grouped 3x3, 2 groups (one QGEMM per group)", 16, 16, 3, 2, 1, 5),
    ("grouped 1x1, 3 groups", 12, 24, 1, 3, 1, 5),
    ("depthwise 3x3, 16 channels (ConvSym depthwise)", 16, 16, 3, 16, 1, 6),
    ("depthwise 3x3, 8 channels (generic depthwise)", 8, 8, 3, 8, 1, 6),
    ("depthwise 5x5 stride 2", 16, 16, 5, 16, 2, 9),
    ("channel multiplier 2 (not depthwise: QGEMM per group)", 8, 16, 3, 8, 1, 5),
    ("one input and one output channel (the depthwise path)", 1, 1, 3, 1, 1, 5),
]


@pytest.mark.parametrize("optimized", [False, True], ids=["basic", "nhwc"])
@pytest.mark.parametrize(("name", "cin", "cout", "kernel", "group", "stride", "size"), CONVS, ids=[c[0] for c in CONVS])
def test_qlinearconv_accumulates_as_the_kernel_model_says(
    name: str, cin: int, cout: int, kernel: int, group: int, stride: int, size: int, optimized: bool
) -> None:
    rng = np.random.default_rng(RNG_SEED)
    x = _adversarial(rng, (1, cin, size, size), np.uint8)
    w = _adversarial(rng, (cout, cin // group, kernel, kernel), np.int8)
    bias = rng.integers(-5000, 5000, cout).astype(np.int32)
    pad, shift = kernel // 2, 11
    inits = [
        _scalar("xs", 1.0), _scalar("xz", 0, np.uint8), numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.ones(cout, np.float32), "ws"), numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
        _scalar("ys", 2.0**shift), _scalar("yz", 128, np.uint8), numpy_helper.from_array(bias, "b"),
    ]  # fmt: skip
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"], group=group,
                            strides=[stride] * 2, pads=[pad] * 4, kernel_shape=[kernel] * 2)  # fmt: skip
    x_info = helper.make_tensor_value_info("x", TensorProto.UINT8, list(x.shape))
    (y,) = _session(node, [x_info], inits, optimized).run(None, {"x": x})
    depthwise = is_depthwise(w.shape, group)
    rule = ONNXRUNTIME_X86.find("Conv", "u8", "i8", depthwise)
    assert rule is not None and rule.accumulation is (INT32 if depthwise else INT16_PAIRS)
    host, other = _on_host("Conv", depthwise)
    modelled = _conv_reference(x, w, bias, stride, pad, group, shift, host)
    assert (y == modelled).all(), f"{name}: {(y != modelled).sum()} outputs differ from the kernel model"
    assert (y != _conv_reference(x, w, bias, stride, pad, group, shift, other)).sum() > y.size // 10


def test_the_exact_twin_computes_what_a_vnni_cpu_computes() -> None:
    """``exact_twin`` stores a QDQ model's int8 GEMM weights as uint8 + 128: on any CPU ONNX Runtime
    then gives the int32 sums (the exact reference), where the model as written follows the host."""
    from requant.runtime import exact_twin

    rng = np.random.default_rng(RNG_SEED)
    cin, cout, shift = 8, 16, 11
    x = _adversarial(rng, (1, cin, 6, 6), np.uint8)
    w = _adversarial(rng, (cout, cin, 3, 3), np.int8)
    bias = rng.integers(-5000, 5000, cout).astype(np.int32)
    nodes = [
        helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
        helper.make_node("DequantizeLinear", ["b", "ws"], ["bf"], axis=0),
        helper.make_node("Conv", ["xf", "wf", "bf"], ["yf"], pads=[1] * 4, kernel_shape=[3, 3]),
        helper.make_node("QuantizeLinear", ["yf", "ys", "yz"], ["y"]),
    ]
    inits = [
        _scalar("xs", 1.0), _scalar("xz", 0, np.uint8), numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.ones(cout, np.float32), "ws"), numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
        numpy_helper.from_array(bias, "b"), _scalar("ys", 2.0**shift), _scalar("yz", 128, np.uint8),
    ]  # fmt: skip
    x_info = helper.make_tensor_value_info("x", TensorProto.UINT8, list(x.shape))
    y_info = helper.make_tensor_value_info("y", TensorProto.UINT8, None)
    model = helper.make_model(helper.make_graph(nodes, "g", [x_info], [y_info], inits),
                              opset_imports=[helper.make_opsetid("", 21)])  # fmt: skip
    model.ir_version = 10

    def run(proto: Any) -> np.ndarray:
        s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.asarray(s.run(None, {"x": x})[0])

    host, _ = _on_host("Conv")
    exact = _conv_reference(x, w, bias, 1, 1, 1, shift, INT32)
    assert (run(model) == _conv_reference(x, w, bias, 1, 1, 1, shift, host)).all()
    assert (run(exact_twin(model)) == exact).all()
    assert (_conv_reference(x, w, bias, 1, 1, 1, shift, INT16_PAIRS) != exact).sum() > exact.size // 10  # adversarial


@pytest.mark.parametrize(("m", "k", "n"), [(1, 8, 4), (5, 13, 7), (24, 300, 17)])
def test_matmulinteger_and_matmulintegertofloat_pair_along_k(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(RNG_SEED)
    a, w = _adversarial(rng, (m, k), np.uint8), _adversarial(rng, (k, n), np.int8)
    a_info = helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])
    integer = _session(
        helper.make_node("MatMulInteger", ["a", "w"], ["y"]), [a_info], [numpy_helper.from_array(w, "w")]
    )
    to_float = _session(
        helper.make_node("MatMulIntegerToFloat", ["a", "w", "one", "one"], ["y"], domain="com.microsoft"),
        [a_info], [numpy_helper.from_array(w, "w"), _scalar("one", 1.0)],
    )  # fmt: skip
    host, other = _on_host("MatMul")
    assert not (host.dot(a, w) == other.dot(a, w)).all()
    for session in (integer, to_float):
        (y,) = session.run(None, {"a": a})
        assert (y == host.dot(a, w)).all()


@pytest.mark.parametrize(("m", "k", "n"), [(1, 10, 6), (7, 33, 20)])
def test_qgemm_pairs_the_raw_inputs_and_removes_the_zero_point_after(m: int, k: int, n: int) -> None:
    """The kernel multiplies the stored uint8 values; the zero point (77) comes off through row sums."""
    rng = np.random.default_rng(RNG_SEED)
    a, w = _adversarial(rng, (m, k), np.uint8), _adversarial(rng, (n, k), np.int8)
    inits = [_scalar("as", 1.0), _scalar("az", 77, np.uint8), numpy_helper.from_array(w, "w"), _scalar("ws", 1.0),
             _scalar("wz", 0, np.int8)]  # fmt: skip
    node = helper.make_node("QGemm", ["a", "as", "az", "w", "ws", "wz"], ["y"], domain="com.microsoft", transB=1)
    (y,) = _session(node, [helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])], inits).run(None, {"a": a})
    rows = Reduction("Gemm", w.shape, trans_b=True).rows(w.astype(np.int64))
    correction = 77 * rows.sum(axis=1)
    host, other = _on_host("Gemm")
    assert (y == host.dot(a, rows.T) - correction).all()
    assert not (y == other.dot(a, rows.T) - correction).all()


def test_qlinearmatmul_pairs_along_k() -> None:
    rng = np.random.default_rng(RNG_SEED)
    a, w = _adversarial(rng, (9, 40), np.uint8), _adversarial(rng, (40, 16), np.int8)
    inits = [_scalar("as", 1.0), _scalar("az", 0, np.uint8), numpy_helper.from_array(w, "w"), _scalar("ws", 1.0),
             _scalar("wz", 0, np.int8), _scalar("ys", 1024.0), _scalar("yz", 128, np.uint8)]  # fmt: skip
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "w", "ws", "wz", "ys", "yz"], ["y"])
    (y,) = _session(node, [helper.make_tensor_value_info("a", TensorProto.UINT8, [9, 40])], inits).run(None, {"a": a})

    def requantized(acc: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(acc.astype(np.float32) / np.float32(1024)) + 128, 0, 255)

    host, other = _on_host("MatMul")
    assert (y == requantized(host.dot(a, w))).all()
    assert not (y == requantized(other.dot(a, w))).all()


@pytest.mark.parametrize(("inputs", "weights"), [(np.uint8, np.uint8), (np.int8, np.int8)], ids=["u8u8", "s8s8"])
def test_same_signedness_kernels_add_in_int32(inputs: Any, weights: Any) -> None:
    rng = np.random.default_rng(RNG_SEED)
    a, w = _adversarial(rng, (6, 32), inputs), _adversarial(rng, (32, 9), weights)
    kind = TensorProto.UINT8 if inputs is np.uint8 else TensorProto.INT8
    node = helper.make_node("MatMulInteger", ["a", "w"], ["y"])
    (y,) = _session(node, [helper.make_tensor_value_info("a", kind, [6, 32])], [numpy_helper.from_array(w, "w")]).run(
        None, {"a": a}
    )
    storage = "u8" if inputs is np.uint8 else "i8"
    rule = ONNXRUNTIME_X86.find("MatMul", storage, storage)
    assert rule is not None and rule.accumulation is INT32
    assert (y == INT32.dot(a, w)).all()


def test_the_vnni_model_adds_everything_in_int32() -> None:
    for op, depthwise in (("Conv", False), ("Conv", True), ("Gemm", False), ("MatMul", False)):
        rule = ONNXRUNTIME_X86_VNNI.find(op, "u8", "i8", depthwise)
        assert rule is not None and rule.accumulation is INT32


def _dynamic_uint8(values: np.ndarray) -> tuple[np.ndarray, float, int]:
    """ONNX Runtime's dynamic quantization of a float block to uint8 (its range, widened to 0)."""
    low, high = min(float(values.min()), 0.0), max(float(values.max()), 0.0)
    scale = np.float32((high - low) / 255) if high > low else np.float32(1.0)
    zero = int(np.clip(np.rint(np.float32(0 - low) / scale), 0, 255))
    return np.clip(np.rint(values.astype(np.float32) / scale) + zero, 0, 255).astype(np.int64), float(scale), zero


def _lstm_reference(x: np.ndarray, w: np.ndarray, r: np.ndarray, w_scale: np.ndarray, r_scale: np.ndarray,
                    accumulation: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(Y, Y_c) of a forward LSTM as DynamicQuantizeLSTM computes it: the input quantized once, the
    hidden state at every step, each GEMM in the kernel model's accumulation (ONNX gate order i, o, f, c)."""
    steps, hidden = x.shape[0], r.shape[2]
    w_rows, r_rows = (Reduction("LSTM", m.shape).rows(m.astype(np.int64)) for m in (w, r))  # [4H, K]

    def product(q: np.ndarray, scale: float, zero: int, rows: np.ndarray, row_scale: np.ndarray) -> np.ndarray:
        acc = accumulation.dot(q, rows.T) - zero * rows.sum(axis=1)  # the zero point through row sums
        return acc * scale * row_scale

    xq, xs, xz = _dynamic_uint8(x.reshape(steps, -1))
    projected = product(xq, xs, xz, w_rows, w_scale)
    h, c, ys = np.zeros(hidden), np.zeros(hidden), []
    for t in range(steps):
        hq, hs, hz = _dynamic_uint8(h[None])
        gates = projected[t] + product(hq, hs, hz, r_rows, r_scale)[0]
        i, o, f, g = np.split(gates, 4)
        sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        ys.append(h)
    return np.array(ys), c


@pytest.mark.parametrize(("steps", "size"), [(1, 8), (3, 9)], ids=["input-projection", "recurrence-odd-k"])
def test_dynamicquantizelstm_pairs_its_input_and_hidden_state_products(steps: int, size: int) -> None:
    """ONNX Runtime's int8 LSTM: the input (uint8 over its range, once) and the hidden state (at each
    step) times int8 weights, through the same QGEMM: pairs along the input and the hidden axis."""
    rng = np.random.default_rng(RNG_SEED)
    hidden = 6
    w = _adversarial(rng, (1, 4 * hidden, size), np.int8)
    r = _adversarial(rng, (1, 4 * hidden, hidden), np.int8)
    x = (_adversarial(rng, (steps, 1, size), np.uint8) / np.float32(255)).astype(np.float32)
    w_scale = np.full((1, 4 * hidden), 1.5e-3, np.float32)
    r_scale = np.full((1, 4 * hidden), 4e-3, np.float32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.transpose(0, 2, 1)), "w"),
             numpy_helper.from_array(np.ascontiguousarray(r.transpose(0, 2, 1)), "r"),
             numpy_helper.from_array(w_scale, "ws"), numpy_helper.from_array(np.zeros_like(w_scale, np.int8), "wz"),
             numpy_helper.from_array(r_scale, "rs"), numpy_helper.from_array(np.zeros_like(r_scale, np.int8), "rz")]  # fmt: skip
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "w", "r", "", "", "", "", "", "ws", "wz", "rs", "rz"],
                            ["y", "", "yc"], domain="com.microsoft", hidden_size=hidden)  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "yc")]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              outputs, inits)  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y, yc = session.run(None, {"x": x})
    rule = ONNXRUNTIME_X86.find("LSTM", "u8", "i8")
    assert rule is not None and rule.accumulation is INT16_PAIRS
    host, other = _on_host("LSTM")
    modelled = _lstm_reference(x, w, r, w_scale[0], r_scale[0], host)
    exact = _lstm_reference(x, w, r, w_scale[0], r_scale[0], other)
    for got, want, wrong in zip((y.reshape(steps, -1), yc.reshape(-1)), modelled, exact, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)  # float math: MLAS's sigmoid and tanh
        assert np.abs(got - wrong).max() > 0.02  # the other sums give other states (1000x the tolerance)


def test_the_host_model_follows_the_cpu_flags() -> None:
    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
    alder_lake = "flags\t\t: avx2 avx_vnni\n"
    sapphire_rapids = "flags\t\t: avx2 avx512f avx512_vnni avx_vnni amx_bf16 avx512_fp16 amx_tile amx_int8\n"
    assert host_kernel_model(zen3) is ONNXRUNTIME_X86
    assert host_kernel_model("flags\t\t: avx2 avx512f avx512bw\n") is ONNXRUNTIME_X86  # AVX-512 without VNNI pairs
    assert host_kernel_model(zen4) is ONNXRUNTIME_X86_VNNI
    assert host_kernel_model(alder_lake) is ONNXRUNTIME_X86_VNNI
    assert host_kernel_model(sapphire_rapids) is ONNXRUNTIME_X86_AMX
    # MLAS asks for both AMX-TILE and AMX-INT8: with one, the VNNI kernels
    assert host_kernel_model("flags\t\t: avx2 avx512f avx512_vnni amx_tile\n") is ONNXRUNTIME_X86_VNNI
    assert host_kernel_model("") is ONNXRUNTIME_X86  # nothing known: the conservative model
    assert ONNXRUNTIME_X86_AMX.exact and ONNXRUNTIME_X86_VNNI.exact and not ONNXRUNTIME_X86.exact


def test_amx_computes_what_vnni_computes_for_every_kernel() -> None:
    """The AMX model names its kernels (AMX tiles for the QGEMMs, ConvSym and depthwise for the rest) and
    adds exactly wherever the VNNI one does."""
    for op, depthwise in (("Conv", True), ("Conv", False), ("Gemm", False), ("MatMul", False), ("LSTM", False)):
        for inputs, weights in (("u8", "i8"), ("u8", "u8"), ("i8", "i8")):
            if op == "LSTM" and inputs == "i8":
                continue
            amx, vnni = (m.find(op, inputs, weights, depthwise) for m in (ONNXRUNTIME_X86_AMX, ONNXRUNTIME_X86_VNNI))
            assert amx is not None and vnni is not None, (op, inputs, weights, depthwise)
            assert amx.accumulation is vnni.accumulation is INT32
    assert "AMX" in ONNXRUNTIME_X86_AMX.find("MatMul", "u8", "i8").kernel
    assert "depthwise" in ONNXRUNTIME_X86_AMX.find("Conv", "u8", "i8", True).kernel


@pytest.mark.skipif(MASKED, reason="bench/ort_without_vnni.py's ONNX Runtime runs the AVX2 kernels whatever the CPU")
def test_the_cpu_flags_predict_what_onnxruntime_computes() -> None:
    """Exact sums where the flags say VNNI or AMX, int16 pairs elsewhere; and AMX exactly where MLAS took its
    branch, which asks Linux for the tiles' state (a fresh process that only ran ONNX Runtime: torch's
    oneDNN asks too)."""
    assert host_kernel_model().exact == HOST.exact
    if HOST is ONNXRUNTIME_X86:
        return
    assert (host_kernel_model() is ONNXRUNTIME_X86_AMX) == mlas_took_amx()
