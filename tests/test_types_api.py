"""The type constructors: validation, immutability, equality, and the print/parse round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from requant.errors import QuantTypeError, RequantError
from requant.types import (
    AnyQuantizedType,
    CalibratedQuantizedType,
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    normalize,
    parse_type,
)
from tests.strategies import quantized_types


@given(quantized_types())
def test_print_parse_round_trip(t: QuantizedType) -> None:
    text = str(t)
    again = parse_type(text)
    assert again == t
    assert hash(again) == hash(t)
    assert str(again) == text


def test_errors_are_one_hierarchy() -> None:
    assert issubclass(QuantTypeError, RequantError)
    with pytest.raises(RequantError):
        UniformQuantizedType("i8", "f32", 0.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: UniformQuantizedType("i9x", "f32", 1.0), "expected storage type width"),
        (lambda: UniformQuantizedType("q8", "f32", 1.0), "illegal storage type prefix"),
        (lambda: UniformQuantizedType("i64", "f32", 1.0), "illegal storage type size: 64"),
        (lambda: UniformQuantizedType("i8", "i32", 1.0), r"expressed type must be floating point \(one of f16"),
        (lambda: UniformQuantizedType("i8", "f32", float("nan")), "scale NAN out of expressed type range"),
        (lambda: UniformQuantizedType("i8", "f16", 1e5), r"scale 1.000000e\+05 out of expressed type range"),
        (lambda: UniformQuantizedType("i8", "f32", 1.0, 2**63), r"zero point 9223372036854775808 does not fit"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {0: 1}, [[1.0]], [[128]]), r"zero point 128 out of"),
        (lambda: UniformQuantizedType("i8", "f32", 1.0, 1.5), "zero point must be an integer"),  # type: ignore[arg-type]
        (lambda: UniformQuantizedType("i8", "f32", "1"), "scale must be a real number"),  # type: ignore[arg-type]
        (lambda: UniformQuantizedType("u8", "f32", 1.0, storage_min=3, storage_max=3), r"illegal storage min"),
        (lambda: UniformQuantizedType("u8", "f32", 1.0, storage_min=-1), "illegal storage type minimum: -1"),
        (lambda: UniformQuantizedPerAxisType("i8", "f32", -1, [1.0]), "illegal quantized dimension: -1"),
        (lambda: UniformQuantizedPerAxisType("i8", "f32", 0, []), "scales must not be empty"),
        (lambda: UniformQuantizedPerAxisType("i8", "f32", 0, [1.0], [0, 0]), "illegal number of scales"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {0: 0}, [[1.0]]), "illegal block size: 0"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {2: 1}, [[1.0]]), "must be less than the rank"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {}, [[1.0], [2.0, 3.0]]), "ranks are not consistent"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {}, [[1.0]], [[0, 0]]), "shape of scales and zeroP"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {}, 1.0), "rank >= 1"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {}, [["a"]]), "each of the scales must be a real number"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", {}, [[1.0]], [[0.5]]), "zero points must be an integer"),
        (lambda: UniformQuantizedPerAxisType("i8", "f32", 0, [[1.0]]), "must be one-dimensional"),
        (lambda: AnyQuantizedType("i8", "bf15"), "expressed type must be floating point"),
        (lambda: CalibratedQuantizedType("f32", 1.0, 1.0), r"illegal min and max: \(1.000000e\+00"),
        (lambda: CalibratedQuantizedType("f32", float("-inf"), 1.0), r"illegal min and max: \(-INF"),
    ],
)
def test_constructor_errors(make: object, message: str) -> None:
    with pytest.raises(QuantTypeError, match=message):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("make", "text", "problem"),
    [
        (lambda: UniformQuantizedType("i8", "f32", 2.0, 128), "!quant.uniform<i8:f32, 2.000000e+00:128>",
         "zero point 128 out of storage type i8 range [-128, 127]"),
        (lambda: UniformQuantizedPerAxisType("u8", "f32", 0, [2.0, 3.0], [-120, 0]),
         "!quant.uniform<u8:f32:0, {2.000000e+00:-120,3.000000e+00}>", "zero point -120 out of storage type u8"),
        (lambda: UniformQuantizedSubChannelType("i8", "f32", [(0, 2), (0, 3)], [[2.0, 3.0]]),
         "!quant.uniform<i8:f32:{0:2, 0:3}, {{2.000000e+00, 3.000000e+00}}>", "quantized dimension 0 has more than one"),
    ],
)  # fmt: skip
def test_types_mlir_accepts_but_no_target_can_store(make: object, text: str, problem: str) -> None:
    """Made, parsed and printed as MLIR 22 does (its tests write ``2.0:128`` on i8); ``problems()``
    names what is wrong, and a model's value refuses the type (the verifier, not the parser)."""
    import onnx_ir as ir

    from requant.ir.annotations import AnnotationError, set_quant_type

    t = make()  # type: ignore[operator]
    assert str(t) == text and parse_type(text) == t and str(parse_type(text)) == text
    assert len(t.problems()) == 1 and t.problems()[0].startswith(problem)
    value = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 6]))
    with pytest.raises(AnnotationError, match="unusable for a target: " + problem[:20]):
        set_quant_type(value, t)
    assert UniformQuantizedType("i8", "f32", 2.0, 127).problems() == []


def test_large_sub_channel_types_are_cheap() -> None:
    # int4 blockwise weights of a 4096x4096 matrix, blocks of 32: 524,288 scales, vectorized checks
    scales = np.random.default_rng(0).uniform(0.01, 0.1, (4096, 128))
    t = UniformQuantizedSubChannelType("i4", "f16", {0: 1, 1: 32}, scales)
    assert np.array_equal(t.scales, scales.astype(np.float16).astype(np.float64))
    assert t == UniformQuantizedSubChannelType("i4", "f16", {0: 1, 1: 32}, t.scales)


def test_values_are_frozen_and_hashable() -> None:
    t = UniformQuantizedType("u8", "f32", 0.5, 128)
    with pytest.raises(AttributeError):
        t.scale = 1.0  # type: ignore[misc]
    s = UniformQuantizedSubChannelType("i8", "f32", {1: 2}, np.array([[0.5, 0.25]]))
    with pytest.raises(ValueError):
        s.scales[0, 0] = 1.0
    assert {t, s, parse_type(str(t))} == {t, s}
    assert t != UniformQuantizedType("u8", "f32", 0.5, 127)
    assert t != s


def test_fields_and_spellings() -> None:
    t = parse_type("!quant.uniform<ui16<0:1023>:f32, 1.23:512>")
    assert isinstance(t, UniformQuantizedType)
    assert (t.storage, t.is_signed, t.storage_width, t.expressed) == ("u16", False, 16, "f32")
    assert (t.storage_min, t.storage_max, t.scale, t.zero_point) == (0, 1023, 1.23, 512)
    s = UniformQuantizedSubChannelType("i4", "f16", {1: 32, 0: 1}, [[0.1, 0.2]], [[1, -2]])
    assert s.block_size_map == {1: 32, 0: 1} and list(s.block_size_map) == [1, 0]  # order kept
    assert s.scales.tolist() == [[0.0999755859375, 0.199951171875]]  # rounded to f16
    assert str(s) == "!quant.uniform<i4:f16:{1:32, 0:1}, {{9.997550e-02:1, 1.999510e-01:-2}}>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("!quant.uniform<i8:f32:{0:1, 1:4}, {{0.5:3}}>", "!quant.uniform<i8:f32, 5.000000e-01:3>"),
        ("!quant.uniform<i8:f32:{}, {{{2.0}}}>", "!quant.uniform<i8:f32, 2.000000e+00>"),
        (
            "!quant.uniform<i8<-127:127>:f32:{0:1, 1:8}, {{1.0}, {2.0:1}, {3.0}}>",
            "!quant.uniform<i8<-127:127>:f32:0, {1.000000e+00,2.000000e+00:1,3.000000e+00}>",
        ),
        ("!quant.uniform<u8:f32:{1:1}, {{1.0, 2.0}}>", "!quant.uniform<u8:f32:1, {1.000000e+00,2.000000e+00}>"),
        # a non-unit grid dimension with blocks larger than 1: no per-axis type says the same
        ("!quant.uniform<i8:f32:{1:2}, {{1.0, 2.0}}>", "!quant.uniform<i8:f32:{1:2}, {{1.000000e+00, 2.000000e+00}}>"),
        ("!quant.uniform<i8:f32:{0:1}, {{1.0, 2.0}, {3.0, 4.0}}>", None),
        ("!quant.uniform<i8:f32, 1.0>", None),
        ("!quant.any<i8>", None),
    ],
)
def test_normalize(text: str, expected: str | None) -> None:
    t = parse_type(text)
    result = normalize(t)
    if expected is None:
        assert result is t
    else:
        assert str(result) == expected
