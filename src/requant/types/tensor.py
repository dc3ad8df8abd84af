"""Containers of quantized types (``tensor<2x?x!quant.uniform<...>>``), their integrity rules, and cast checks.

The integrity rules are those seed 001 states for per-axis and sub-channel
types, with the messages MLIR 22's ``quant`` verifiers print.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from requant.errors import QuantTypeError
from requant.types.floats import FLOAT_FORMATS
from requant.types.quantized import (
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformType,
)
from requant.types.syntax import Parser

__all__ = ["TensorType", "parse_tensor_type", "verify_blocks", "verify_cast", "verify_container"]

_INTEGER = re.compile(r"(si|ui|i)([1-9][0-9]*)")
Element = QuantizedType | str


@dataclass(frozen=True)
class TensorType:
    """A scalar, ranked tensor or unranked tensor of a builtin or quantized element type.

    ``shape`` is ``None`` for scalars and unranked tensors; a dynamic
    dimension is ``None`` inside it. Builtin elements are their MLIR spelling
    (``"f32"``, ``"i8"``).
    """

    element: Element
    shape: tuple[int | None, ...] | None = None
    kind: Literal["scalar", "ranked", "unranked"] = "scalar"

    def __post_init__(self) -> None:
        if (self.kind == "ranked") != (self.shape is not None):
            raise QuantTypeError(f"a {self.kind} type {'needs' if self.kind == 'ranked' else 'has no'} shape")

    @property
    def is_tensor(self) -> bool:
        """Whether this is a tensor (ranked or not) rather than a scalar."""
        return self.kind != "scalar"

    @property
    def rank(self) -> int | None:
        """The rank of a ranked tensor, 0 for a scalar, None when unranked."""
        return None if self.kind == "unranked" else len(self.shape or ())

    def __str__(self) -> str:
        if self.kind == "scalar":
            return str(self.element)
        if self.shape is None:
            return f"tensor<*x{self.element}>"
        dims = "".join(("?" if d is None else str(d)) + "x" for d in self.shape)
        return f"tensor<{dims}{self.element}>"


def _element(parser: Parser) -> Element:
    if parser.peek() == "!":
        return parser.quantized_type()
    parser.skip()
    at = parser.pos
    name = parser.ident()
    if name is None:
        parser.fail("expected an element type")
    if name in FLOAT_FORMATS or name == "index" or _INTEGER.fullmatch(name):
        return name
    parser.fail(f"expected a builtin float or integer type or a quantized type, got '{name}'", at)


def _tensor(parser: Parser) -> TensorType:
    parser.expect("<")
    if parser.accept("*"):
        parser.expect("x")
        element = _element(parser)
        parser.expect(">")
        return TensorType(element, None, "unranked")
    dims: list[int | None] = []
    while True:
        parser.skip()
        text, pos = parser.text, parser.pos
        if pos < len(text) and text[pos].isdigit():
            end = pos
            while end < len(text) and text[end].isdigit():
                end += 1
            if end - pos > 19:
                parser.fail("dimension too large", pos)
            dims.append(int(text[pos:end]))
            parser.pos = end
        elif parser.accept("?"):
            dims.append(None)
        else:
            break
        parser.expect("x")
    element = _element(parser)
    parser.expect(">")
    return TensorType(element, tuple(dims), "ranked")


def parse_tensor_type(text: str) -> TensorType:
    """Parse ``tensor<2x?x4x!quant.uniform<...>>``, ``tensor<*x...>``, or a bare element type.

    The result satisfies the integrity rules (see :func:`verify_container`).
    """
    parser = Parser(text)
    parser.skip()
    if parser.text.startswith("tensor", parser.pos) and parser.text[parser.pos + 6 : parser.pos + 7] in "< \t\n":
        parser.pos += 6
        result = _tensor(parser)
    else:
        result = TensorType(_element(parser))
    parser.finish()
    verify_container(result)
    return result


def verify_container(t: TensorType) -> None:
    """Check per-axis and sub-channel integrity of ``t``'s element against its shape."""
    q = t.element
    if isinstance(q, UniformQuantizedPerAxisType):
        if t.kind == "scalar":
            raise QuantTypeError("scalar types may not use per-axis quantization")
        if t.shape is None:
            return
        if q.axis >= len(t.shape):
            raise QuantTypeError("quantized dimension must be less than tensor rank")
        size = t.shape[q.axis]
        if size is not None and size != len(q.scales):
            raise QuantTypeError(
                f"quantized dimension size does not match number of scales "
                f"(dimension {q.axis} has size {size}, the type has {len(q.scales)} scales)"
            )
    elif isinstance(q, UniformQuantizedSubChannelType):
        if t.kind == "scalar":
            raise QuantTypeError("scalar types may not use sub-channel quantization")
        if t.shape is None:
            raise QuantTypeError("tensor containing the sub-channel quantized type must be ranked")
        verify_blocks(q, t.shape)


def verify_blocks(q: UniformQuantizedSubChannelType, shape: tuple[int | None, ...]) -> None:
    """Check a sub-channel type's blocks and scale grid against a ranked shape (None: dynamic)."""
    if q.scales.ndim != len(shape):
        raise QuantTypeError(f"Rank of scales {q.scales.ndim} must match the rank of the tensor {len(shape)}")
    if any(d == 0 for d in shape):
        raise QuantTypeError("tensor dimension size of zero is not allowed with sub-channel quantization")
    blocks = q.block_size_map
    for axis, size in enumerate(shape):
        block = blocks.get(axis)
        if block is not None and size is not None and size % block:
            raise QuantTypeError(
                f"tensor dimension size {size} at axis {axis} must be divisible by the corresponding block size {block}"
            )
        if block is None:
            expected: int | None = 1
        else:
            expected = None if size is None else size // block
        if expected is not None and q.scales.shape[axis] != expected:
            raise QuantTypeError(
                f"dimension size {q.scales.shape[axis]} of scales tensor at axis {axis} should match "
                f"(tensor dimension at axis / block sizes at axis) = {expected}"
            )


def _same_shape(a: TensorType, b: TensorType) -> bool:
    return a.kind == b.kind and a.shape == b.shape


def verify_cast(op: str, source: str, result: str) -> None:
    """Check ``quant.<op> %x : source to result`` as MLIR's verifier would (seed 001's rules).

    ``op`` is ``"qcast"``, ``"dcast"`` or ``"scast"``; ``source`` and ``result``
    are type texts. Quantized operands must be ``!quant.uniform`` (as the seed
    says; MLIR 22 also lets ``!quant.any`` and ``!quant.calibrated`` through).
    Raises :class:`~requant.errors.QuantTypeError`; returns None when valid.
    """
    if op not in ("qcast", "dcast", "scast"):
        raise QuantTypeError(f"unknown cast {op!r}; expected one of 'qcast', 'dcast', 'scast'")
    src, dst = parse_tensor_type(source), parse_tensor_type(result)

    def is_float(t: TensorType) -> bool:
        return isinstance(t.element, str) and t.element in FLOAT_FORMATS

    def is_uniform(t: TensorType) -> bool:
        return isinstance(t.element, UniformType)

    def is_signless(t: TensorType) -> bool:
        return isinstance(t.element, str) and re.fullmatch(r"i[0-9]+", t.element) is not None

    def need(cond: bool, which: str, what: str, t: TensorType) -> None:
        if not cond:
            raise QuantTypeError(f"'quant.{op}' op {which} must be scalar or tensor of {what}, but got '{t}'")

    if op == "qcast":
        need(is_float(src), "operand #0", "floating-point", src)
        need(is_uniform(dst), "result #0", "!quant.uniform type", dst)
        floating, quantized = src, dst
    elif op == "dcast":
        need(is_uniform(src), "operand #0", "!quant.uniform type", src)
        need(is_float(dst), "result #0", "floating-point", dst)
        floating, quantized = dst, src
    else:
        for which, t in (("operand #0", src), ("result #0", dst)):
            need(is_signless(t) or is_uniform(t), which, "signless integer or !quant.uniform type", t)
        if is_uniform(src) == is_uniform(dst):
            raise QuantTypeError(
                "'quant.scast' op failed to verify that input must be integer and result must be quantized, "
                "or vice versa"
            )
        floating, quantized = (dst, src) if is_uniform(src) else (src, dst)
    if not _same_shape(src, dst):
        raise QuantTypeError(
            f"'quant.{op}' op failed to verify that input and result are both scalars or both tensors "
            f"with matching shape ('{src}' vs '{dst}')"
        )
    q = quantized.element
    assert isinstance(q, UniformType) and isinstance(floating.element, str)
    if op == "scast":
        width = int(floating.element[1:])
        if width != q.storage_width:
            raise QuantTypeError(
                f"storage type in quantized type expected to match integer type ({q.storage} vs {floating.element})"
            )
    elif q.expressed != floating.element:
        raise QuantTypeError(
            f"expressed type in quantized type expected to match float type ({q.expressed} vs {floating.element})"
        )
