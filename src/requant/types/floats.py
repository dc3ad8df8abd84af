"""Floating-point formats as MLIR knows them, exact rounding, and MLIR's float printer.

MLIR stores the scale of a per-layer or per-axis type as a C ``double`` and
prints it with ``printFloatValue`` (``mlir/lib/IR/AsmPrinter.cpp``), which calls
LLVM's ``APFloat::toString``. Sub-channel scales are first rounded to the
expressed type and printed in that type's semantics. This module reproduces
both digit for digit, with Python integers instead of ``APInt``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np
import numpy.typing as npt

__all__ = [
    "F64",
    "FLOAT_FORMATS",
    "FloatFormat",
    "float_format",
    "format_diag",
    "format_float",
    "round_to_format",
]

_DBL_MAX = 1.7976931348623157e308
_DBL_TRUE_MIN = 5e-324


@dataclass(frozen=True)
class FloatFormat:
    """One floating-point format: precision (with the implicit bit) and exponent range.

    ``finite`` is how the largest finite value is found: ``"ieee"`` (the top
    exponent is reserved for inf/NaN), ``"nan_at_max"`` (only the all-ones
    pattern is NaN, as in ``f8E4M3FN``) or ``"all_finite"`` (no top exponent is
    reserved: FNUZ formats, the f4/f6 formats and ``f8E8M0FNU``).
    """

    name: str
    precision: int
    emax: int
    emin: int
    finite: str

    @cached_property
    def largest(self) -> Fraction:
        """The largest finite value, exactly."""
        ulps = {"ieee": 1, "all_finite": 1, "nan_at_max": 2}[self.finite]
        return (2 - Fraction(2) ** (ulps - self.precision)) * Fraction(2) ** self.emax

    @cached_property
    def smallest(self) -> Fraction:
        """The smallest positive value (a denormal where the format has them), exactly."""
        return Fraction(2) ** (self.emin - (self.precision - 1))

    @cached_property
    def scale_range(self) -> tuple[float, float]:
        """The range a scale of this expressed type must lie in, as doubles.

        MLIR checks ``getSmallest(sem)`` <= scale <= ``getLargest(sem)``; for f80
        and f128 (whose range exceeds a double, and on which MLIR 22 aborts) the
        check is the double's own range, since scales are doubles.
        """
        lo = float(self.smallest) if self.smallest >= Fraction(_DBL_TRUE_MIN) else _DBL_TRUE_MIN
        hi = float(self.largest) if self.largest <= Fraction(_DBL_MAX) else _DBL_MAX
        return lo, hi


_TABLE = [
    FloatFormat("f16", 11, 15, -14, "ieee"),
    FloatFormat("bf16", 8, 127, -126, "ieee"),
    FloatFormat("tf32", 11, 127, -126, "ieee"),
    FloatFormat("f32", 24, 127, -126, "ieee"),
    FloatFormat("f64", 53, 1023, -1022, "ieee"),
    FloatFormat("f80", 64, 16383, -16382, "ieee"),
    FloatFormat("f128", 113, 16383, -16382, "ieee"),
    FloatFormat("f8E5M2", 3, 15, -14, "ieee"),
    FloatFormat("f8E4M3", 4, 7, -6, "ieee"),
    FloatFormat("f8E3M4", 5, 3, -2, "ieee"),
    FloatFormat("f8E4M3FN", 4, 8, -6, "nan_at_max"),
    FloatFormat("f8E5M2FNUZ", 3, 15, -15, "all_finite"),
    FloatFormat("f8E4M3FNUZ", 4, 7, -7, "all_finite"),
    FloatFormat("f8E4M3B11FNUZ", 4, 4, -10, "all_finite"),
    FloatFormat("f8E8M0FNU", 1, 127, -127, "all_finite"),
    FloatFormat("f6E2M3FN", 4, 2, 0, "all_finite"),
    FloatFormat("f6E3M2FN", 3, 4, -2, "all_finite"),
    FloatFormat("f4E2M1FN", 2, 2, 0, "all_finite"),
]

FLOAT_FORMATS: dict[str, FloatFormat] = {f.name: f for f in _TABLE}
F64 = FLOAT_FORMATS["f64"]


def float_format(name: str) -> FloatFormat | None:
    """The format called ``name`` in MLIR's syntax, or None."""
    return FLOAT_FORMATS.get(name)


def _floor_log2(q: Fraction) -> int:
    n, d = q.numerator, q.denominator
    e = n.bit_length() - d.bit_length()
    # 2**e <= n/d < 2**(e+1) after at most one correction
    if (n << max(-e, 0)) < (d << max(e, 0)):
        e -= 1
    return e


def round_to_format(value: Fraction | float, fmt: FloatFormat) -> Fraction | None:
    """Round ``value`` to the nearest value of ``fmt``, ties to even; None on overflow."""
    q = Fraction(value)
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = max(_floor_log2(a), fmt.emin)
    quantum = Fraction(2) ** (e - (fmt.precision - 1))
    r = round(a / quantum) * quantum  # Fraction.__round__ rounds half to even
    if r > fmt.largest:
        return None
    return sign * r


_NUMPY_NATIVE: dict[str, type[np.float16] | type[np.float32]] = {"f16": np.float16, "f32": np.float32}


def round_array_to_format(values: npt.NDArray[np.float64], fmt: FloatFormat) -> npt.NDArray[np.float64]:
    """``round_to_format`` over an array of doubles; values past the largest become inf.

    numpy's own float64 -> float16/float32 casts round to nearest even in one
    step, so they are used where they exist; other formats go value by value.
    """
    native = _NUMPY_NATIVE.get(fmt.name)
    if native is not None:
        with np.errstate(over="ignore"):
            return values.astype(native).astype(np.float64)
    if fmt.precision >= 53:
        return values.astype(np.float64, copy=True)
    rounded = [round_to_format(float(v), fmt) for v in values.flat]
    flat = [float(r) if r is not None else math.inf for r in rounded]
    return np.array(flat, dtype=np.float64).reshape(values.shape)


def _to_string(
    negative: bool,
    sig: int,
    exp: int,
    sem_precision: int,
    format_precision: int,
    max_padding: int,
    truncate_zero: bool,
) -> str:
    """LLVM's ``toStringImpl`` for the value ``sig * 2**exp``, ``sig > 0``."""
    out = "-" if negative else ""
    if format_precision == 0:
        format_precision = 2 + sem_precision * 59 // 196
    trailing = (sig & -sig).bit_length() - 1
    exp += trailing
    sig >>= trailing
    if exp > 0:
        sig <<= exp
        exp = 0
    elif exp < 0:
        sig *= 5 ** (-exp)  # value is now sig * 10**exp
    # AdjustToPrecision on the integer: drop (truncate) digits it cannot need.
    bits_required = (format_precision * 196 + 58) // 59
    bits = sig.bit_length()
    if bits > bits_required:
        tens = (bits - bits_required) * 59 // 196
        if tens:
            exp += tens
            sig //= 10**tens
    digits = str(sig)
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)
    digits = stripped
    # AdjustToPrecision on the digits: round half up on the first dropped digit.
    n = len(digits)
    if n > format_precision:
        kept = digits[:format_precision]
        if digits[format_precision] < "5":
            kept = kept.rstrip("0")
            exp += n - len(kept)
            digits = kept
        else:
            kept = kept.rstrip("9")
            if not kept:
                digits = "1"
                exp += n
            else:
                digits = kept[:-1] + chr(ord(kept[-1]) + 1)
                exp += n - len(digits)
    nd = len(digits)
    if max_padding == 0:
        scientific = True
    elif exp >= 0:
        scientific = exp > max_padding or nd + exp > format_precision
    else:
        msd = exp + nd - 1
        scientific = msd < 0 and -msd > max_padding
    if scientific:
        e10 = exp + nd - 1
        text = digits[0] + "."
        text += "0" if nd == 1 and truncate_zero else digits[1:]
        if not truncate_zero and format_precision > nd - 1:
            text += "0" * (format_precision - nd + 1)
        text += "E" if truncate_zero else "e"
        text += "+" if e10 >= 0 else "-"
        exp_digits = str(abs(e10))
        if not truncate_zero and len(exp_digits) < 2:
            exp_digits = "0" + exp_digits
        return out + text + exp_digits
    if exp >= 0:
        return out + digits + "0" * exp
    whole = exp + nd
    if whole > 0:
        return out + digits[:whole] + "." + digits[whole:]
    return out + "0." + "0" * (-whole) + digits


def _double_hex(value: float) -> str:
    (bits,) = struct.unpack("<Q", struct.pack("<d", value))
    return f"0x{bits:X}"


def _same(a: Fraction | None, value: float) -> bool:
    # bitwise equality: a zero must also agree in sign, which Fraction cannot hold
    return a is not None and a == Fraction(value) and (value != 0 or a == 0)


def _reads_back(text: str, value: float, fmt: FloatFormat) -> bool:
    """Whether decimal ``text`` rounds (to nearest, ties to even) to ``value`` in ``fmt``.

    ``round_to_format`` on the text's exact Fraction costs ~40 us a value (a per-channel type prints
    thousands). Python's ``float()`` parses correctly rounded, so for doubles it is the answer; for
    f32 and f16, numpy rounds that double once more, which is the text's own rounding unless the
    double lies exactly halfway between two values of ``fmt`` (rounding twice could then go the other
    way): only then the Fractions decide."""
    parsed = float(text)
    if fmt.name == "f64":
        return parsed == value
    native = _NUMPY_NATIVE.get(fmt.name)
    if native is not None and math.isfinite(parsed):
        with np.errstate(over="ignore"):
            nearest = native(parsed)
        rounded = float(nearest)
        if rounded == parsed:  # a value of fmt itself: the text's nearest too
            return rounded == value
        beside = np.nextafter(nearest, native(math.inf) if parsed > rounded else native(-math.inf))
        if 2.0 * parsed != rounded + float(beside):  # exact: adjacent values of fmt add exactly
            return rounded == value
    return _same(round_to_format(Fraction(text), fmt), value)


def format_float(value: float, fmt: FloatFormat = F64, in_range: tuple[float, float] | None = None) -> str:
    """Print ``value`` (exactly representable in ``fmt``) as MLIR's ``printFloatValue``.

    First the 6-digit scientific form if it reads back (in ``fmt``) to the same
    value; otherwise APFloat's default form (up to ``2 + p*59/196`` digits,
    plain or upper-case ``E``) if it contains a dot; otherwise the bit pattern.
    One deliberate difference: the bit pattern is always that of the *double*,
    which is how MLIR's parser reads hex scales back. (MLIR prints a
    sub-channel scale's own bits, e.g. ``0x4B3C614E`` for an f32 scale of
    12345678.0, and then cannot read its own output.)

    With ``in_range``, a decimal text is only used if it also reads, as a
    double, inside that range: MLIR range-checks the double it parsed before
    rounding a sub-channel scale, so it prints the f16 scale 2**-24 as
    ``5.960460e-08`` and then rejects that text. requant moves to the next
    form instead (here ``5.9605E-8``).
    """
    if math.isfinite(value):
        negative = math.copysign(1.0, value) < 0
        if value == 0:
            mantissa = "0." + "0" * 6 + "e+00"
            return ("-" if negative else "") + mantissa
        num, den = abs(value).as_integer_ratio()
        exp = -(den.bit_length() - 1)

        def readable(text: str) -> bool:
            return in_range is None or in_range[0] <= float(text) <= in_range[1]

        # a double no 6-digit text reads back to skips that form (a per-channel type's float32 scales
        # all do): if APFloat's rounding (half up) of its exact digits read back, Python's correctly
        # rounded one would too, as they differ only on an exact tie, whose 7 digits no 6 give
        if fmt.name != "f64" or float(f"{value:.5e}") == value:
            text = _to_string(negative, num, exp, fmt.precision, 6, 0, False)
            if _reads_back(text, value, fmt) and readable(text):
                return text
        text = _to_string(negative, num, exp, fmt.precision, 0, 3, True)
        if "." in text and readable(text):
            return text
    return _double_hex(value)


def format_diag(value: float) -> str:
    """A double as MLIR's diagnostics print it (``%e``, with ``INF``/``NAN``)."""
    if math.isinf(value):
        return "-INF" if value < 0 else "INF"
    if math.isnan(value):
        return "NAN"
    return f"{value:e}"
