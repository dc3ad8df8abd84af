"""The float-format table, exact rounding, and MLIR's float printer."""

from __future__ import annotations

import decimal
import math
import struct
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from requant.types.floats import FLOAT_FORMATS, _reads_back, format_float, round_to_format

ML_DTYPES = {
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "f32": np.float32,
    "f64": np.float64,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3": ml_dtypes.float8_e4m3,
    "f8E3M4": ml_dtypes.float8_e3m4,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz,
    "f8E8M0FNU": ml_dtypes.float8_e8m0fnu,
    "f6E2M3FN": ml_dtypes.float6_e2m3fn,
    "f6E3M2FN": ml_dtypes.float6_e3m2fn,
    "f4E2M1FN": ml_dtypes.float4_e2m1fn,
}


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_largest_and_smallest_match_ml_dtypes(name: str) -> None:
    info = ml_dtypes.finfo(ML_DTYPES[name])
    fmt = FLOAT_FORMATS[name]
    assert float(fmt.largest) == float(info.max)
    assert float(fmt.smallest) == float(info.smallest_subnormal)


def test_scale_range_of_wide_formats_is_the_doubles() -> None:
    assert FLOAT_FORMATS["f80"].scale_range == (5e-324, 1.7976931348623157e308)
    assert FLOAT_FORMATS["f64"].scale_range == (5e-324, 1.7976931348623157e308)


@pytest.mark.parametrize("name", ["f16", "f32"])
@given(x=st.floats(min_value=-6e4, max_value=6e4, allow_subnormal=True))
def test_rounding_matches_numpy(name: str, x: float) -> None:
    expected = float(np.array(x, dtype=np.float64).astype(ML_DTYPES[name]))
    got = round_to_format(x, FLOAT_FORMATS[name])
    assert got is not None and float(got) == expected


@pytest.mark.parametrize("name", ["bf16", "f8E4M3FN", "f8E5M2", "f6E3M2FN", "f4E2M1FN"])
@given(x=st.floats(min_value=-5.0, max_value=5.0, width=32))
def test_rounding_matches_ml_dtypes_from_float32(name: str, x: float) -> None:
    # from float32 inputs ml_dtypes rounds once, so it is a faithful reference
    expected = float(np.array(x, dtype=np.float32).astype(ML_DTYPES[name]))
    got = round_to_format(x, FLOAT_FORMATS[name])
    assert got is not None and float(got) == expected


def test_rounding_ties_to_even_and_overflow() -> None:
    f16 = FLOAT_FORMATS["f16"]
    assert round_to_format(2049.0, f16) == 2048  # tie between 2048 and 2050: even mantissa
    assert round_to_format(2051.0, f16) == 2052
    assert round_to_format(65520.0, f16) is None  # past the largest value by half an ulp
    assert round_to_format(Fraction(1, 2**26), f16) == 0  # below half the smallest denormal


@pytest.mark.parametrize(
    ("value", "name", "text"),
    [
        (3.0, "f64", "3.000000e+00"),
        (1.23, "f64", "1.230000e+00"),
        (0.0186274509, "f64", "0.018627450899999998"),
        (1 / 255, "f64", "0.0039215686274509803"),
        (123456.7, "f64", "123456.7"),
        (12345678.0, "f64", "0x41678C29C0000000"),
        (1.2345678e20, "f64", "1.2345678E+20"),
        (0.00012345678, "f64", "1.2345678000000001E-4"),
        (5e-324, "f64", "4.940660e-324"),
        (-0.0, "f64", "-0.000000e+00"),
        (0.0999755859375, "f16", "9.997550e-02"),  # truncated, as APFloat does, then padded
        (0.10009765625, "bf16", "1.000980e-01"),
        (1.0078125, "bf16", "1.007810e+00"),
        (0.1015625, "f8E4M3FN", "1.015630e-01"),
        (3.4028234663852886e38, "f32", "3.40282347E+38"),
    ],
)
def test_format_float_matches_mlir(value: float, name: str, text: str) -> None:
    # Each text was printed by MLIR 22.1.8 (see tests/test_mlir_differential.py for the live check).
    assert format_float(value, FLOAT_FORMATS[name]) == text


@given(st.floats(min_value=5e-324, allow_infinity=False))
def test_format_float_reads_back(x: float) -> None:
    text = format_float(x)
    hex_bits = text.startswith("0x")  # then the text is the bits of the double
    back = struct.unpack("<d", struct.pack("<Q", int(text, 16)))[0] if hex_bits else float(text)
    assert back == x


@given(st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_reading_a_double_back_needs_no_fractions(value: float) -> None:
    """format_float's fast check for doubles (Python's correctly rounded ``float``) is the exact one."""
    from requant.types.floats import F64, _same, _to_string

    if value == 0:
        return
    num, den = abs(value).as_integer_ratio()
    text = _to_string(value < 0, num, -(den.bit_length() - 1), 53, 6, 0, False)
    assert (float(text) == value) == _same(round_to_format(Fraction(text), F64), value)


@given(
    st.one_of(
        st.floats(allow_nan=False, allow_infinity=False, width=64),
        st.builds(lambda m, e: float(f"{m}e{e}"), st.integers(-999_999, 999_999), st.integers(-310, 300)),
    )
)
def test_a_double_whose_six_digits_python_cannot_read_back_has_no_six_digit_form(value: float) -> None:
    """format_float skips APFloat's 6-digit form of a double when Python's correctly rounded 6 digits
    do not read back: then APFloat's do not either."""
    from requant.types.floats import _to_string

    if value == 0 or not math.isfinite(value):
        return
    num, den = abs(value).as_integer_ratio()
    text = _to_string(value < 0, num, -(den.bit_length() - 1), 53, 6, 0, False)
    if float(text) == value:
        assert float(f"{value:.5e}") == value


@pytest.mark.parametrize("name", ["f32", "f16"])
@given(st.integers(0, 2**16 - 1), st.integers(1, 7))
def test_the_fast_read_back_check_agrees_with_exact_rounding(name: str, bits: int, digits: int) -> None:
    # format_float asks whether a decimal text reads back to the value; numpy's rounding of the parsed
    # double must give what rounding the text exactly gives, also for texts halfway between two values
    native = ML_DTYPES[name]
    fmt = FLOAT_FORMATS[name]
    if name == "f32":
        bits = bits << 15 | 0x3000_0000  # scales around 1e-9 .. 1e-1: what per-channel types hold
    value = native(np.array(bits, np.uint32 if name == "f32" else np.uint16).view(native))
    if not np.isfinite(value) or value == 0:
        return
    above = np.nextafter(value, native(np.inf))
    halfway = (Fraction(float(value)) + Fraction(float(above))) / 2
    with decimal.localcontext() as context:
        context.prec = 400
        exact = decimal.Decimal(halfway.numerator) / decimal.Decimal(halfway.denominator)  # a binary fraction: exact
    # just above and below halfway: these parse to the halfway double, and rounding that again ties to even
    near = [f"{exact:f}" + "0" * 30 + "1", str(exact - decimal.Decimal(10) ** -(60 - exact.adjusted()))]
    for text in (f"{float(value):.{digits}e}", f"{float(above):.{digits}e}", str(float(halfway)), *near):
        for target in (float(value), float(above)):
            exact = round_to_format(Fraction(text), fmt)
            assert _reads_back(text, target, fmt) == (exact is not None and exact == Fraction(target)), text
