"""Normalizations in integers: Softmax, LayerNormalization and LpNormalization (the L2 norm of
sentence embeddings).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.lowering import Lowering, constant_value
from requant.backends.tosa.program import (
    Tensor,
    TosaError,
    named,
)


def softmax(lo: Lowering, node: ir.Node) -> None:
    """Softmax of int8 values along an axis, in integers (TOSA 1.0's int profile, no int16). With
    ``d = q - max(q)`` (in ``[-255, 0]``: the zero point gone), ``E(d) = T exp(scale d)`` (``T`` <
    ``2**21``) is three int8 ``tosa.table`` lookups of ``d + 127``, 7 bits of ``E`` each, put together
    by rescales (``* 2**14``, ``* 2**7``) and adds; its row sum, shifted right by ``s`` bits, divides
    ``2**30`` once per row (``tosa.intdiv``); a ``tosa.mul`` with a shift of ``8 + s`` gives each
    value's share of its row times ``2**22``, which a rescale takes to the int8 output. ``T`` keeps
    the row sum in int32; ``s`` balances the two truncations (the divisor's and the quotient's): a
    share is off by about ``2**-12`` of itself at most, against an output step of ``1/256`` or more."""
    x = lo.nchw(lo.source(node.inputs[0], node))
    rank = len(x.shape)
    opset = lo.graph.opset_imports.get("", 13)
    axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1) % rank
    if opset < 13 and axis != rank - 1:
        raise TosaError(f"node '{named(node)}' (Softmax): before opset 13 only the last axis is lowered")
    n = x.shape[axis]
    top_value = min(2**21 - 1, (2**31 - 1) // n)
    if top_value < 2**12:
        raise TosaError(f"node '{named(node)}' (Softmax): {n} values along its axis leave int32 in their sum")
    bits = math.log2(top_value)
    shift = int(np.clip(round(bits + (math.log2(n) - 29) / 2), 0, math.floor(bits)))
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"Softmax '{named(node)}'"
    reduced = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    values = lo.rescale_to_i32(x, 1.0, why + ": its input to int32, zero point removed")
    top = lo.add("reduce_max", [values], reduced, "i32", axis=axis)
    below = lo.add("sub", [values, top], x.shape, "i32")  # d, in [-255, 0]
    index = lo.rescale(below, x.shape, np.array([1.0]), 0, 127, "i32", why + ": d + 127, the tables' index")
    exp = np.rint(top_value * np.exp(x.scale * np.arange(-255.0, 1.0))).astype(np.int64)  # E(d), d = -255..0
    parts = []
    for low_bit in (14, 7, 0):  # E = hi 2**14 + mid 2**7 + lo, each in [0, 127]
        table = lo.add("table", [index, lo.const(exp >> low_bit & 127, "i8")], x.shape, "i8")
        parts.append(lo.rescale_to_i32(Tensor(table, x.shape, 1.0, 0), 2.0**low_bit, why + ": 7 bits of exp"))
    e = lo.add("add", [lo.add("add", parts[:2], x.shape, "i32"), parts[2]], x.shape, "i32")
    total = lo.add("reduce_sum", [e], reduced, "i32", axis=axis)
    divisor = lo.rescale(total, reduced, np.array([2.0**-shift]), 0, 0, "i32", why + ": the row sum, shifted",
                           dtype_out="i32")  # fmt: skip
    inverse = lo.add("intdiv", [lo.const(np.full((1,) * rank, 2**30), "i32"), divisor], reduced, "i32")
    share = lo.add("mul", [e, inverse, lo.const(np.array([8 + shift]), "i8")], x.shape, "i32")
    result = lo.rescale(share, x.shape, np.array([2.0**-22 / out_scale]), 0, out_zp, "i32",
                          why + ": each value's share of its row to the int8 output")  # fmt: skip
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, x.shape, out_scale, out_zp)


def layer_norm(lo: Lowering, node: ir.Node) -> None:
    """LayerNormalization over the last axis, in integers (:meth:`normalized`, centred): the
    normalized value times ``sqrt(n) 2**s``; a rescale per channel by ``|gamma|`` (its sign a
    ``tosa.mul``), ``beta`` added 2**8 finer, a rescale to the int8 output."""
    x = lo.nchw(lo.source(node.inputs[0], node))
    rank = len(x.shape)
    axis = node.attributes.get_int("axis", -1) % rank
    if axis != rank - 1:
        raise TosaError(f"node '{named(node)}' (LayerNormalization): only the last axis is lowered, not {axis}")
    n = x.shape[axis]
    gamma = constant_value(node.inputs[1], node) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    beta = constant_value(node.inputs[2], node) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if gamma is None:
        raise TosaError(f"node '{named(node)}' (LayerNormalization): its scale is not a constant")
    gamma = np.broadcast_to(np.asarray(gamma, np.float64).reshape(-1), (n,))
    beta = np.zeros(n) if beta is None else np.broadcast_to(np.asarray(beta, np.float64).reshape(-1), (n,))
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"LayerNormalization '{named(node)}'"
    epsilon = node.attributes.get_float("epsilon", 1e-5)
    unit, step = normalized(lo, node, x, why, epsilon * n / x.scale**2, centred=True)
    ones = (1,) * rank
    signs = np.where(gamma < 0, -1, 1).reshape((*ones[:-1], n))
    unit = lo.add("mul", [unit, lo.const(signs, "i32"), lo.const(np.zeros(1), "i8")], x.shape, "i32")
    fine = 256.0 / out_scale
    scaled = lo.rescale(unit, x.shape, np.abs(gamma) * step * fine, 0, 0, "i32",
                          why + ": times gamma, 2**8 finer than its output", dtype_out="i32")  # fmt: skip
    offset = lo.const(np.rint(beta * fine).astype(np.int64).reshape((*ones[:-1], n)), "i32")
    total = lo.add("add", [scaled, offset], x.shape, "i32")
    result = lo.rescale(total, x.shape, np.array([1 / 256]), 0, out_zp, "i32", why + ": to its int8 output")
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, x.shape, out_scale, out_zp)


def l2_normalize(lo: Lowering, node: ir.Node) -> None:
    """LpNormalization with ``p`` 2 over the last axis (a sentence embedding's, fused from ReduceL2,
    Clip, Expand, Div by the target's pass), in integers (:meth:`normalized`, not centred): each
    value over the row's root sum of squares, times ``2**s``, rescaled to the int8 output."""
    x = lo.nchw(lo.source(node.inputs[0], node))
    rank = len(x.shape)
    if node.attributes.get_int("axis", -1) % rank != rank - 1 or node.attributes.get_int("p", 2) != 2:
        raise TosaError(f"node '{named(node)}' (LpNormalization): p 2 over the last axis is lowered")
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"LpNormalization '{named(node)}'"
    unit, step = normalized(lo, node, x, why, 0.0, centred=False)
    scale = np.array([step / out_scale])
    result = lo.rescale(unit, x.shape, scale, 0, out_zp, "i32", f"{why}: to its int8 output")
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, x.shape, out_scale, out_zp)


def normalized(lo: Lowering, node: ir.Node, x: Tensor, why: str, epsilon: float, centred: bool) -> tuple[str, float]:
    """Each value of the int8 rows ``x`` (last axis, ``n`` values) over the root of the row's sum of
    squares, in int32: the int32 tensor, and the real value of its unit. With ``v = q - zp``:
    ``centred`` (a LayerNorm), ``S = sum(v)`` split as ``n a + r`` (``tosa.intdiv``) gives
    ``V = sum(v**2) - n a**2 - 2 a r - r**2 / n``, ``n`` times the variance (to within 1: no term
    leaves int32), and ``c = n v - S``; otherwise ``V = sum(v**2)`` and ``c = v``. ``V`` is taken
    ``4**j`` finer where int32 holds it, plus ``epsilon`` (in steps squared) on that scale (at least
    1: a constant row); shifted left by an even ``2 m`` (``tosa.clz``) into ``[2**29, 2**31)``, its
    square root by six Newton steps of ``tosa.intdiv`` from ``46341`` (from above): 15 bits whatever
    the row's spread. ``c`` shifted left by ``s + m + j`` over that root is ``c / sqrt(V) 2**s``:
    the normalized value times ``sqrt(n) 2**s`` (centred), or the value over the norm times ``2**s``."""
    rank, n = len(x.shape), x.shape[-1]
    axis = rank - 1
    # |c| 2**m < sqrt(n) 2**15.5 (centred: n |v - mean| <= sqrt(n V)) or 2**15.5: c 2**(shift + m) stays in int32
    shift = math.floor(15.5 - (math.log2(n) if centred else 0.0) - 1e-9)
    if shift < 0:
        raise TosaError(f"node '{named(node)}' ({node.op_type}): rows of {n} values (46,340 at most)")
    reduced = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    ones, no_shift = (1,) * rank, lo.const(np.zeros(1), "i8")

    def op(kind: str, *args: str, shape: tuple[int, ...] = reduced) -> str:
        return lo.add(kind, list(args) + ([no_shift] if kind == "mul" else []), shape, "i32")

    def number(value: int) -> str:
        return lo.const(np.full(ones, value), "i32")

    values = lo.rescale_to_i32(x, 1.0, why + ": its input to int32, zero point removed")
    total = lo.add("reduce_sum", [values], reduced, "i32", axis=axis) if centred else ""
    squares = lo.add("reduce_sum", [op("mul", values, values, shape=x.shape)], reduced, "i32", axis=axis)
    spread = squares
    if centred:
        whole = op("intdiv", total, number(n))  # a
        multiple = op("mul", whole, number(n))  # n a
        rest = op("sub", total, multiple)  # r
        cross = op("mul", whole, rest)
        spread = op("sub", op("sub", squares, op("mul", multiple, whole)), op("add", cross, cross))
        spread = op("sub", spread, op("intdiv", op("mul", rest, rest), number(n)))  # n var, in steps
    # 4**j finer (as far as int32 holds it), plus epsilon: at least 1, so that a constant row divides by
    # something, and 1 is 4**-j of a step there
    j = max(0, (30 - math.ceil(math.log2(n * 65025 + 1))) // 2)
    spread = op("mul", spread, number(4**j))
    spread = op("add", spread, number(int(np.clip(round(epsilon * 4**j), 1, 2**29))))  # < 2**31
    half = op("intdiv", op("sub", op("clz", spread), number(1)), number(2))  # m
    # (at most 31 - shift - j, so that c's shift stays within 31 bits: only a near-constant row reaches it)
    half = op("minimum", half, number(31 - shift - j))  # (tosa.clamp takes no int32 in the int profile)
    normal = op("logical_left_shift", spread, op("add", half, half))  # in [2**29, 2**31)
    root = lo.const(np.full(reduced, 46341), "i32")  # >= sqrt(2**31): Newton from above
    for _ in range(6):
        root = op("intdiv", op("add", root, op("intdiv", normal, root)), number(2))
    centre = op("sub", op("mul", values, number(n), shape=x.shape), total, shape=x.shape) if centred else values
    moved = op("logical_left_shift", centre, op("add", half, number(shift + j)), shape=x.shape)
    unit = op("intdiv", moved, root, shape=x.shape)
    return unit, 1.0 / ((math.sqrt(n) if centred else 1.0) * 2.0**shift)
