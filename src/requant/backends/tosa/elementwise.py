"""Elementwise ops: Add and Sub of two tensors on one int32 scale, a constant added or multiplied,
and one-input functions (Sigmoid, Tanh, HardSwish, Gelu...) as a tosa.table of their 256 results.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.lowering import Lowering, constant_value
from requant.backends.tosa.program import (
    STREAM_BITS,
    Array,
    Tensor,
    TosaError,
    named,
)


def table(lo: Lowering, node: ir.Node) -> None:
    """A unary op on int8 values as ``tosa.table``: its 256 results, each the op on the dequantized
    input then quantized (half to even) as the QuantizeLinear after it says: what ONNX Runtime
    computes for the QDQ model, and how it runs QLinearSigmoid itself."""
    x = lo.source(node.inputs[0], node)
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    real = (np.arange(-128, 128, dtype=np.float64) - x.zero_point) * x.scale
    with np.errstate(over="ignore"):
        y = UNARY[node.op_type](real.astype(np.float32), node).astype(np.float64)
    values = np.clip(np.rint(y / out_scale) + out_zp, -128, 127).astype(np.int8)
    name = lo.add("table", [x.name, lo.const(values, "i8")], x.shape, "i8")
    lo.tensors[str(q.outputs[0].name)] = Tensor(name, x.shape, out_scale, out_zp, x.nhwc)


def mul(lo: Lowering, node: ir.Node) -> None:
    """A product of two int8 tensors (or one and an int8 constant), broadcast as ONNX does: both
    to int32 with their zero points removed, ``tosa.mul``, rescaled to the output."""
    rank = max(len(lo.shape_of(v)) for v in node.inputs[:2] if v is not None)
    a, b = (lo.operand(v, node, rank) for v in node.inputs[:2])
    if len(a.shape) == len(b.shape) == 4 and a.nhwc != b.nhwc:
        a, b = lo.nhwc(a), lo.nhwc(b)
    if len(a.shape) != len(b.shape):
        raise TosaError(f"node '{named(node)}' (Mul): operands of ranks {len(a.shape)} and {len(b.shape)}")
    shape = tuple(int(d) for d in np.broadcast_shapes(a.shape, b.shape))
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"Mul '{named(node)}': an input to int32, zero point removed"
    wide = [lo.rescale_to_i32(t, 1.0, why) for t in (a, b)]
    product = lo.add("mul", [*wide, lo.const(np.zeros(1), "i8")], shape, "i32")
    why = f"Mul '{named(node)}': the int32 product to its int8 output"
    result = lo.rescale(product, shape, np.array([a.scale * b.scale / out_scale]), 0, out_zp, "i32", why)
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, shape, out_scale, out_zp, a.nhwc or b.nhwc)


def add_op(lo: Lowering, node: ir.Node) -> None:
    """A sum of two tensors, int8 or int32 streams, on a common int32 scale. Rounded to int8 when
    one QuantizeLinear is all that reads it; otherwise (a residual connection, which requant
    keeps float on ONNX Runtime) it stays an int32 stream: each QuantizeLinear reading it gets
    its own rescale to int8, and the next sum reads the stream. A tensor plus a constant:
    :meth:`add_constant`."""
    values = [v for v in node.inputs[:2] if v is not None]
    fixed = [constant_value(v, node) for v in values]
    if any(c is not None for c in fixed):
        tensor, addend = (values[1], fixed[0]) if fixed[0] is not None else (values[0], fixed[1])
        add_constant(lo, node, tensor, addend)
        return
    lo.sum_to_readers(node, two_tensors(lo, node, "add"))


def sub_op(lo: Lowering, node: ir.Node) -> None:
    """A difference of two tensors (a LayerNorm written out: ``x - mean``), broadcast, on a common
    int32 scale as a sum is (``tosa.sub``), then rescaled to its int8 output. A tensor minus a
    constant is an Add (the target's decomposition); a constant minus a tensor is not lowered."""
    if any(constant_value(v, node) is not None for v in node.inputs[:2] if v is not None):
        raise TosaError(f"node '{named(node)}' (Sub): a constant minus a tensor is not lowered")
    lo.sum_to_readers(node, two_tensors(lo, node, "sub"))


def two_tensors(lo: Lowering, node: ir.Node, kind: str) -> Tensor:
    """``tosa.add`` or ``tosa.sub`` of ``node``'s two tensors (int8, or int32 streams), broadcast (of
    one rank), on one int32 scale: a stream's, or 2**16 times finer than the coarser int8 input."""
    a, b = (lo.wide.get(str(v.name)) or lo.source(v, node) for v in node.inputs[:2] if v is not None)
    if a.nhwc != b.nhwc or a.shape != b.shape:  # one layout for both (a square map hides the difference)
        a, b = lo.nhwc(a), lo.nhwc(b)
    try:
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
    except ValueError:
        shape = ()
    if not shape or len(a.shape) != len(b.shape) or a.nhwc != b.nhwc:
        raise TosaError(f"node '{named(node)}' ({node.op_type}): tensors of shapes {list(a.shape)} and "
                        f"{list(b.shape)} do not broadcast in one rank")  # fmt: skip
    streams = [t for t in (a, b) if t.wide]
    common = streams[0].scale if streams else max(a.scale, b.scale) / (1 << STREAM_BITS)
    result = "sum" if kind == "add" else "difference"
    why = f"{node.op_type} '{named(node)}': an input to the {result}'s int32 scale"
    parts = [lo.rescale_to_i32(t, t.scale / common, why) for t in (a, b)]
    return Tensor(lo.add(kind, parts, shape, "i32"), shape, common, 0, a.nhwc, True)


def add_constant(lo: Lowering, node: ir.Node, value: ir.Value, addend: Array | None) -> None:
    """A tensor plus a float constant that broadcasts to it (a number: a HardSwish written out; per
    channel: a batch norm's shift): the tensor to int32 on a scale 2**16 times finer (coarser where
    the constant would not fit in 2**30 steps), the constant rounded to that scale."""
    t = lo.wide.get(str(value.name)) or lo.source(value, node)
    rank = len(lo.shape_of(value))
    if addend is None or np.ndim(addend) > rank or not np.isfinite(addend).all():
        raise TosaError(f"node '{named(node)}' (Add): a tensor plus a finite constant is lowered, not this one")
    c = np.asarray(addend, np.float64).reshape((1,) * (rank - np.ndim(addend)) + np.shape(addend))
    if t.nhwc:
        c = c.transpose(0, 2, 3, 1)
    try:
        np.broadcast_shapes(c.shape, t.shape)
    except ValueError:
        raise TosaError(f"node '{named(node)}' (Add): its constant {list(np.shape(addend))} does not broadcast "
                        f"to the tensor") from None  # fmt: skip
    largest = float(np.abs(c).max(initial=0.0))
    common = t.scale if t.wide else max(t.scale / (1 << STREAM_BITS), largest / (1 << 30))
    steps = np.rint(c / common)
    if np.abs(steps).max(initial=0) >= 1 << 31:
        raise TosaError(f"node '{named(node)}' (Add): {largest} is beyond the int32 range of the sum's scale")
    why = f"Add '{named(node)}': the tensor to the int32 scale of its sum with a constant"
    part = lo.rescale_to_i32(t, t.scale / common, why)
    shifted = lo.add("add", [part, lo.const(steps.astype(np.int64), "i32")], t.shape, "i32")
    lo.sum_to_readers(node, Tensor(shifted, t.shape, common, 0, t.nhwc, True))


def _hard_sigmoid(x: Array, node: ir.Node) -> Array:
    alpha, beta = node.attributes.get_float("alpha", 0.2), node.attributes.get_float("beta", 0.5)
    return np.clip(alpha * x + beta, 0.0, 1.0)


def _gelu(x: Array, node: ir.Node) -> Array:
    """ONNX's Gelu (opset 20): exact (``x Phi(x)``, by erf), or ``approximate = "tanh"``."""
    if node.attributes.get_string("approximate", "none") == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, np.float64) / math.sqrt(2.0))
    return np.asarray(0.5 * x * (1.0 + erf), np.float64)


UNARY: dict[str, Callable[[Array, ir.Node], Array]] = {  # what tosa.table computes, in float32 as ONNX Runtime does
    "Sigmoid": lambda x, node: 1.0 / (1.0 + np.exp(-x)),
    "Tanh": lambda x, node: np.tanh(x),
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": lambda x, node: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0),
    "Gelu": _gelu,
    "LeakyRelu": lambda x, node: np.where(x >= 0, x, node.attributes.get_float("alpha", 0.01) * x),
}
