"""The integer TOSA program requant writes: its ops, inputs and outputs (:class:`Edge`), and TOSA's
fixed-point scales (:func:`multiplier_shift`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.errors import RequantError
from requant.types import UniformQuantizedType, dcast, qcast

# __all__ = ["Edge", "TosaError", "TosaOp", "TosaProgram", "lower_to_tosa", "multiplier_shift"]

Array = npt.NDArray[Any]
SHAPE_OPS = ("Shape", "Constant")  # other ops on int64 shapes are skipped by their type
ROUNDING = ("single_round", "double_round")
KERNELS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # a Relu or Clip after one is written with it
STREAM_BITS = 16  # an int32 stream of sums starts this many bits finer than the coarser int8 input


class TosaError(RequantError):
    """A model (or part of one) the tosa-int8 backend cannot write as integer TOSA; ``node``: the
    node to blame, when one is."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


def named(node: ir.Node) -> str:
    """The node's name, or (nameless) its first output's: what an error names it by."""
    return str(node.name or (node.outputs[0].name if node.outputs else node.op_type))


@dataclass(frozen=True)
class Edge:
    """A model input or output: its name, shape, and the int8 scale and zero point it is exchanged in;
    or (``dtype`` "i32") integers that are not quantized values: an output of an ArgMax's indices, an
    input of indices a Gather reads (token ids)."""

    name: str
    shape: tuple[int, ...]
    scale: float
    zero_point: int
    dtype: str = "i8"

    def quantize(self, x: npt.ArrayLike) -> Array:
        """What the host gives the program for float ``x`` (``qcast``, half to even, as ONNX Runtime);
        for an input of indices (``dtype`` "i32": token ids), the integers as int32."""
        if self.dtype != "i8":
            return np.asarray(x).astype(np.int32)
        return qcast(np.asarray(x, np.float32), UniformQuantizedType("i8", "f32", self.scale, self.zero_point))

    def dequantize(self, q: npt.ArrayLike) -> Array:
        """The float values of the program's int8 ``q`` (``dcast``); integers as they are."""
        if self.dtype != "i8":
            return np.asarray(q)
        return dcast(np.asarray(q), UniformQuantizedType("i8", "f32", self.scale, self.zero_point))


@dataclass
class TosaOp:
    """One op: ``kind`` ("conv2d", "rescale", "const"...), operand and result names, attributes, the
    result's shape and element type, and a constant's value."""

    kind: str
    inputs: list[str]
    output: str
    shape: tuple[int, ...]
    dtype: str  # "i8" or "i32"
    attrs: dict[str, Any] = field(default_factory=dict)
    value: Array | None = None


@dataclass
class TosaProgram:
    """An integer-only TOSA function: its quantized inputs and outputs and its ops in order."""

    inputs: list[Edge]
    outputs: list[Edge]
    ops: list[TosaOp]
    arguments: list[str]  # the ops' names of the inputs
    results: list[str]  # the ops' names of the outputs
    types: dict[str, str]  # each quantized tensor of the model: its !quant.uniform type (the header)
    rounding: str = "single_round"  # every rescale's: TOSA's SINGLE_ROUND, or DOUBLE_ROUND (TFLite's)


def multiplier_shift(scale: float) -> tuple[int, int]:
    """``scale`` as TOSA's 32-bit fixed point: ``multiplier * 2**-shift``, the multiplier in [2**30, 2**31)."""
    if not (math.isfinite(scale) and scale > 0):
        raise TosaError(f"a rescale needs a positive finite scale, got {scale!r}")
    mantissa, exponent = math.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    multiplier, shift = round(mantissa * (1 << 31)), 31 - exponent
    if multiplier == 1 << 31:
        multiplier, shift = multiplier >> 1, shift - 1
    if not 2 <= shift <= 62:
        raise TosaError(f"the scale {scale!r} needs a shift of {shift}, outside TOSA's [2, 62]")
    return multiplier, shift


@dataclass
class Tensor:
    """An int8 tensor of the program: its op name, its shape as the op holds it, and its layout."""

    name: str
    shape: tuple[int, ...]
    scale: float
    zero_point: int  # int8
    nhwc: bool = False  # a 4-d tensor held as NHWC (its ONNX shape is NCHW)
    wide: bool = False  # an int32 stream (a residual sum), zero point 0
