"""requant's type text against a real MLIR 22.1.8: same parse, same print, same rejections."""

from __future__ import annotations

import pytest
from hypothesis import assume, given

from requant.errors import QuantTypeError
from requant.types import UniformQuantizedSubChannelType, parse_tensor_type, parse_type, verify_cast
from tests.mlir_oracle import MlirOracle
from tests.strategies import MLIR_EXPRESSED, quantized_types

pytestmark = pytest.mark.mlir


@given(quantized_types(expressed=MLIR_EXPRESSED, for_mlir=True))
def test_mlir_reads_and_prints_our_text(mlir: MlirOracle, t: object) -> None:
    text = str(t)
    # A sub-channel scale MLIR would print as its own (f32, f16...) bits: MLIR cannot read that
    # back, so requant prints the double's bits instead and the texts differ by design.
    assume(not (isinstance(t, UniformQuantizedSubChannelType) and "0x" in text))
    ok, printed = mlir.parse(text)
    assert ok, printed
    if printed != text:
        # Only allowed where MLIR cannot read its own output (a sub-channel scale at the edge of
        # the expressed type's range): requant printed a text that reads back, MLIR did not.
        again, _ = mlir.parse(printed)
        assert not again, f"MLIR printed {printed!r} for requant's {text!r}"
    assert parse_type(text) == t


# Texts MLIR accepts, spelled the many ways its parser allows; both must print the same.
SPELLINGS = [
    "!quant.uniform<i8:f32, 3.0>",
    "!quant.uniform<si8:f32, 3.>",
    "!quant.uniform<ui8:f32, 1.e5>",
    "!quant< uniform<i8:f32, 1.0> >",
    "!quant<any<i8>>",
    "!quant.uniform< i8 < -8 : 7 > : f32 : 1 , { 1.0 : 1 , 2.0 } >",
    "!quant.uniform<i8:f32,\n 1.0 // a comment\n>",
    "!quant.uniform<i8:f32, 0x3FF0000000000000>",
    "!quant.uniform<i8<0x0:0x7f>:f32, 1.0:0x10>",
    "!quant.uniform<i8:f32:0x1, {1.0, 2.0}>",
    "!quant.uniform<i8:f32, - 1.0e-1:- 5>".replace("- 1.0e-1", "1.0E-1"),
    "!quant.uniform<i8:f32, 0.00392156862745098>",
    "!quant.uniform<i8:f32, 12345678.0>",
    "!quant.uniform<i8:f32, 123456.7>",
    "!quant.uniform<i8:f32, 1.2345678e20>",
    "!quant.uniform<i8:f32, 0.00012345678>",
    "!quant.uniform<i8:f64, 4.9406564584124654e-324>",
    "!quant.uniform<i8:f64, 1.7976931348623157e308>",
    "!quant.uniform<u16<0:1023>:f32, 1.23:512>",
    "!quant.uniform<i8:f32:{}, {1.0}>",
    "!quant.uniform<i8:f32:{1:2,0:1},{{1.0, 2.0}}>",
    "!quant.uniform<i8:f16:{0:1, 1:2}, {{0.1, 2.0}, {3.0, 4.0}}>",
    "!quant.uniform<i8:bf16:{0:1}, {{1.0078125}}>",
    "!quant.uniform<i8:f8E4M3FN:{0:1}, {{0.1}}>",
    "!quant.uniform<i8:f32:{0:1}, {{{1.0,2.0},{3.0,4.0}},{{5.0,6.0},{7.0,8.0}}}>",
    "!quant.any<i8<-8:7>:f16>",
    "!quant.calibrated<f32<-0.998:1.2321>>",
    "!quant.calibrated<f32<-1.0e-400:1.0>>",
    "!quant.calibrated<bf16<-1.0:0.1>>",
    "!quant.uniform<i1:f32, 1.0>",
    "!quant.uniform<u32:f32, 1.0:4294967295>",
    "!quant.uniform<i8:f4E2M1FN, 6.0>",
    "!quant.uniform<i8:f8E8M0FNU, 1.0>",
    # accepted as MLIR accepts them; problems() names them and requant's verifier refuses them on a value
    "!quant.uniform<i8:f32, 2.0:128>",
    "!quant.uniform<u8:f32:0, {2.0:-120, 3.0}>",
    "!quant.uniform<i8:f32:{0:2, 0:3}, {{2.0, 3.0}}>",
]


@pytest.mark.parametrize("text", SPELLINGS)
def test_spellings_agree_with_mlir(mlir: MlirOracle, text: str) -> None:
    ok, printed = mlir.parse(text)
    assert ok, printed
    assert str(parse_type(text)) == printed


# Sub-channel scales at the edge of the expressed range: MLIR prints a text it then rejects
# (it range-checks the parsed double before rounding to the expressed type). requant prints
# one that both read back.
EDGES = [
    "!quant.uniform<i8:f32:{0:1}, {{3.4028234663852886e38}}>",
    "!quant.uniform<i8:f16:{0:1}, {{5.9604644775390625e-08}}>",
    "!quant.uniform<i8:f16:{0:1}, {{0x3E70000000000000}}>",
]


@pytest.mark.parametrize("text", EDGES)
def test_where_mlir_cannot_read_its_own_output(mlir: MlirOracle, text: str) -> None:
    ok, mlir_text = mlir.parse(text)
    assert ok, mlir_text
    assert not mlir.parse(mlir_text)[0]
    ours = str(parse_type(text))
    assert ours != mlir_text
    assert mlir.parse(ours) == (True, mlir_text)
    assert parse_type(ours) == parse_type(text)


# Texts MLIR rejects: requant must reject them too (messages are compared in test_types_golden).
REJECTED = [
    "!quant.uniform<i0:f32, 1.0>",
    "!quant.uniform<i33:f32, 1.0>",
    "!quant.uniform<x8:f32, 1.0>",
    "!quant.uniform<u:f32, 1.0>",
    "!quant.uniform<u8x:f32, 1.0>",
    "!quant.uniform<f32:f32, 1.0>",
    "!quant.uniform<i8<-129:127>:f32, 1.0>",
    "!quant.uniform<i8<-128:128>:f32, 1.0>",
    "!quant.uniform<i8<5:5>:f32, 1.0>",
    "!quant.uniform<i8:f32, -1.0>",
    "!quant.uniform<i8:f32, 0.0>",
    "!quant.uniform<i8:f32, +1.0>",
    "!quant.uniform<i8:f32, .5>",
    "!quant.uniform<i8:f32, 3>",
    "!quant.uniform<i8:f32, 1e400>",
    "!quant.uniform<i8:f32, 1.0e400>",
    "!quant.uniform<i8:f32, 1.0e-46>",
    "!quant.uniform<i8:f32, 0x7FF0000000000000>",
    "!quant.uniform<i8:f32, 0x10000000000000000>",
    "!quant.uniform<i8:f32, -0x3FF0000000000000>",
    "!quant.uniform<i8:f32, 0X3FF0000000000000>",
    "!quant.uniform<i8:i32, 1.0>",
    "!quant.uniform<i8:f32:-1, {1.0}>",
    "!quant.uniform<i8:f32:0, {}>",
    "!quant.uniform<i8:f32:0, {1.0, }>",
    "!quant.uniform<i8:f32:0, 1.0>",
    "!quant.uniform<i8:f32:{}, {}>",
    "!quant.uniform<i8:f32:{0:0}, {{1.0}}>",
    "!quant.uniform<i8:f32:{0:-1}, {{1.0}}>",
    "!quant.uniform<i8:f32:{-1:1}, {{1.0}}>",
    "!quant.uniform<i8:f32:{0:1}, {{1.0}, {2.0, 3.0}}>",
    "!quant.uniform<i8:f32:{0:1}, {1.0, {2.0}}>",
    "!quant.uniform<i8:f16:{0:1}, {{65519.0}}>",
    "!quant.uniform<i8:f8E4M3FN, 449.0>",
    "!quant.any<u8:i32>",
    "!quant.any<u8:f32, 1.0>",
    "!quant.calibrated<f32<1.0:1.0>>",
    "!quant.calibrated<f32>",
    "!quant.calibrated<f32<-1:1>>",
    "!quant.uniform<i8:f32, 1.0:9223372036854775808>",
    "!quant.uniform<i8:f32, 1.0>>",
    "!quant.uniform<i8:f32, 1.0",
    "!quant.uniform <i8:f32, 1.0>",
    "!quant.uniformx<i8:f32, 1.0>",
]


@pytest.mark.parametrize("text", REJECTED)
def test_rejections_agree_with_mlir(mlir: MlirOracle, text: str) -> None:
    ok, _ = mlir.parse(text)
    assert not ok
    with pytest.raises(QuantTypeError):
        parse_type(text)


# quant.qcast / dcast / scast verification: (op, source, result).
CASTS = [
    ("qcast", "f32", "!quant.uniform<i8:f32, 1.0>"),
    ("qcast", "f32", "!quant.uniform<i8:f32:0, {1.0, 2.0}>"),
    ("qcast", "tensor<2xf32>", "tensor<2x!quant.uniform<i8:f32:0, {1.0, 2.0}>>"),
    ("qcast", "tensor<1x2xf32>", "tensor<1x2x!quant.uniform<i8:f32:3, {1.0, 2.0}>>"),
    ("qcast", "tensor<?x3xf32>", "tensor<?x3x!quant.uniform<i8:f32:1, {1.0, 2.0, 3.0, 4.0}>>"),
    ("qcast", "tensor<?x?xf32>", "tensor<?x?x!quant.uniform<i8:f32:1, {1.0, 2.0, 3.0, 4.0}>>"),
    ("qcast", "tensor<*xf32>", "tensor<*x!quant.uniform<i8:f32:1, {1.0, 2.0}>>"),
    ("qcast", "tensor<*xf32>", "tensor<*x!quant.uniform<i8:f32:{0:1, 1:2}, {{1.0}, {2.0}}>>"),
    ("qcast", "f32", "!quant.uniform<i8:f32:{0:1, 1:2}, {{1.0}, {2.0}}>"),
    ("qcast", "tensor<2x2xf32>", "tensor<2x2x!quant.uniform<i8:f32:{0:1, 1:2}, {{1.0}, {2.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{0:3}, {{1.0}, {3.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{}, {{1.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{0:8}, {{1.0, 2.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{0:4}, {{1.0, 2.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{0:3}, {{1.0, 2.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{0:3}, {1.0, 2.0}>>"),
    ("qcast", "tensor<?x2xf32>", "tensor<?x2x!quant.uniform<i8:f32:{0:3}, {{1.0}, {2.0}, {3.0}}>>"),
    ("qcast", "tensor<?x2xf32>", "tensor<?x2x!quant.uniform<i8:f32:{1:1}, {{1.0, 2.0}, {3.0, 4.0}}>>"),
    ("qcast", "tensor<6x2xf32>", "tensor<6x2x!quant.uniform<i8:f32:{1:1}, {{1.0, 2.0}}>>"),
    ("qcast", "tensor<0x2xf32>", "tensor<0x2x!quant.uniform<i8:f32:{0:1}, {{1.0}}>>"),
    ("qcast", "tensor<0x2xf32>", "tensor<0x2x!quant.uniform<i8:f32:0, {1.0}>>"),
    ("qcast", "tensor<2x0xf32>", "tensor<2x0x!quant.uniform<i8:f32:0, {1.0, 2.0}>>"),
    ("qcast", "tensor<2xf32>", "tensor<2x!quant.uniform<i8:f16, 1.0>>"),
    ("qcast", "tensor<2xf16>", "tensor<3x!quant.uniform<i8:f16, 1.0>>"),
    ("qcast", "tensor<2xf16>", "tensor<?x!quant.uniform<i8:f16, 1.0>>"),
    ("qcast", "tensor<*xf16>", "tensor<2x!quant.uniform<i8:f16, 1.0>>"),
    ("qcast", "tensor<2xf32>", "!quant.uniform<i8:f32, 1.0>"),
    ("qcast", "tensor<2xi8>", "tensor<2x!quant.uniform<i8:f32, 1.0>>"),
    ("qcast", "tensor<2xf32>", "tensor<2xi8>"),
    ("qcast", "tensor<f32>", "tensor<!quant.uniform<i8:f32, 1.0>>"),
    ("qcast", "tensor<2xbf16>", "tensor<2x!quant.uniform<i8:bf16, 1.0>>"),
    ("dcast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xf32>"),
    ("dcast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xf16>"),
    ("dcast", "tensor<2xf32>", "tensor<2xf32>"),
    ("dcast", "tensor<*x!quant.uniform<i8:f32:1, {2.0, 3.0}>>", "tensor<*xf32>"),
    ("dcast", "tensor<2x!quant.uniform<i8:f32:1, {2.0, 3.0}>>", "tensor<2xf32>"),
    ("dcast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xi8>"),
    ("scast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xi8>"),
    ("scast", "tensor<2x!quant.uniform<u8:f32, 1.0>>", "tensor<2xi8>"),
    ("scast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xi16>"),
    ("scast", "tensor<2xi8>", "tensor<2x!quant.uniform<i8:f32, 1.0>>"),
    ("scast", "tensor<2xi8>", "tensor<2xi8>"),
    ("scast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2x!quant.uniform<i8:f32, 2.0>>"),
    ("scast", "tensor<2x!quant.uniform<i8:f32, 1.0>>", "tensor<2xf32>"),
    ("scast", "tensor<2xui8>", "tensor<2x!quant.uniform<u8:f32, 1.0>>"),
    ("scast", "i8", "tensor<1x!quant.uniform<i8:f32, 1.0>>"),
    ("scast", "i8", "!quant.uniform<i8:f32, 1.0>"),
    ("scast", "tensor<*xi8>", "tensor<*x!quant.uniform<i8:f32:1, {2.0, 3.0}>>"),
    ("scast", "tensor<2xi8>", "tensor<2x!quant.uniform<i8:f32:1, {2.0, 3.0}>>"),
    ("scast", "tensor<2x2xi8>", "tensor<2x2x!quant.uniform<i8:f32:{0:1}, {{2.0}, {3.0}}>>"),
    ("scast", "tensor<2x2xi8>", "tensor<2x2x!quant.uniform<i8:f32:{0:1}, {{2.0}}>>"),
    ("scast", "tensor<2 x 2 x i4>", "tensor<2x2x!quant.uniform<u4:f32:{0:1}, {{2.0}, {3.0}}>>"),
]


@pytest.mark.parametrize(("op", "source", "result"), CASTS)
def test_cast_verification_agrees_with_mlir(mlir: MlirOracle, op: str, source: str, result: str) -> None:
    ok, _ = mlir.verify_cast(op, source, result)
    if ok:
        verify_cast(op, source, result)
    else:
        with pytest.raises(QuantTypeError):
            verify_cast(op, source, result)


@given(quantized_types(expressed=MLIR_EXPRESSED, for_mlir=True))
def test_container_integrity_agrees_with_mlir(mlir: MlirOracle, t: object) -> None:
    from requant.types import UniformType

    assume(isinstance(t, UniformType))
    assume(not (isinstance(t, UniformQuantizedSubChannelType) and "0x" in str(t)))
    assert isinstance(t, UniformType)
    # shapes that fit, and shapes that do not
    for dims in ([2], [3, 4], [6, 2], [1, 3, 4], [4, 6, 8], ["?", 4]):
        shape = "x".join(map(str, dims))
        ok, _ = mlir.verify_cast("qcast", f"tensor<{shape}x{t.expressed}>", f"tensor<{shape}x{t}>")
        ours = f"tensor<{shape}x{t}>"
        if ok:
            parse_tensor_type(ours)
        else:
            with pytest.raises(QuantTypeError):
                parse_tensor_type(ours)
