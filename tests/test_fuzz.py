"""Fuzzing the parsers: any string gives a type or a QuantTypeError, quickly, never anything else."""

from __future__ import annotations

import contextlib
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from requant.errors import QuantTypeError
from requant.types import parse_tensor_type, parse_type

# Fragments of the grammar make the fuzzer reach deep into the parser, not just its first check.
TOKENS = [
    "!quant.uniform",
    "!quant.any",
    "!quant.calibrated",
    "!quant",
    "tensor",
    "<",
    ">",
    ":",
    ",",
    "{",
    "}",
    "-",
    "?",
    "*",
    "x",
    "i8",
    "u8",
    "si4",
    "ui16",
    "i32",
    "i0",
    "u33",
    "f32",
    "f16",
    "bf16",
    "f80",
    "f8E4M3FN",
    "1.0",
    "0.5",
    "1.e5",
    "3",
    "0x3FF0000000000000",
    "0x7FF8000000000000",
    "1e400",
    "1.0e-400",
    "127",
    "-128",
    "9223372036854775808",
    " ",
    "\n",
    "// c\n",
    "2x",
    "?x",
    "*x",
    "uniform",
    "nan",
    "inf",
]


def _parse_seconds(text: str) -> float:
    start = time.perf_counter()
    for parse in (parse_type, parse_tensor_type):
        with contextlib.suppress(QuantTypeError):
            parse(text)
    return time.perf_counter() - start


def _parses_or_rejects(text: str) -> None:
    """Parsed or refused (a QuantTypeError), never a hang: a parse slower than a second is timed again, and fails
    only when it is slow again (a pathological parse is slow every time; a stall of a shared machine once: ' f80',
    40 us, once took more than a second)."""
    slow = _parse_seconds(text) >= 1.0 and _parse_seconds(text) >= 1.0
    assert not slow, f"slow parse of {text[:200]!r}... ({len(text)} characters)"


@settings(max_examples=2000)
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map("".join))
def test_token_soup(text: str) -> None:
    _parses_or_rejects(text)


@settings(max_examples=1000)
@given(st.text(max_size=200))
def test_arbitrary_text(text: str) -> None:
    _parses_or_rejects(text)


@settings(max_examples=500)
@given(st.text(alphabet="{}<>:,-0123456789.x", max_size=300))
def test_deep_nesting_and_numbers(text: str) -> None:
    _parses_or_rejects("!quant.uniform<i8:f32:{0:1}, " + text)


def test_pathological_inputs_are_fast() -> None:
    for text in [
        "!quant.uniform<i8:f32:{0:1}, " + "{" * 5000 + "1.0" + "}" * 5000 + ">",
        "!quant.uniform<i8:f32:0, {" + ", ".join(["1.0"] * 20000) + "}>",
        "!quant.uniform<i8:f32, " + "9" * 5000 + ".0>",
        "!quant.uniform<i8:f32, 1.0:" + "9" * 5000 + ">",
        "tensor<" + "1x" * 5000 + "f32>",
        "!quant.uniform<i8:f32, 0x" + "F" * 5000 + ">",
    ]:
        _parses_or_rejects(text)
