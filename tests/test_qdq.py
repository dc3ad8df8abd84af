"""The QDQ backend on small text models: where the QuantizeLinear / DequantizeLinear pairs go."""

from __future__ import annotations

from requant.backends.qdq import finish_qdq, materialize_qdq
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.ir.annotations import set_quant_type
from requant.ir.queries import graph_values
from requant.types import parse_type


def _qdq(text: str, types: dict[str, str]) -> str:
    model = load_onnx_text('<ir_version: 10, opset_import: ["" : 21]>\n' + text, "test")
    values = {v.name: v for v in graph_values(model.graph)}
    for name, t in types.items():
        set_quant_type(values[name], parse_type(t))
    model = materialize_qdq(model)
    finish_qdq(model)
    return print_model(model)


def test_shape_reads_the_float_value() -> None:
    printed = _qdq(
        "g (float[N,4] x) => (float[N,4] y, int64[2] s) { s = Shape(x) y = Relu(x) }",
        {"x": "!quant.uniform<u8:f32, 0.5:128>", "y": "!quant.uniform<u8:f32, 0.25>"},
    )
    body = [line.split(" loc(")[0].strip() for line in printed.splitlines() if " = " in line]
    assert body == [
        "%x_scale: tensor<f32> = initializer dense<0.5>",
        "%x_zero_point: tensor<u8> = initializer dense<128>",
        "%y_scale: tensor<f32> = initializer dense<0.25>",
        "%y_zero_point: tensor<u8> = initializer dense<0>",
        "%x_quantized: tensor<Nx4x!quant.uniform<u8:f32, 5.000000e-01:128>> = QuantizeLinear(%x, %x_scale, %x_zero_point)",
        "%x_dq: tensor<Nx4xf32> = DequantizeLinear(%x_quantized, %x_scale, %x_zero_point)",
        "%s: tensor<2xi64> = Shape(%x)",  # not %x_dq: a shape needs no numbers
        "%y_float: tensor<Nx4x!quant.uniform<u8:f32, 2.500000e-01>> = Relu(%x_dq)",
        "%y_quantized: tensor<Nx4x!quant.uniform<u8:f32, 2.500000e-01>> = QuantizeLinear(%y_float, %y_scale, %y_zero_point)",
        "%y: tensor<Nx4xf32> = DequantizeLinear(%y_quantized, %y_scale, %y_zero_point)",
    ]


def test_a_kernels_shape_is_read_from_its_quantized_output() -> None:
    """A second reader of a kernel's float output (a Shape) would keep ONNX Runtime from fusing the kernel."""
    printed = _qdq(
        "g (float[N,4] x) => (float[N,4] y, int64[2] s) { r = Relu(x) s = Shape(r) y = Sigmoid(r) }",
        {"x": "!quant.uniform<u8:f32, 0.5:128>", "r": "!quant.uniform<u8:f32, 0.25>"},
    )
    assert "%s: tensor<2xi64> = Shape(%r_quantized)" in printed
    assert printed.count("= Relu(") == 1 and "Shape(%r)" not in printed


def test_a_value_only_measured_gets_no_pair() -> None:
    printed = _qdq(
        "g (float[N,4] x) => (int64[2] s, int64 n) { s = Shape(x) n = Size(x) }",
        {"x": "!quant.uniform<u8:f32, 0.5:128>"},
    )
    assert "QuantizeLinear" not in printed and "DequantizeLinear" not in printed
    assert "= Shape(%x)" in printed and "= Size(%x)" in printed


def _ops(printed: str) -> list[str]:
    return [
        line.split(" = ")[1].split("(")[0]
        for line in printed.splitlines()
        if " = " in line and "initializer" not in line
    ]


# x quantized, one Mul, its output quantized, then the Sigmoid: what is left when the op between goes
ONE_MUL_THEN_SIGMOID = ["QuantizeLinear", "DequantizeLinear", "Mul", "QuantizeLinear", "DequantizeLinear", "Sigmoid"]


def test_a_relu_ending_a_kernel_goes_when_its_quantizelinear_clamps_the_same() -> None:
    """Q(relu(x)) == Q(x) when the zero point is the lowest stored value: the Relu goes (exact)."""
    text = "g (float[N,4] x) => (float[N,4] y) { t = Mul(x, x) r = Relu(t) y = Sigmoid(r) }"
    dropped = _qdq(text, {"x": "!quant.uniform<u8:f32, 0.5:128>", "r": "!quant.uniform<u8:f32, 0.25>"})
    assert _ops(dropped) == ONE_MUL_THEN_SIGMOID
    kept = _qdq(text, {"x": "!quant.uniform<u8:f32, 0.5:128>", "r": "!quant.uniform<u8:f32, 0.25:1>"})
    assert "Relu" in _ops(kept)  # zero point 1: -0.25 is representable, the Relu clamps it


def test_a_clip_goes_only_when_the_quantized_range_ends_at_its_bounds() -> None:
    text = (
        "g (float[N,4] x) => (float[N,4] y) <float lo = {0.0}, float hi = {6.0}> "
        "{ t = Mul(x, x) r = Clip(t, lo, hi) y = Sigmoid(r) }"
    )
    six = _qdq(text, {"x": "!quant.uniform<u8:f32, 0.5:128>", "r": "!quant.uniform<u8:f32, 0.0235294122>"})
    assert "Clip" not in _ops(six)  # 255 steps of 6/255: the top stored value is 6
    eight = _qdq(text, {"x": "!quant.uniform<u8:f32, 0.5:128>", "r": "!quant.uniform<u8:f32, 0.0313725509>"})
    assert "Clip" in _ops(eight)  # values in (6, 8] are representable: the Clip changes them


def test_a_mul_by_a_positive_constant_folds_into_the_scale_its_readers_take() -> None:
    """DQ(q; s) -> Mul(c) -> Q -> DQ is DQ(q; c s): the product exactly, no QLinearMul, no second rounding."""
    text = "g (float[N,4] x) => (float[N,4] y) <float half = {0.5}> { t = Mul(x, x) m = Mul(t, half) y = Sigmoid(m) }"
    types = {"x": "!quant.uniform<u8:f32, 0.5:128>", "t": "!quant.uniform<u8:f32, 0.25>",
             "m": "!quant.uniform<u8:f32, 0.1>"}  # fmt: skip
    printed = _qdq(text, types)
    assert _ops(printed) == ONE_MUL_THEN_SIGMOID
    assert "initializer dense<0.125>" in printed  # 0.25 x 0.5, read from t's integers
    kept = _qdq(text.replace("{0.5}", "{-0.5}"), types)  # a negative factor would flip the zero point's side
    assert _ops(kept).count("Mul") == 2


LINEAR = (
    "g (float[N,3] x) => (float[N,2] y) "
    "<float[3,2] w = {0.5, -0.25, 1.0, 0.75, -1.0, 0.125}, float[2] b = {0.1, -0.2}> "
    "{ m = MatMul(x, w) y = Add(m, b) }"
)
LINEAR_TYPES = {"x": "!quant.uniform<u8:f32, 0.5:128>", "w": "!quant.uniform<i8:f32:1, {0.0078125, 0.0078125}>"}


def test_a_float_output_int8_matmul_with_a_bias_becomes_matmulintegertofloat_with_it() -> None:
    """ONNX Runtime fuses DQ -> MatMul into MatMulIntegerToFloat but leaves the bias Add a node of its own."""
    printed = _qdq(LINEAR, LINEAR_TYPES)
    body = [line.split(" loc(")[0].strip() for line in printed.splitlines() if " = " in line]
    assert body[-2:] == [
        "%x_quantized: tensor<Nx3x!quant.uniform<u8:f32, 5.000000e-01:128>> = QuantizeLinear(%x, %x_scale, %x_zero_point)",
        "%y: tensor<Nx2xf32> = com.microsoft.MatMulIntegerToFloat(%x_quantized, %w_quantized, %x_scale, %w_scale, "
        "%x_zero_point, %w_zero_point, %b)",
    ]
    assert "DequantizeLinear" not in printed and "Add(" not in printed


def test_a_matmul_whose_sum_is_quantized_or_whose_bias_is_not_constant_keeps_its_qdq_form() -> None:
    quantized_sum = _qdq(LINEAR, {**LINEAR_TYPES, "y": "!quant.uniform<u8:f32, 0.01:128>"})
    assert "MatMulIntegerToFloat" not in quantized_sum and "= MatMul(" in quantized_sum  # a QGemm for the runtime
    # a transformer's [batch, sequence, features]: ONNX Runtime makes no Gemm of it, the Add would run in float
    sequence = _qdq(LINEAR.replace("float[N,3] x", "float[N,S,3] x").replace("float[N,2] y", "float[N,S,2] y"),
                    {**LINEAR_TYPES, "y": "!quant.uniform<u8:f32, 0.01:128>"})  # fmt: skip
    assert "MatMulIntegerToFloat(" in sequence and "QuantizeLinear(%y_float" in sequence
    given_bias = _qdq(LINEAR.replace("(float[N,3] x)", "(float[N,3] x, float[2] b)").replace(", float[2] b = {0.1, -0.2}", ""),
                      LINEAR_TYPES)  # fmt: skip
    assert "MatMulIntegerToFloat" not in given_bias and "= Add(" in given_bias


def test_a_pool_after_a_folded_mul_takes_the_folded_scale_too() -> None:
    """The pool re-quantizes with the scale it shared with its input; after the fold its input is read at
    c s: the pool's QuantizeLinear takes c s too, or ONNX Runtime runs it in float between the two."""
    text = (
        "g (float[1,2,4,4] x) => (float[1,2,2,2] y) <float half = {0.5}> "
        "{ t = Mul(x, x) m = Mul(t, half) p = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (m) y = Sigmoid(p) }"
    )
    pooled = "!quant.uniform<u8:f32, 0.1:3>"
    types = {"x": "!quant.uniform<u8:f32, 0.5:128>", "t": "!quant.uniform<u8:f32, 0.25:1>", "m": pooled, "p": pooled}
    printed = _qdq(text, types)
    assert _ops(printed) == ["QuantizeLinear", "DequantizeLinear", "Mul", "QuantizeLinear", "DequantizeLinear",
                             "MaxPool", "QuantizeLinear", "DequantizeLinear", "Sigmoid"]  # fmt: skip
    folded = next(line.split(":")[0].strip() for line in printed.splitlines() if "initializer dense<0.125>" in line)
    zero = "%t_zero_point"  # the integers read are t's: its zero point too
    assert printed.count(f"{folded}, {zero})") == 3, printed  # the DQ before the pool, the pool's Q and DQ


def test_a_float_conv_a_dequantize_reaches_through_a_transpose_gets_a_dequantize_on_an_axis() -> None:
    """ONNX Runtime would move the per-tensor DequantizeLinear past the Transpose and then quantize the
    Conv's float weight itself; one scale per channel (the same one) is out of reach of both."""
    printed = _qdq(
        """g (float[N,4,2,2] x) => (float[N,3,2,2] y) <float[3,4,1,1] w = {1.,2.,3.,4.,5.,6.,7.,8.,9.,10.,11.,12.}> {
          t = Transpose <perm = [0, 1, 3, 2]> (x)
          y = Conv (t, w)
        }""",
        {"x": "!quant.uniform<u8:f32, 0.5:128>", "y": "!quant.uniform<u8:f32, 0.25>"},
    )
    body = [line.split(" loc(")[0].strip() for line in printed.splitlines() if " = " in line]
    assert body[5:] == [
        "%x_quantized_scale_on_axis: tensor<4xf32> = initializer dense<[0.5, 0.5, 0.5, 0.5]>",
        "%x_quantized_zero_point_on_axis: tensor<4xu8> = initializer dense<[128, 128, 128, 128]>",
        "%x_quantized: tensor<Nx4x2x2x!quant.uniform<u8:f32, 5.000000e-01:128>> = QuantizeLinear(%x, %x_scale, %x_zero_point)",
        "%x_dq_for_float: tensor<Nx4x2x2xf32> = DequantizeLinear(%x_quantized, %x_quantized_scale_on_axis, "
        "%x_quantized_zero_point_on_axis) {axis = 1}",
        "%t: ? = Transpose(%x_dq_for_float) {perm = [0, 1, 3, 2]}",
        "%y_float: tensor<Nx3x2x2x!quant.uniform<u8:f32, 2.500000e-01>> = Conv(%t, %w)",
        "%y_quantized: tensor<Nx3x2x2x!quant.uniform<u8:f32, 2.500000e-01>> = QuantizeLinear(%y_float, %y_scale, %y_zero_point)",
        "%y: tensor<Nx3x2x2xf32> = DequantizeLinear(%y_quantized, %y_scale, %y_zero_point)",
    ]
