"""Weight encoding: int8 weights that the target's kernels add without saturating, with a proof.

For each kernel whose input and weight are quantized, the target's kernel model
(:mod:`requant.targets.kernels`) says how its products are added. Where neighbouring products are
added in int16 (uint8 x int8 on x86 CPUs without VNNI), the weights are checked against the input
type's whole stored range: every value the kernel can ever be given, so the proof holds for every
input, not only for data like the calibration samples.

1. The weights rounded as their type says. If no pair of any output channel can leave the int16
   range for any input (:meth:`Accumulation.overflow` is 0 everywhere), they stay as they are:
   full range, proven.
2. Otherwise, for each output channel that can saturate: with ``t_safe`` the smallest factor on
   its scale with which no pair of the unrounded weights can leave the range, the factors
   ``t = 1 + u (t_safe - 1)`` for u = 0.8, 0.9, 0.95 and 1 are tried; the weights are rounded at the
   scale ``t x scale`` and the few pairs still over the bound are shrunk (least squares onto the
   pair's bound, rounded down, plus back what still fits). The factor whose weights are closest
   to the float weights (squared error) is kept. ``t = t_safe`` alone would be "7 bits only for
   the channels that need it", ``t = 1`` pure clamping of the largest weights; measured on
   MobileNetV2's 36 kernels, the best factor lies at 0.75-1 of the way to t_safe for nine
   channels in ten, and these four candidates give less total error than six spread over [0, 1].
3. The proof is checked again on the result, and the weight's type (its raised scales) and stored
   integers are set on the value: the bias derived next uses the new scales, and the QDQ writer
   stores exactly these integers.

Depthwise kernels, uint8 weights (the exact uint8 x uint8 kernel) and targets whose kernels add in
int32 (VNNI) keep their weights; their records say why. A weight with non-zero zero points cannot
be encoded this way and is reported with its margin.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.moments import MOMENTS_KEY, InputMoments
from requant.encoding.rounding import output_error, round_rows, round_rows_each
from requant.ir.annotations import quant_type, set_parameter_type, set_stored_values, stored_values
from requant.ir.queries import is_op
from requant.ir.traits import weight_inputs
from requant.targets.kernels import KernelModel, KernelRule, Reduction, is_depthwise
from requant.types import (
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    qcast,
    with_scales,
)
from requant.types.accumulation import Accumulation

__all__ = ["WeightEncoding", "encode_rows", "encode_weights", "energy_db", "rescale_stored"]

log = logging.getLogger("requant.calibration")

Array = npt.NDArray[Any]
_ROWS_PER_BLOCK = 512  # the rows encoded at once: bounds the search's copies (~10 float64 [512, K] arrays)
_TRIED = (0.8, 0.9, 0.95, 1.0)  # where between t = 1 and t_safe a channel's factor is tried (the best is near t_safe)
_WeightType = UniformQuantizedType | UniformQuantizedPerAxisType | UniformQuantizedSubChannelType
_WEIGHT_TYPES = (UniformQuantizedType, UniformQuantizedPerAxisType, UniformQuantizedSubChannelType)


@dataclass(frozen=True)
class WeightEncoding:
    """How one kernel's weights are stored, and the proof.

    ``encoding``: "full range" (the type's rounding, proven), "pair-safe" (rescaled and shrunk
    channels, proven), or "not encoded" (``why`` says why; ``margin`` tells whether it can
    saturate). ``margin``: how far the closest pair stays from the pair range for the worst input,
    in accumulator units (negative: by how much it can leave it). ``rescaled``: channels whose
    scale was raised, by at most ``largest_factor``; ``moved``: weights not at their rounding at
    the final scale. ``sqnr_db`` / ``encoded_sqnr_db``: the weights' SQNR against the float
    weights, rounded as the type said and as stored.
    """

    node: str
    weight: str
    kernel: str
    accumulation: str
    input_range: tuple[int, int]
    encoding: str
    channels: int
    margin: int
    sqnr_db: float
    encoded_sqnr_db: float
    rescaled: int = 0
    largest_factor: float = 1.0
    moved: int = 0
    why: str = ""
    # how the integers were rounded: "nearest", or "error feedback" against the kernel's calibration
    # inputs (requant.encoding.rounding); the kernel's output SQNR (dB) from its weights' rounding
    # alone on those inputs, rounded to nearest and as stored (None: no inputs measured)
    rounding: str = "nearest"
    nearest_output_sqnr_db: float | None = None
    output_sqnr_db: float | None = None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def energy_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` of two energies (inf without noise or signal)."""
    return float(10 * np.log10(signal / noise)) if noise > 0 and signal > 0 else float("inf")


def _fit_pairs(q: Array, r: Array, lo: Array, hi: Array, acc: Accumulation, limit: float) -> Array:
    """``q`` (rounded ``r``, ``[N, K]`` even) with every pair that can leave the pair range shrunk:
    the least-squares point of the pair's bound ``hi_a |x| + hi_b |y| <= lim`` nearest ``r``,
    rounded down, then 1 added back where it still fits. Only same-sign pairs can leave the
    range (one uint8 input times one int8 weight never does), so the bound is on magnitudes."""
    over = acc.overflow(q, lo, hi) > 0
    if not over.any():
        return q
    rows, pairs = np.nonzero(over)  # a same-sign pair: at its worst both inputs are at hi
    a, b = 2 * pairs, 2 * pairs + 1
    bound = np.broadcast_to(hi, (r.shape[1],))
    ha, hb = bound[a].astype(np.float64), bound[b].astype(np.float64)
    sign = np.sign(q[rows, a] + q[rows, b])
    low, high = acc.pair_limits
    lim = np.where(sign > 0, high, -low).astype(np.float64)
    ra, rb = np.abs(r[rows, a]), np.abs(r[rows, b])
    step = (ha * ra + hb * rb - lim) / np.maximum(ha * ha + hb * hb, 1.0)
    x = np.clip(ra - step * ha, 0.0, limit)
    y = np.clip(rb - step * hb, 0.0, limit)
    # one side clipped at 0: the other takes what the bound leaves
    y = np.where(x == 0.0, np.minimum(rb, lim / np.maximum(hb, 1.0)), y)
    x = np.where(y == 0.0, np.minimum(ra, lim / np.maximum(ha, 1.0)), x)
    xi, yi = np.floor(x), np.floor(y)
    for _ in range(2):  # add back 1 where it fits, the element further from its target first
        grow_x = (x - xi >= y - yi) & ((xi + 1) * ha + yi * hb <= lim) & (xi + 1 <= ra + 0.5)
        xi = np.where(grow_x, xi + 1, xi)
        grow_y = ((xi * ha + (yi + 1) * hb) <= lim) & (yi + 1 <= rb + 0.5)
        yi = np.where(grow_y, yi + 1, yi)
    fitted = q.copy()
    fitted[rows, a] = sign * xi
    fitted[rows, b] = sign * yi
    return fitted


def encode_rows(
    f: Array,
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
    acc: Accumulation,
    qmin: int = -128,
    qmax: int = 127,
    shared_scale: bool = False,
) -> tuple[Array, Array]:
    """Integers ``q`` (``[N, K]``) and a factor ``t`` per row (``[N]``, >= 1) such that ``q * t``
    is close to ``f`` (weights in units of their row's scale, in the kernel's reduction order) and
    no pair of ``q`` can leave ``acc``'s pair range for inputs in ``[lo, hi]`` (scalars or ``[K]``).
    ``shared_scale``: one factor for all rows (a per-tensor weight type). Rows are encoded
    independently, a block at a time (the search keeps several float64 copies of its rows)."""
    if not shared_scale and len(f) > _ROWS_PER_BLOCK:
        blocks = [
            encode_rows(f[i : i + _ROWS_PER_BLOCK], lo, hi, acc, qmin, qmax) for i in range(0, len(f), _ROWS_PER_BLOCK)
        ]
        return np.concatenate([q for q, _ in blocks]), np.concatenate([t for _, t in blocks])
    f = np.asarray(f, np.float64)
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    n, k = f.shape
    if k % 2:  # the kernels pad the reduction to whole pairs with zeros
        f = np.pad(f, ((0, 0), (0, 1)))
        lo, hi = (b if b.ndim == 0 else np.pad(b, (0, 1)) for b in (lo, hi))
    q = np.clip(np.rint(f), qmin, qmax)
    t = np.ones(n)
    bad = acc.overflow(q.astype(np.int64), lo, hi).max(axis=1) > 0
    if shared_scale:
        bad[:] = bad.any()
    if bad.any():
        fb = f[bad]
        top, bottom = acc.pair_extremes(fb, lo, hi)
        low, high = acc.pair_limits
        t_safe = np.maximum(1.0, np.maximum(top.max(axis=1) / high, bottom.min(axis=1) / low))
        if shared_scale:
            t_safe[:] = t_safe.max()
        best_q, best_t, best_err = q[bad], np.ones(len(fb)), np.full(len(fb), np.inf)
        for u in _TRIED:
            factor = 1.0 + u * (t_safe - 1.0)
            r = fb / factor[:, None]
            tried = _fit_pairs(np.clip(np.rint(r), qmin, qmax), r, lo, hi, acc, float(max(-qmin, qmax)))
            err = ((fb - tried * factor[:, None]) ** 2).sum(axis=1)
            if shared_scale:
                err[:] = err.sum()
            better = err < best_err
            best_q = np.where(better[:, None], tried, best_q)
            best_t = np.where(better, factor, best_t)
            best_err = np.where(better, err, best_err)
        q[bad], t[bad] = best_q, best_t
    return q[:, :k].astype(np.int64), t


def _scales(t: _WeightType, rows: int) -> Array:
    if isinstance(t, UniformQuantizedType):
        return np.full(rows, t.scale)
    if isinstance(t, UniformQuantizedSubChannelType):
        return np.asarray(t.scales, np.float64).reshape(-1)
    return np.asarray(t.scales, np.float64)


def _zero_points(t: _WeightType, rows: int) -> Array:
    if isinstance(t, UniformQuantizedType):
        return np.full(rows, t.zero_point)
    return np.asarray(t.zero_points, np.int64).reshape(-1)


# What a dynamic kernel (DynamicQuantizeLSTM) quantizes its float inputs to: uint8 over each run's
# range, so any stored value in [0, 255]. Only the storage range enters the proof.
_DYNAMIC_INPUT = UniformQuantizedType("u8", "f32", 1.0, 0)


def _row_scales(t: _WeightType, op_type: str, row_axis: int) -> str | None:
    """None if ``t`` has one scale per row of the kernel's GEMM (or one for all), else why not."""
    if isinstance(t, UniformQuantizedPerAxisType) and t.axis != row_axis:
        return f"per-channel scales on axis {t.axis}, not the output's"
    if isinstance(t, UniformQuantizedSubChannelType) and (
        op_type != "LSTM" or any(size != 1 for axis, size in t.block_sizes if axis != 2)
    ):
        return f"blocked scales {dict(t.block_sizes)}, not one per output channel"
    return None


def _kernels(node: ir.Node) -> list[tuple[ir.Value, UniformQuantizedType, _WeightType]]:
    """(weight, input type, weight type) of each 8-bit weight of a weighted op whose input is 8-bit
    (per tensor, or quantized by the kernel itself: an LSTM's)."""
    if not any(is_op(node, op) for op in ("Conv", "Gemm", "MatMul", "LSTM")) or len(node.inputs) < 2:
        return []
    lstm = node.op_type == "LSTM"
    found = []
    for index in weight_inputs(node.op_type):
        x, w = node.inputs[0], node.inputs[index] if index < len(node.inputs) else None
        if x is None or w is None or w.const_value is None:
            continue
        xt, wt = _DYNAMIC_INPUT if lstm else quant_type(x), quant_type(w)
        if not isinstance(xt, UniformQuantizedType) or not isinstance(wt, _WEIGHT_TYPES):
            continue
        if xt.storage in ("u8", "i8") and wt.storage in ("u8", "i8"):
            found.append((w, xt, wt))
    return found


class _Rows(NamedTuple):
    """A kernel's weight as its GEMM's rows: the float weight, its reduction, its rows ``[N, K]``,
    their scales and zero points (of the weight's type), and the kernel's rule."""

    data: Array
    reduction: Reduction
    f: Array
    scales: Array
    zero_points: Array
    rule: KernelRule | None


def _rows(node: ir.Node, w: ir.Value, xt: UniformQuantizedType, wt: _WeightType, kernels: KernelModel) -> _Rows:
    assert w.const_value is not None
    data = w.const_value.numpy().astype(np.float64)
    group = node.attributes.get_int("group", 1) if node.op_type == "Conv" else 1
    trans_b = bool(node.attributes.get_int("transB", 0)) if node.op_type == "Gemm" else False
    rule = kernels.find(
        node.op_type, xt.storage, wt.storage, node.op_type == "Conv" and is_depthwise(data.shape, group)
    )
    reduction = Reduction(node.op_type, tuple(data.shape), trans_b, group)
    f = reduction.rows(data)
    return _Rows(data, reduction, f, _scales(wt, len(f)), _zero_points(wt, len(f)), rule)


def _encode_one(
    node: ir.Node, w: ir.Value, xt: UniformQuantizedType, wt: _WeightType, kernels: KernelModel
) -> WeightEncoding:
    data, reduction, rows_f, scales, zero_points, rule = _rows(node, w, xt, wt, kernels)
    stored = reduction.rows(qcast(data, wt).astype(np.int64))
    lo, hi = np.int64(xt.storage_min), np.int64(xt.storage_max)  # every stored value the input can hold
    signal = float((data**2).sum())
    rounded_db = energy_db(signal, float(((rows_f - (stored - zero_points[:, None]) * scales[:, None]) ** 2).sum()))
    acc = rule.accumulation if rule is not None else None
    over, margin = acc.overflow_and_margin(stored, lo, hi) if acc is not None else (None, 2**31 - 1)
    record = WeightEncoding(
        node=str(node.name or node.op_type),
        weight=str(w.name),
        kernel=rule.kernel if rule is not None else f"{node.op_type} {xt.storage} x {wt.storage} (not in {kernels})",
        accumulation=str(acc) if acc is not None else "int32 (assumed)",
        input_range=(xt.storage_min, xt.storage_max),
        encoding="full range",
        channels=int(rows_f.shape[0]),
        margin=margin,
        sqnr_db=rounded_db,
        encoded_sqnr_db=rounded_db,
    )
    if acc is None or not acc.saturates:
        return dataclasses.replace(record, why=f"{record.kernel}: products added in int32")
    if record.margin >= 0:
        return dataclasses.replace(record, why="no pair can leave the int16 range for any input")
    row_axis = 0 if node.op_type == "Conv" or reduction.trans_b else 1
    not_rows = _row_scales(wt, node.op_type, row_axis)
    if zero_points.any() or not_rows:
        why = "asymmetric weights" if zero_points.any() else str(not_rows)
        log.warning("%s: weights can saturate on %s and are not encoded: %s", record.node, kernels.cpus, why)
        return dataclasses.replace(record, encoding="not encoded", why=why)
    assert over is not None
    why = f"{_count(int((over > 0).sum()), 'pair')} in {_count(int((over > 0).any(axis=1).sum()), 'channel')} could "
    why += f"leave the int16 range (by up to {int(over.max())})"
    shared = isinstance(wt, UniformQuantizedType)
    q, factor = encode_rows(rows_f / scales[:, None], lo, hi, acc, wt.storage_min, wt.storage_max, shared)
    after, after_margin = acc.overflow_and_margin(q, lo, hi)
    if after.max() > 0:
        raise AssertionError(f"{record.node}: the weight encoding broke its own proof")
    encoded = with_scales(wt, scales * factor)
    new_scales = _scales(encoded, len(factor))
    moved = int((q != np.clip(np.rint(rows_f / new_scales[:, None]), wt.storage_min, wt.storage_max)).sum())
    set_parameter_type(w, encoded)
    set_stored_values(w, reduction.weight_of(q).astype(wt.storage_type.numpy_dtype))
    noise = float(((rows_f - q * new_scales[:, None]) ** 2).sum())
    return dataclasses.replace(
        record,
        encoding="pair-safe",
        margin=after_margin,
        encoded_sqnr_db=energy_db(signal, noise),
        rescaled=int((factor > 1.0).sum()),
        largest_factor=float(factor.max()),
        moved=moved,
        why=why,
    )


def _against_inputs(
    node: ir.Node, w: ir.Value, xt: UniformQuantizedType, kernels: KernelModel, record: WeightEncoding
) -> WeightEncoding:
    """``record``'s weight rounded by error feedback against the second moments calibration measured
    of the kernel's input (where it did: :mod:`requant.encoding.rounding`), at the scales the
    encoding chose, when that brings the kernel's output closer to float than the integers it has; the
    pair proof (where the kernel pairs products) is checked on the new integers."""
    moments = node.meta.get(MOMENTS_KEY)
    wt = quant_type(w)  # the encoding's (its scales raised where it re-encoded)
    if not isinstance(moments, InputMoments) or not moments.enough or record.encoding == "not encoded":
        return record
    if not isinstance(wt, _WEIGHT_TYPES) or w.const_value is None:
        return record
    data, reduction, rows_f, scales, zero_points, rule = _rows(node, w, xt, wt, kernels)  # a Conv of one group
    if zero_points.any() or _row_scales(wt, node.op_type, 0):
        return record
    chosen = stored_values(w)
    stored = reduction.rows((chosen if chosen is not None else qcast(data, wt)).astype(np.int64))
    acc = rule.accumulation if rule is not None else None
    bound = None
    if acc is not None and acc.saturates:
        if xt.storage_min != 0:  # signed inputs: the bound is not one on same-sign pairs
            return record
        low, high = acc.pair_limits
        bound = (float(xt.storage_max), float(low), float(high))
    h = moments.total
    assert h is not None
    units = rows_f / scales[:, None]
    if h.ndim == 3:  # a depthwise convolution: each channel against its own input
        if bound is not None:
            return record
        q = round_rows_each(units, h, wt.storage_min, wt.storage_max)
    else:
        k = units.shape[1]
        padded = bound is not None and k % 2  # the kernel pads its pairs with a zero element
        f, hk = (np.pad(units, ((0, 0), (0, 1))), np.pad(h, ((0, 1), (0, 1)))) if padded else (units, h)
        q = round_rows(f, hk, wt.storage_min, wt.storage_max, bound)[:, :k]
    over, margin = (
        acc.overflow_and_margin(q.astype(np.int64), xt.storage_min, xt.storage_max)
        if acc is not None
        else (None, record.margin)
    )
    if over is not None and over.max() > 0:
        raise AssertionError(f"{record.node}: error-feedback rounding broke the pair proof")
    signal = output_error(units, np.zeros_like(units), h)
    before, after = output_error(units, stored, h), output_error(units, q, h)
    nearest_db = energy_db(signal, before)
    if after >= before:
        return dataclasses.replace(record, nearest_output_sqnr_db=nearest_db, output_sqnr_db=nearest_db)
    set_stored_values(w, reduction.weight_of(q).astype(wt.storage_type.numpy_dtype))
    weight_noise = float(((rows_f - q * scales[:, None]) ** 2).sum())
    nearest = np.clip(np.rint(units), wt.storage_min, wt.storage_max)
    return dataclasses.replace(
        record,
        rounding="error feedback",
        margin=int(margin),
        encoded_sqnr_db=energy_db(float((data**2).sum()), weight_noise),
        moved=int((q != nearest).sum()),
        nearest_output_sqnr_db=nearest_db,
        output_sqnr_db=energy_db(signal, after),
    )


# what encoding one weight gave: its record, and (when re-encoded) its new type and stored integers
_Encoded = tuple[WeightEncoding, QuantizedType | None, npt.NDArray[Any] | None]
EncodingMemo = dict[tuple[Any, ...], _Encoded]


def encode_weights(model: ir.Model, kernels: KernelModel, memo: EncodingMemo | None = None) -> list[WeightEncoding]:
    """Check (and where needed, re-encode) the weights of every int8 kernel of ``model``'s main
    graph against ``kernels``; returns a record per kernel.

    ``memo`` (filled here): encodings of earlier calls, reused where the same weight tensor has the
    same type in the same kernel (the clones of one model share their tensors: ``method="auto"``'s
    candidates differ only in their activations' scales, which encoding does not read)."""
    records = []
    for node in model.graph:
        for w, xt, wt in _kernels(node):
            key = (
                id(w.const_value),
                str(w.name),
                str(node.name),
                wt,
                xt.storage_min,
                xt.storage_max,
                kernels.name,
            )
            if memo is None or key not in memo:
                record = _encode_one(node, w, xt, wt, kernels)
                record = _against_inputs(node, w, xt, kernels, record)
                encoded = quant_type(w) if record.encoding == "pair-safe" else None
                if memo is not None:
                    memo[key] = (record, encoded, stored_values(w))
            else:
                record, encoded, stored = memo[key]
                if encoded is not None:
                    set_parameter_type(w, encoded)
                if stored is not None:
                    set_stored_values(w, stored)
            records.append(record)
    return records


def rescale_stored(weight: ir.Value, old: Any, new: Any) -> None:
    """After ``weight``'s type changed from ``old`` to ``new`` (raised scales), its encoded integers
    (if it has any) follow: each shrinks by old / new scale, so no pair grows and the proof holds."""
    stored = stored_values(weight)
    if stored is None:
        return
    ratio = _scales(old, 1) / _scales(new, 1)
    if isinstance(new, UniformQuantizedPerAxisType):
        shape = [1] * stored.ndim
        shape[new.axis] = -1
        ratio = ratio.reshape(shape)
    set_stored_values(weight, np.rint(stored * ratio).astype(stored.dtype))
