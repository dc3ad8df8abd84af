"""MLIR's textual syntax for quantized types and tensors of them: the parser.

Accepts what MLIR 22's ``quant`` dialect parser accepts (``TypeParser.cpp``,
with MLIR's lexer rules for numbers, whitespace and ``//`` comments), and
rejects what it rejects, with MLIR's messages and a line:column location.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Any, NoReturn

from requant.errors import QuantTypeError
from requant.types.floats import FLOAT_FORMATS, FloatFormat, format_diag
from requant.types.quantized import (
    AnyQuantizedType,
    CalibratedQuantizedType,
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
)
from requant.types.storage import MAX_STORAGE_BITS, StorageType

__all__ = ["MAX_RANK", "Parser", "parse_type"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_$.]*")
_BANG_IDENT = re.compile(r"![A-Za-z_][A-Za-z0-9_$.\-]*")
_NUMBER = re.compile(r"0x[0-9A-Fa-f]+|[0-9]+(\.[0-9]*([eE][-+]?[0-9]+)?)?")
_INT_TYPE = re.compile(r"(si|ui|i)([0-9]+)")
_INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_RANK = 64  # deeper scale grids are refused rather than overflowing the parser's stack


@dataclass
class _Number:
    text: str
    column: int

    @property
    def is_float(self) -> bool:
        return "." in self.text and not self.text.startswith("0x")


class Parser:
    """A cursor over MLIR type text; shared by :func:`parse_type` and the tensor parser."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise QuantTypeError(f"type text must be a string, got {type(text).__name__}")
        self.text = text
        self.pos = 0

    # -- low level -------------------------------------------------------------------
    def fail(self, message: str, at: int | None = None) -> NoReturn:
        at = self.pos if at is None else at
        line = self.text.count("\n", 0, at) + 1
        start = self.text.rfind("\n", 0, at) + 1
        end = self.text.find("\n", at)
        source = self.text[start : end if end >= 0 else len(self.text)]
        caret = " " * (at - start) + "^"
        raise QuantTypeError(f"{line}:{at - start + 1}: {message}\n  {source}\n  {caret}")

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t\r\n":
                self.pos += 1
            elif text.startswith("//", self.pos):
                newline = text.find("\n", self.pos)
                self.pos = n if newline < 0 else newline + 1
            else:
                return

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos : self.pos + 1]

    def accept(self, token: str) -> bool:
        if self.peek() == token:
            self.pos += 1
            return True
        return False

    def expect(self, token: str) -> None:
        if not self.accept(token):
            self.fail(f"expected '{token}'")

    def at_end(self) -> bool:
        return self.peek() == ""

    def ident(self) -> str | None:
        self.skip()
        match = _IDENT.match(self.text, self.pos)
        if match is None:
            return None
        self.pos = match.end()
        return match.group()

    def _number(self) -> _Number | None:
        self.skip()
        match = _NUMBER.match(self.text, self.pos)
        if match is None:
            return None
        self.pos = match.end()
        return _Number(match.group(), match.start())

    def integer(self, bounds: tuple[int, int] = _INT64) -> int:
        """MLIR's ``parseInteger``: ``-``? then a decimal or ``0x`` hex integer."""
        negative = self.accept("-")
        start = self.pos
        number = self._number()
        if number is None or number.is_float:
            self.fail("expected integer value", number.column if number else start)
        if len(number.text) > 40:  # past int64 whatever the digits; int() of huge strings is slow or refused
            self.fail("integer value too large", number.column)
        value = int(number.text, 0) if number.text.startswith("0x") else int(number.text, 10)
        value = -value if negative else value
        if not bounds[0] <= value <= bounds[1]:
            self.fail("integer value too large", number.column)
        return value

    def floating(self) -> tuple[float, int]:
        """MLIR's ``parseFloat(double&)``; returns the value and its column."""
        negative = self.accept("-")
        self.skip()
        at = self.pos
        number = self._number()
        if number is None:
            self.fail("expected floating point literal", at)
        if number.is_float:
            value = float(number.text)  # round to nearest even; overflow to inf, as LLVM
            return (-value if negative else value), at
        if not number.text.startswith("0x"):
            self.fail(
                "unexpected decimal integer literal for a floating point value "
                "(add a trailing dot to make the literal a float)",
                at,
            )
        if negative:
            self.fail("hexadecimal float literal should not have a leading minus", at)
        bits = int(number.text, 16)
        if bits.bit_length() > 64:
            self.fail("hexadecimal float constant out of range for type", at)
        return struct.unpack("<d", struct.pack("<Q", bits))[0], at

    # -- pieces of quantized types ---------------------------------------------------
    def storage(self) -> StorageType:
        self.skip()
        at = self.pos
        name = self.ident()
        if name is None:
            self.fail("expected storage type")
        match = _INT_TYPE.fullmatch(name)
        if match is not None:
            signed, digits = match.group(1) != "ui", match.group(2)
        elif name in FLOAT_FORMATS or name == "index":
            self.fail(f"illegal storage type: expected an integer type, got '{name}'", at)
        elif not name.startswith("u"):
            self.fail("illegal storage type prefix", at)
        elif not name[1:].isdigit():
            self.fail("expected storage type width", at)
        else:
            signed, digits = False, name[1:]
        width = int(digits)
        if width == 0 or width > MAX_STORAGE_BITS:
            self.fail(f"illegal storage type size: {width}", at)
        return StorageType(signed, width)

    def storage_range(self, storage: StorageType) -> tuple[int | None, int | None]:
        if not self.accept("<"):
            return None, None
        self.skip()
        at_min = self.pos
        lo = self.integer()
        self.expect(":")
        self.skip()
        at_max = self.pos
        hi = self.integer()
        self.expect(">")
        if lo < storage.min:
            self.fail(f"illegal storage type minimum: {lo}", at_min)
        if hi > storage.max:
            self.fail(f"illegal storage type maximum: {hi}", at_max)
        return lo, hi

    def float_type(self) -> FloatFormat:
        self.skip()
        at = self.pos
        name = self.ident()
        if name is None:
            self.fail("expected a floating-point expressed type", at)
        fmt = FLOAT_FORMATS.get(name)
        if fmt is None:
            self.fail(f"invalid kind of type specified: expected a floating-point type, got '{name}'", at)
        return fmt

    def scale_zero(self, fmt: FloatFormat, storage: StorageType, in_range: bool = False) -> tuple[float, int]:
        """``scale[:zero_point]``; ``in_range``: the zero point must fit the storage type (a sub-channel
        type's: MLIR aborts on one outside ``[0, 2**bits - 1]``; others are MLIR's to accept and the
        type's ``problems()`` to name)."""
        scale, at = self.floating()
        lo, hi = fmt.scale_range
        if not lo <= scale <= hi:
            self.fail(
                f"scale {format_diag(scale)} out of expressed type range [{format_diag(lo)}, {format_diag(hi)}]",
                at,
            )
        if not self.accept(":"):
            return scale, 0
        self.skip()
        at = self.pos
        zero_point = self.integer()
        if in_range and not storage.min <= zero_point <= storage.max:
            self.fail(f"zero point {zero_point} out of storage type {storage} range [{storage.min}, {storage.max}]", at)
        return scale, zero_point

    def dense(
        self, fmt: FloatFormat, storage: StorageType, scales: list[float], zps: list[int], depth: int = 1
    ) -> list[int]:
        """A nested ``{...}`` list after its opening brace; returns its shape."""
        if depth > MAX_RANK:
            self.fail(f"scale list nested deeper than {MAX_RANK} levels")
        inner: list[int] | None = None
        size = 0
        while True:
            if self.accept("{"):
                dims = self.dense(fmt, storage, scales, zps, depth + 1)
            else:
                scale, zp = self.scale_zero(fmt, storage, in_range=True)
                scales.append(scale)
                zps.append(zp)
                dims = []
            size += 1
            if inner is None:
                inner = dims
            elif dims != inner:
                self.fail("tensor literal is invalid; ranks are not consistent between elements")
            if not self.accept(","):
                break
        self.expect("}")
        return [size, *(inner or [])]

    # -- whole types -----------------------------------------------------------------
    def quantized_type(self) -> QuantizedType:
        """``!quant.KIND<...>`` or ``!quant<KIND<...>>`` at the cursor."""
        self.skip()
        start = self.pos
        match = _BANG_IDENT.match(self.text, self.pos)
        if match is None:
            self.fail("expected a quantized type such as '!quant.uniform<...>'")
        name = match.group()[1:]
        self.pos = match.end()
        dialect, _, kind = name.partition(".")
        if dialect != "quant":
            self.fail(f"expected the 'quant' dialect, got '!{name}'", start)
        if kind:
            if self.text[self.pos : self.pos + 1] != "<":
                self.fail("expected '<' right after the type name")
            return self._body(kind, start + len("!quant."))
        if self.text[self.pos : self.pos + 1] != "<":
            self.fail("expected '<' right after '!quant'")
        self.pos += 1
        self.skip()
        at = self.pos
        kind = self.ident() or ""
        result = self._body(kind, at)
        self.expect(">")
        return result

    def _body(self, kind: str, at: int) -> QuantizedType:
        parsers = {"uniform": self._uniform, "any": self._any, "calibrated": self._calibrated}
        if kind not in parsers:
            self.fail(f"unknown quantized type {kind}", at)
        try:
            return parsers[kind]()
        except QuantTypeError as exc:
            if re.match(r"\d+:\d+: ", str(exc)):
                raise
            self.fail(str(exc), at)

    def _uniform(self) -> QuantizedType:
        self.expect("<")
        storage = self.storage()
        lo, hi = self.storage_range(storage)
        self.expect(":")
        fmt = self.float_type()
        axis: int | None = None
        blocks: list[tuple[int, int]] | None = None
        if self.accept(":"):
            if self.accept("{"):
                blocks = []
                if not self.accept("}"):
                    while True:
                        block_axis = self.integer((-(1 << 31), (1 << 31) - 1))
                        self.expect(":")
                        blocks.append((block_axis, self.integer()))
                        if not self.accept(","):
                            break
                    self.expect("}")
            else:
                axis = self.integer((-(1 << 31), (1 << 31) - 1))
        self.expect(",")
        st = str(storage)
        if blocks is not None:
            self.expect("{")
            scales: list[float] = []
            zps: list[int] = []
            shape = self.dense(fmt, storage, scales, zps)
            self.expect(">")
            grid = _reshape(scales, shape), _reshape(zps, shape)
            return UniformQuantizedSubChannelType(st, fmt.name, blocks, grid[0], grid[1], lo, hi)
        if axis is not None:
            self.expect("{")
            pairs = [self.scale_zero(fmt, storage)]
            while self.accept(","):
                pairs.append(self.scale_zero(fmt, storage))
            self.expect("}")
            self.expect(">")
            return UniformQuantizedPerAxisType(st, fmt.name, axis, [s for s, _ in pairs], [z for _, z in pairs], lo, hi)
        scale, zero_point = self.scale_zero(fmt, storage)
        self.expect(">")
        return UniformQuantizedType(st, fmt.name, scale, zero_point, lo, hi)

    def _any(self) -> QuantizedType:
        self.expect("<")
        storage = self.storage()
        lo, hi = self.storage_range(storage)
        expressed = self.float_type().name if self.accept(":") else None
        self.expect(">")
        return AnyQuantizedType(str(storage), expressed, lo, hi)

    def _calibrated(self) -> QuantizedType:
        self.expect("<")
        self.skip()
        at = self.pos
        fmt = self.float_type()
        try:
            self.expect("<")
            lo, _ = self.floating()
            self.expect(":")
            hi, _ = self.floating()
            self.expect(">")
        except QuantTypeError as exc:
            raise QuantTypeError(f"{exc}\n(calibrated values must be present)") from None
        self.expect(">")
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
            self.fail(f"illegal min and max: ({format_diag(lo)}:{format_diag(hi)})", at)
        return CalibratedQuantizedType(fmt.name, lo, hi)

    def finish(self) -> None:
        if not self.at_end():
            self.fail(f"found trailing characters: '{self.text[self.pos :]}'")


def _reshape(flat: list[float] | list[int], shape: list[int]) -> Any:
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_reshape(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def parse_type(text: str) -> QuantizedType:
    """Parse ``!quant.uniform<...>``, ``!quant.any<...>`` or ``!quant.calibrated<...>``.

    Raises :class:`~requant.errors.QuantTypeError` with MLIR's message and a
    ``line:column`` location for anything MLIR rejects.
    """
    parser = Parser(text)
    result = parser.quantized_type()
    parser.finish()
    return result
