"""A NumPy interpreter of the integer TOSA programs :mod:`requant.backends.tosa` writes, bit for bit
as the TOSA 1.0 specification defines each op (int64 arithmetic where it widens, its rounding).

It is the reference the emitted MLIR is checked against (IREE must compute the same integers), and
what requant uses to evaluate a TOSA output without compiling it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.backends.tosa.program import ROUNDING, TosaError, TosaOp, TosaProgram

__all__ = ["apply_scale_32", "run_tosa"]

Array = npt.NDArray[Any]


def apply_scale_32(value: Array, multiplier: Array, shift: Array, double_round: bool = False) -> Array:
    """TOSA's ``apply_scale_32``: ``(value * multiplier + round) >> shift`` in int64, ``round`` half
    of the last step (and, with ``double_round``, one more half step away from zero past shift 31)."""
    value, multiplier, shift = (np.asarray(a, np.int64) for a in (value, multiplier, shift))
    if np.any((shift < 2) | (shift > 62)) or np.any(multiplier < 0):
        raise TosaError("apply_scale_32: shift outside [2, 62] or a negative multiplier")
    limit = np.left_shift(np.int64(1), shift - 1)
    if np.any((value < -limit) | (value >= limit)):
        raise TosaError("apply_scale_32: a value outside the range its shift allows")
    rounding = limit.copy() if limit.ndim else np.int64(limit)
    if double_round:
        rounding = rounding + np.where(shift > 31, np.where(value >= 0, 1 << 30, -(1 << 30)), 0)
    result: Array = np.right_shift(value * multiplier + rounding, shift)
    return result


def _const(op: TosaOp, args: list[Array], rounding: str) -> Array:
    assert op.value is not None
    return op.value


def _in_doubles(a: Array, b: Array, k: int) -> bool:
    """Whether a sum of ``k`` products of values of ``a`` and ``b`` stays below ``2**53``: every partial
    sum, in whatever order BLAS adds, is then an integer a double holds (an int8 conv's are below
    ``2**16 k``)."""
    return float(np.abs(a).max(initial=0)) * float(np.abs(b).max(initial=0)) * k < 2.0**53


def _exact_matmul(a: Array, b: Array, exact: bool | None = None) -> Array:
    """``a @ b`` of integer arrays through float64 BLAS where that is exact (``exact``, or
    :func:`_in_doubles` when not given), in int64 otherwise. (NumPy's int64 matmul has no BLAS:
    PP-OCRv4's detector ran its convs 5x slower.)"""
    if _in_doubles(a, b, a.shape[-1]) if exact is None else exact:
        result: Array = np.matmul(a.astype(np.float64, copy=False), b.astype(np.float64)).astype(np.int64)
        return result
    wide: Array = np.matmul(a.astype(np.int64), b.astype(np.int64))
    return wide


def _window_sum(x: Array, w: Array, pad: list[int], stride: list[int], dilation: list[int], depthwise: bool) -> Array:
    """``x`` NHWC (int64, zero point removed) with ``w`` (OHWI, or KH KW C M when ``depthwise``)."""
    top, bottom, left, right = pad
    x = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))  # out of bounds adds nothing: zeros
    kh, kw = (w.shape[0], w.shape[1]) if depthwise else (w.shape[1], w.shape[2])
    n, h, wd, c = x.shape
    oh = (h - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    ow = (wd - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    taps = [(slice(i * dilation[0], i * dilation[0] + (oh - 1) * stride[0] + 1, stride[0]),
             slice(j * dilation[1], j * dilation[1] + (ow - 1) * stride[1] + 1, stride[1]), i, j)
            for i in range(kh) for j in range(kw)]  # fmt: skip
    if depthwise:  # out[..., c * M + m] = sum_ij x[tap ij][..., c] * w[i, j, c, m]: one multiply-add a tap
        summed = np.zeros((n, oh, ow, c, w.shape[3]), np.int64)  # (an int64 einsum over patches: 1.4-4.8x the time)
        for rows, cols, i, j in taps:
            summed += x[:, rows, cols, :, None] * w[i, j]
        return summed.reshape(n, oh, ow, -1)
    # im2col in doubles where they hold every sum exactly: no second copy, nor a second pass over it
    exact = _in_doubles(x, w, kh * kw * c)
    patches = np.empty((n, oh, ow, kh, kw, c), np.float64 if exact else np.int64)
    for rows, cols, i, j in taps:
        patches[:, :, :, i, j, :] = x[:, rows, cols, :]
    out: Array = _exact_matmul(patches.reshape(-1, kh * kw * c), w.reshape(len(w), -1).T, exact)
    return out.reshape(n, oh, ow, -1)


def _conv(op: TosaOp, args: list[Array], rounding: str) -> Array:
    x, w, bias, x_zp, w_zp = args
    x = x.astype(np.int64) - np.int64(x_zp[0])
    w = w.astype(np.int64) - np.int64(w_zp[0])
    a = op.attrs
    out = _window_sum(x, w, a["pad"], a["stride"], a["dilation"], op.kind == "depthwise_conv2d")
    return _int32(out + bias.astype(np.int64), op)


def _transpose_conv(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """TOSA's TRANSPOSE_CONV2D: input ``[n, iy, ix, ic]`` times weight ``[oc, ky, kx, ic]`` adds to output
    ``[n, iy * stride_y + out_pad_top + ky, ix * stride_x + out_pad_left + kx, oc]`` where that is inside."""
    x, w, bias, x_zp, w_zp = args
    x = x.astype(np.int64) - np.int64(x_zp[0])
    w = w.astype(np.int64) - np.int64(w_zp[0])
    top, bottom, left, right = op.attrs["out_pad"]
    sy, sx = op.attrs["stride"]
    n, ih, iw, _ = x.shape
    oc, kh, kw, _ = w.shape
    if min(top, bottom) <= -kh or min(left, right) <= -kw:
        raise TosaError(f"transpose_conv2d {op.output}: out_pad {op.attrs['out_pad']} must be above -kernel")
    full = np.zeros((n, (ih - 1) * sy + kh, (iw - 1) * sx + kw, oc), np.int64)  # every product, none cut off
    for ky in range(kh):
        for kx in range(kw):
            full[:, ky : ky + (ih - 1) * sy + 1 : sy, kx : kx + (iw - 1) * sx + 1 : sx] += _exact_matmul(
                x, w[:, ky, kx, :].T
            )
    oh, ow = (ih - 1) * sy + top + bottom + kh, (iw - 1) * sx + left + right + kw
    out = np.zeros((n, oh, ow, oc), np.int64)  # output row r is row r - top of ``full``
    rows = slice(max(0, top), min(oh, full.shape[1] + top))
    cols = slice(max(0, left), min(ow, full.shape[2] + left))
    out[:, rows, cols] = full[:, rows.start - top : rows.stop - top, cols.start - left : cols.stop - left]
    return _int32(out + bias.astype(np.int64), op)


def _int32(values: Array, op: TosaOp) -> Array:
    if values.size and (values.min() < -(2**31) or values.max() >= 2**31):
        raise TosaError(f"{op.kind} {op.output}: the int32 accumulator overflows")
    return values.astype(np.int32)


def _matmul(op: TosaOp, args: list[Array], rounding: str) -> Array:
    a, b, a_zp, b_zp = args
    a = a.astype(np.int64) - np.int64(a_zp[0])
    b = b.astype(np.int64) - np.int64(b_zp[0])
    return _int32(_exact_matmul(a, b), op)


def _add(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return _int32(args[0].astype(np.int64) + args[1].astype(np.int64), op)


def _rescale(op: TosaOp, args: list[Array], rounding: str) -> Array:
    x, multiplier, shift, in_zp, out_zp = args
    value = x.astype(np.int64) - np.int64(in_zp[0])
    if not op.attrs["per_channel"]:
        multiplier, shift = multiplier[:1], shift[:1]
    scaled = apply_scale_32(value, multiplier, shift, rounding == "double_round") + np.int64(out_zp[0])
    limits = {"i8": (-128, 127), "i32": (-(2**31), 2**31 - 1)}[op.dtype]
    return np.clip(scaled, *limits).astype(np.int8 if op.dtype == "i8" else np.int32)


def _concat(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return np.concatenate(args, axis=op.attrs["axis"])


def _table(op: TosaOp, args: list[Array], rounding: str) -> Array:
    x, table = args  # int8 input: the entry at x + 128 (int16 tables are TOSA's int16 extension: not written)
    return table[x.astype(np.int64) + 128]


def _mul(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """TOSA's MUL: with a ``shift`` (int32 only), the int64 product rounded half up by ``shift`` bits."""
    a, b, shift = args
    product = a.astype(np.int64) * b.astype(np.int64)
    if int(shift[0]) > 0:
        product = (product + (np.int64(1) << np.int64(shift[0] - 1))) >> np.int64(shift[0])
    return _int32(product, op)


def _sub(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return _int32(args[0].astype(np.int64) - args[1].astype(np.int64), op)


def _intdiv(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """TOSA's INTDIV: int32 quotients truncated toward zero (REQUIRE: no divisor is 0)."""
    a, b = (v.astype(np.int64) for v in args)
    if np.any(b == 0):
        raise TosaError(f"intdiv {op.output}: a divisor is 0")
    quotient = np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)
    return _int32(quotient, op)


def _clz(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """TOSA's CLZ of int32 values: the leading zero bits (32 for 0)."""
    unsigned = (args[0].astype(np.int64) & 0xFFFFFFFF).astype(np.float64)  # exact: below 2**53
    _, bits = np.frexp(unsigned)  # v = m 2**bits with m in [0.5, 1): bits is v's bit length (0 for 0)
    return (32 - bits).astype(np.int32)


def _logical_left_shift(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """TOSA's LOGICAL_LEFT_SHIFT of int32 values by 0 to 31 bits (the low 32 bits of the result)."""
    a, b = (v.astype(np.int64) for v in args)
    if b.size and (b.min() < 0 or b.max() > 31):
        raise TosaError(f"logical_left_shift {op.output}: a shift outside [0, 31]")
    return ((a << b) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def _reduce_max(op: TosaOp, args: list[Array], rounding: str) -> Array:
    result: Array = np.max(args[0], axis=op.attrs["axis"], keepdims=True)
    return result


def _clamp(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return np.clip(args[0], op.attrs["min_val"], op.attrs["max_val"]).astype(args[0].dtype)


def reciprocal_scale(count: Array) -> tuple[Array, Array]:
    """TOSA's ``reciprocal_scale``: a multiplier in ``[2^30, 2^31)`` and a shift that divide by
    ``count`` (positive) in ``apply_scale_32``."""
    count = np.asarray(count, np.int64)
    k = np.vectorize(lambda v: int(v - 1).bit_length(), otypes=[np.int64])(count)  # 2^(k-1) < count <= 2^k
    multiplier = (((1 << 30) + 1) << k) // count
    return multiplier, 30 + k


def _avg_pool(op: TosaOp, args: list[Array], rounding: str) -> Array:
    """The windows' sums of the input values (zero point removed) over how many input values each
    holds (padding counts none), by ``reciprocal_scale``, plus the output's zero point."""
    x, input_zp, output_zp = args
    kh, kw = op.attrs["kernel"]
    window = (op.attrs["pad"], op.attrs["stride"], [1, 1], True)  # a depthwise window of ones
    sums = _window_sum(x.astype(np.int64) - np.int64(input_zp[0]), np.ones((kh, kw, x.shape[3], 1), np.int64), *window)
    counts = _window_sum(np.ones((1, *x.shape[1:3], 1), np.int64), np.ones((kh, kw, 1, 1), np.int64), *window)
    multiplier, shift = reciprocal_scale(counts)
    mean = apply_scale_32(sums, multiplier, shift) + np.int64(output_zp[0])
    return np.clip(mean, -128, 127).astype(np.int8)


def _argmax(op: TosaOp, args: list[Array], rounding: str) -> Array:
    indices: Array = np.argmax(args[0], axis=op.attrs["axis"]).astype(np.int32)  # the first largest
    return indices


def _max_pool(op: TosaOp, args: list[Array], rounding: str) -> Array:
    x = args[0]
    top, bottom, left, right = op.attrs["pad"]
    low = np.iinfo(x.dtype).min
    x = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), constant_values=low)  # padding never wins
    kh, kw = op.attrs["kernel"]
    sh, sw = op.attrs["stride"]
    n, oh, ow, c = op.shape
    out = np.full((n, oh, ow, c), low, x.dtype)
    for i in range(kh):
        for j in range(kw):
            out = np.maximum(out, x[:, i : i + (oh - 1) * sh + 1 : sh, j : j + (ow - 1) * sw + 1 : sw, :])
    return out


def _reduce_sum(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return _int32(args[0].astype(np.int64).sum(axis=op.attrs["axis"], keepdims=True), op)


def _gather(op: TosaOp, args: list[Array], rounding: str) -> Array:
    values, indices = args  # [N, K, C] and [N, W]: out[n, w] = values[n, indices[n, w]]
    if indices.size and (indices.min() < 0 or indices.max() >= values.shape[1]):
        raise TosaError(f"gather {op.output}: an index outside [0, {values.shape[1]})")
    return np.take_along_axis(values, indices.astype(np.int64)[:, :, None], axis=1)


def _slice(op: TosaOp, args: list[Array], rounding: str) -> Array:
    index = tuple(slice(b, b + n) for b, n in zip(op.attrs["start"], op.attrs["size"], strict=True))
    return np.ascontiguousarray(args[0][index])


def _transpose(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return np.ascontiguousarray(args[0].transpose(op.attrs["perms"]))


def _reshape(op: TosaOp, args: list[Array], rounding: str) -> Array:
    return args[0].reshape(op.attrs["new_shape"])


def _nearest(out: int, size: int, numerator: int, denominator: int, offset: int) -> Array:
    """The source index of each of ``out`` positions in TOSA's integer nearest-neighbour resize."""
    y = np.arange(out, dtype=np.int64) * denominator + offset
    index = np.floor_divide(y, numerator)
    remainder = y - index * numerator
    nearest: Array = np.clip(index + (2 * remainder >= numerator), 0, size - 1)
    return nearest


def _sources(out: int, size: int, numerator: int, denominator: int, offset: int) -> tuple[Array, Array, Array]:
    """TOSA's bilinear resize along one axis: each output's two source indices (clamped to the input)
    and the second one's weight, in units of ``numerator`` (the first weighs the rest)."""
    y = np.arange(out, dtype=np.int64) * denominator + offset
    index = np.floor_divide(y, numerator)
    return np.clip(index, 0, size - 1), np.clip(index + 1, 0, size - 1), y - index * numerator


def _bilinear(op: TosaOp, x: Array) -> Array:
    oh, ow = op.shape[1:3]
    sy, dy, sx, dx = op.attrs["scale"]
    y0, y1, wy = _sources(oh, x.shape[1], sy, dy, op.attrs["offset"][0])
    x0, x1, wx = _sources(ow, x.shape[2], sx, dx, op.attrs["offset"][1])
    v = x.astype(np.int64)
    wy, wx = wy[None, :, None, None], wx[None, None, :, None]
    top = v[:, y0][:, :, x0] * (sx - wx) + v[:, y0][:, :, x1] * wx
    bottom = v[:, y1][:, :, x0] * (sx - wx) + v[:, y1][:, :, x1] * wx
    return _int32(top * (sy - wy) + bottom * wy, op)


def _resize(op: TosaOp, args: list[Array], rounding: str) -> Array:
    (x,) = args  # NHWC
    if op.attrs.get("mode") == "BILINEAR":
        return _bilinear(op, x)
    oh, ow = op.shape[1:3]
    sy, dy, sx, dx = op.attrs["scale"]
    rows = _nearest(oh, x.shape[1], sy, dy, op.attrs["offset"][0])
    columns = _nearest(ow, x.shape[2], sx, dx, op.attrs["offset"][1])
    return np.ascontiguousarray(x[:, rows][:, :, columns])


def _pad(op: TosaOp, args: list[Array], rounding: str) -> Array:
    x, value = args
    pairs = np.asarray(op.attrs["padding"]).reshape(-1, 2)
    return np.pad(x, [tuple(int(v) for v in p) for p in pairs], constant_values=value[0])


ACCUMULATORS = ("conv2d", "depthwise_conv2d", "transpose_conv2d", "matmul")
OPS: dict[str, Callable[[TosaOp, list[Array], str], Array]] = {
    "const": _const,
    "conv2d": _conv,
    "depthwise_conv2d": _conv,
    "transpose_conv2d": _transpose_conv,
    "matmul": _matmul,
    "add": _add,
    "rescale": _rescale,
    "clamp": _clamp,
    "max_pool2d": _max_pool,
    "avg_pool2d": _avg_pool,
    "argmax": _argmax,
    "reduce_sum": _reduce_sum,
    "reduce_max": _reduce_max,
    "sub": _sub,
    "intdiv": _intdiv,
    "clz": _clz,
    "minimum": lambda op, args, rounding: np.minimum(args[0], args[1]),
    "logical_left_shift": _logical_left_shift,
    "gather": _gather,
    "table": _table,
    "concat": _concat,
    "mul": _mul,
    "slice": _slice,
    "transpose": _transpose,
    "reshape": _reshape,
    "pad": _pad,
    "resize": _resize,
}


def run_tosa(
    program: TosaProgram,
    inputs: Mapping[str, Array],
    rounding: str | None = None,
    accumulator_bits: int | None = None,
    overflows: dict[str, list[int]] | None = None,
) -> list[Array]:
    """The program's int8 outputs on int8 ``inputs`` (by the model's input names); ``rounding``
    overrides the program's. With ``accumulator_bits`` (e.g. 16), each conv2d, depthwise_conv2d,
    transpose_conv2d and matmul result is saturated to that many bits, as a narrower accumulator would
    hold it (seed 002's simulated accumulator), and ``overflows`` counts, per kernel, ``[values
    saturated, values]``."""
    rounding = rounding or program.rounding
    if rounding not in ROUNDING:
        raise TosaError(f"rounding must be one of {', '.join(ROUNDING)}, got {rounding!r}")
    values: dict[str, Array] = {}
    for name, edge in zip(program.arguments, program.inputs, strict=True):
        array = np.asarray(inputs[edge.name])
        wanted = np.int8 if edge.dtype == "i8" else np.int32
        if array.dtype != wanted or array.shape != edge.shape:
            got = f"{array.dtype} {list(array.shape)}"
            raise TosaError(f"input '{edge.name}': expected {np.dtype(wanted).name} {list(edge.shape)}, got {got}")
        values[name] = array
    for op in program.ops:
        result = OPS[op.kind](op, [values[i] for i in op.inputs], rounding)
        if tuple(result.shape) != op.shape:
            raise TosaError(f"{op.kind} {op.output}: computed shape {result.shape}, declared {op.shape}")
        if accumulator_bits is not None and op.kind in ACCUMULATORS:
            low, high = -(1 << (accumulator_bits - 1)), (1 << (accumulator_bits - 1)) - 1
            count = (
                overflows.setdefault(str(op.attrs.get("node", op.output)), [0, 0]) if overflows is not None else None
            )
            if count is not None:
                count[0] += int(np.count_nonzero((result < low) | (result > high)))
                count[1] += result.size
            result = np.clip(result, low, high).astype(result.dtype)
        values[op.output] = result
    return [values[r] for r in program.results]
