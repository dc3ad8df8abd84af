"""Data movement and same-scale ops: Reshape, Transpose, Pad, Slice, Concat, Gather, Resize, Identity
(a rescale propagation inserted), Relu and Clip: int8 values moved, rescaled only where types differ.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.lowering import Lowering
from requant.backends.tosa.program import (
    Tensor,
    TosaError,
    named,
)
from requant.ir.provenance import RESCALE_KEY
from requant.ir.queries import constant


def gather(lo: Lowering, node: ir.Node) -> None:
    """A Gather of int8 values at indices known once the shapes are static: ``tosa.gather`` on
    the values as ``[outer, K, inner]`` with the indices repeated for each outer row; or at the
    indices of an input (:meth:`lookup`)."""
    if node.inputs[1] is not None and str(node.inputs[1].name) in lo.index_inputs:
        lookup(lo, node)
        return
    x = lo.same_scale(node)
    x = lo.nchw(x)
    indices = lo.known(node.inputs[1])
    if indices is None:
        raise TosaError(f"node '{named(node)}' (Gather): its indices are not known when the shapes are static")
    axis = node.attributes.get_int("axis", 0) % len(x.shape)
    outer, size = int(np.prod(x.shape[:axis], dtype=np.int64)), x.shape[axis]
    inner = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    flat = np.asarray(indices, np.int64).reshape(-1) % size
    values = lo.add("reshape", [x.name], (outer, size, inner), "i8", new_shape=[outer, size, inner])
    table = lo.const(np.tile(flat, (outer, 1)), "i32")
    picked = lo.add("gather", [values, table], (outer, len(flat), inner), "i8")
    shape = lo.shape_of(node.outputs[0])
    lo.finish(node, lo.add("reshape", [picked], shape, "i8", new_shape=list(shape)), shape, False)


def lookup(lo: Lowering, node: ir.Node) -> None:
    """An embedding: rows of a constant int8 table (``[K, C]``, axis 0) at the indices the host gives
    (an i32 input: token ids), one ``tosa.gather`` of the table as ``[1, K, C]``."""
    table = lo.operand(node.inputs[0], node)
    if len(table.shape) != 2 or node.attributes.get_int("axis", 0) != 0:
        raise TosaError(f"node '{named(node)}' (Gather): rows of a 2-d table at an input's indices are lowered, "
                        f"not axis {node.attributes.get_int('axis', 0)} of {list(table.shape)}")  # fmt: skip
    ids = lo.index_inputs[str(node.inputs[1].name)]  # type: ignore[union-attr]
    count = int(np.prod(ids.shape, dtype=np.int64))
    rows, width = table.shape
    values = lo.add("reshape", [table.name], (1, rows, width), "i8", new_shape=[1, rows, width])
    flat = lo.add("reshape", [ids.name], (1, count), "i32", new_shape=[1, count])
    picked = lo.add("gather", [values, flat], (1, count, width), "i8")
    shape = lo.shape_of(node.outputs[0])
    q, scale, zp = lo.quantized_output(node.outputs[0], node)
    if not math.isclose(scale, table.scale, rel_tol=1e-6) or zp != table.zero_point:
        raise TosaError(f"node '{named(node)}' (Gather): its table and its rows are quantized differently")
    lo.tensors[str(q.outputs[0].name)] = Tensor(
        lo.add("reshape", [picked], shape, "i8", new_shape=list(shape)), shape, scale, zp
    )


def identity(lo: Lowering, node: ir.Node) -> None:
    """An Identity moves its int8 values; one propagation inserted (``RESCALE_KEY``: where an op
    bound to one type got two, :mod:`requant.propagation.propagate`) is a ``tosa.rescale`` to its
    output's type, for the reason it records."""
    why = node.metadata_props.get(RESCALE_KEY)
    if why is None:
        x = lo.same_scale(node)
        lo.finish(node, x.name, x.shape, x.nhwc)
        return
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    t = lo.retyped(lo.source(node.inputs[0], node), out_scale, out_zp, why)
    lo.tensors[str(q.outputs[0].name)] = t


def reshape(lo: Lowering, node: ir.Node) -> None:
    x = lo.same_scale(node)
    x = lo.nchw(x)
    shape = lo.shape_of(node.outputs[0])
    lo.finish(node, lo.add("reshape", [x.name], shape, "i8", new_shape=list(shape)), shape, False)


def transpose_op(lo: Lowering, node: ir.Node) -> None:
    """A Transpose of int8 values (ONNX's axes, on the tensor as NCHW), quantized alike before and after."""
    x = lo.nchw(lo.same_scale(node))
    perm = list(node.attributes.get_ints("perm", list(range(len(x.shape)))[::-1]))
    shape = tuple(x.shape[p] for p in perm)
    lo.finish(node, lo.add("transpose", [x.name], shape, "i8", perms=perm), shape, False)


def pad(lo: Lowering, node: ir.Node) -> None:
    """A constant Pad of int8 values as ``tosa.pad`` (a batch of one padded as 3-d: mlir-opt 22's level
    check counts a 4-d padding's 8 numbers as a rank above 6). Both forms requant writes: padding
    the integers with the zero point (the int8 input is the QuantizeLinear's output), or a float Pad
    between conversions of one type (its value quantized)."""
    source = node.inputs[0]
    x = lo.tensors.get(str(source.name)) if source is not None else None
    integer = x is not None
    if x is None:
        x = lo.same_scale(node)
    if node.attributes.get_string("mode", "constant") != "constant" or (len(node.inputs) > 3 and node.inputs[3]):
        raise TosaError(f"node '{named(node)}' (Pad): a constant pad of every axis is lowered, not this one")
    pads = lo.known(node.inputs[1]) if len(node.inputs) > 1 else None
    if pads is None:
        raise TosaError(f"node '{named(node)}' (Pad): its pads are not known when the shapes are static")
    rank = len(x.shape)
    pads = np.asarray(pads, np.int64).reshape(2, rank)
    given = constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if integer:  # the stored value requant pads with (the zero point), as int8
        fill = (
            x.zero_point
            if given is None
            else int(np.asarray(given).reshape(())) - (128 if given.dtype == np.uint8 else 0)
        )
    else:
        real = 0.0 if given is None else float(np.asarray(given).reshape(()))
        fill = int(np.clip(np.rint(real / x.scale) + x.zero_point, -128, 127))
    order = [0, 2, 3, 1] if x.nhwc and rank == 4 else list(range(rank))  # ONNX's axes, as the tensor is held
    before, after = pads[0][order], pads[1][order]
    shape = tuple(int(d + b + a) for d, b, a in zip(x.shape, before, after, strict=True))
    view, padded = x, shape
    if rank == 4 and x.shape[0] == 1 and before[0] == after[0] == 0:
        view = Tensor(lo.reshaped(x, x.shape[1:]), x.shape[1:], x.scale, x.zero_point, x.nhwc)
        before, after, padded = before[1:], after[1:], shape[1:]
    padding = [int(v) for pair in zip(before, after, strict=True) for v in pair]
    name = lo.add("pad", [view.name, lo.zero_point(fill)], padded, "i8", padding=padding)
    if padded != shape:
        name = lo.add("reshape", [name], shape, "i8", new_shape=list(shape))
    result = Tensor(name, shape, x.scale, x.zero_point, x.nhwc)
    if integer:
        lo.tensors[str(node.outputs[0].name)] = result
    else:
        lo.finish(node, name, shape, x.nhwc)


def resize(lo: Lowering, node: ir.Node) -> None:
    """Nearest-neighbour upsampling by whole factors (every output pixel a copy of
    ``input[out // factor]``: what ONNX's asymmetric/floor and half-pixel nearest modes compute
    then) as ``tosa.resize``: scale ``2 f / 2`` with offset ``-f``, so TOSA's rounding to the
    nearest source lands on the floor (``tosa.resize`` rounds half up)."""
    mode = node.attributes.get_string("mode", "nearest")
    if mode == "linear":
        resize_bilinear(lo, node)
        return
    _, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"Resize '{named(node)}': its input to the output's scale and zero point"
    x = lo.retyped(lo.nhwc(lo.source(node.inputs[0], node)), out_scale, out_zp, why)
    transform = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    rounding = node.attributes.get_string("nearest_mode", "round_prefer_floor")
    n, c, oh, ow = lo.shape_of(node.outputs[0])
    _, ih, iw, _ = x.shape
    whole = oh % ih == 0 and ow % iw == 0 and n == x.shape[0] and c == x.shape[3]
    floor = transform in ("half_pixel", "pytorch_half_pixel") or (transform == "asymmetric" and rounding == "floor")
    if mode != "nearest" or not whole or not floor:
        raise TosaError(f"node '{named(node)}' (Resize): nearest upsampling of H and W by whole factors is "
                        f"lowered, not {mode} ({transform}, {rounding}) from {ih}x{iw} to {oh}x{ow}")  # fmt: skip
    fy, fx = oh // ih, ow // iw
    scale = [2 * fy, 2, 2 * fx, 2]
    offset = [-fy, -fx]
    border = [(oh - 1) * 2 - (ih - 1) * 2 * fy - fy, (ow - 1) * 2 - (iw - 1) * 2 * fx - fx]
    shape = (n, oh, ow, c)
    name = lo.add("resize", [x.name], shape, "i8", scale=scale, offset=offset, border=border)
    lo.finish(node, name, shape, True)


def resize_bilinear(lo: Lowering, node: ir.Node) -> None:
    """Bilinear upsampling of H and W as ``tosa.resize``: each output the sum of its four source
    values weighted in whole units (the weights of an axis add up to its ``scale_n``), in int32;
    the zero point taken out by one add (``zp * scale_y_n * scale_x_n``), then rescaled to the
    output's int8. ``half_pixel`` (and ``pytorch_half_pixel``) and ``asymmetric`` by whole
    factors, ``align_corners`` by any; TOSA clamps the source rows and columns at the edges as
    ONNX does."""
    x = lo.nhwc(lo.source(node.inputs[0], node))
    transform = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    n, c, oh, ow = lo.shape_of(node.outputs[0])
    _, ih, iw, _ = x.shape
    scale: list[int] = []
    offset: list[int] = []
    for out, size in ((oh, ih), (ow, iw)):
        factor = out // size if out % size == 0 else 0
        if transform in ("half_pixel", "pytorch_half_pixel") and factor:  # (out + 0.5) / f - 0.5
            scale, offset = [*scale, 2 * factor, 2], [*offset, 1 - factor]
        elif transform == "asymmetric" and factor:  # out / f
            scale, offset = [*scale, factor, 1], [*offset, 0]
        elif transform == "align_corners" and size > 1 and out > size:  # out (size - 1) / (out - 1)
            scale, offset = [*scale, out - 1, size - 1], [*offset, 0]
        else:
            raise TosaError(f"node '{named(node)}' (Resize): linear upsampling ({transform}) from {ih}x{iw} to "
                            f"{oh}x{ow} is not lowered (whole factors; align_corners any)")  # fmt: skip
    if max(scale[0], scale[2]) > 1 << 11:
        raise TosaError(f"node '{named(node)}' (Resize): TOSA's bilinear scale is at most 2048, not {scale}")
    border = [(oh - 1) * scale[1] - (ih - 1) * scale[0] + offset[0],
              (ow - 1) * scale[3] - (iw - 1) * scale[2] + offset[1]]  # fmt: skip
    shape = (n, oh, ow, c)
    units = scale[0] * scale[2]
    sums = lo.add("resize", [x.name], shape, "i32", scale=scale, offset=offset, border=border, mode="BILINEAR")
    if x.zero_point:
        sums = lo.add("add", [sums, lo.const(np.full((1, 1, 1, 1), -x.zero_point * units), "i32")], shape,
                        "i32")  # fmt: skip
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"Resize '{named(node)}': the bilinear sums (in 1/{units} units) to the int8 output"
    result = lo.rescale(sums, shape, np.array([x.scale / (units * out_scale)]), 0, out_zp, "i32", why)
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, shape, out_scale, out_zp, True)


def slice_op(lo: Lowering, node: ir.Node) -> None:
    """A Slice of int8 values (static starts, ends, axes and positive steps) as ``tosa.slice``; an
    axis taken every ``k``-th element (YOLOX's Focus stem, ``x[..., ::2, ::2]``) is first viewed as
    ``[size / k, k]`` (TOSA's slice has no step), sliced on both, and merged back."""
    x = lo.nchw(lo.same_scale(node))
    known = [lo.known(v) for v in node.inputs[1:5]]
    starts, ends = known[0], known[1]
    if starts is None or ends is None:
        raise TosaError(f"node '{named(node)}' (Slice): its starts and ends are not known for static shapes")
    rank = len(x.shape)
    axes = known[2] if len(known) > 2 and known[2] is not None else np.arange(len(starts))
    steps = known[3] if len(known) > 3 and known[3] is not None else np.ones(len(starts), np.int64)
    name, shape = x.name, list(x.shape)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis, size, step = int(axis) % rank, shape[int(axis) % rank], int(step)
        first, stop, _ = slice(int(start), int(end), step).indices(size)
        count = len(range(first, stop, step))
        if step < 1 or count == 0 or (step > 1 and size % step):
            raise TosaError(f"node '{named(node)}' (Slice): step {step} on an axis of {size} is not lowered")
        if step == 1:
            begin, sizes = [0] * rank, list(shape)
            begin[axis], sizes[axis] = first, count
            name = lo.add("slice", [name], tuple(sizes), "i8", start=begin, size=sizes)
            shape = sizes
            continue
        view = [*shape[:axis], size // step, step, *shape[axis + 1 :]]
        name = lo.add("reshape", [name], tuple(view), "i8", new_shape=view)
        begin, sizes = [0] * (rank + 1), list(view)
        begin[axis], sizes[axis] = first // step, count
        begin[axis + 1], sizes[axis + 1] = first % step, 1
        name = lo.add("slice", [name], tuple(sizes), "i8", start=begin, size=sizes)
        shape = [*shape[:axis], count, *shape[axis + 1 :]]
        name = lo.add("reshape", [name], tuple(shape), "i8", new_shape=list(shape))
    lo.finish(node, name, tuple(shape), False)


def concat(lo: Lowering, node: ir.Node) -> None:
    """``tosa.concat`` of int8 tensors, each first rescaled to the output's scale and zero point
    where its own differ (a concat's inputs rarely share one: the rescale is where they meet)."""
    parts = [lo.source(v, node) for v in node.inputs if v is not None]
    nhwc = all(t.nhwc for t in parts)
    parts = [lo.nhwc(t) if nhwc else lo.nchw(t) for t in parts]
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    rank = len(parts[0].shape)
    axis = node.attributes.get_int("axis", 0) % rank
    if nhwc:
        axis = [0, 2, 3, 1].index(axis)
    names = []
    for value, t in zip((v for v in node.inputs if v is not None), parts, strict=True):
        why = f"Concat '{named(node)}': input '{value.name}' to the output's scale and zero point"
        names.append(lo.retyped(t, out_scale, out_zp, why).name)
    shape = list(parts[0].shape)
    shape[axis] = sum(t.shape[axis] for t in parts)
    name = lo.add("concat", names, tuple(shape), "i8", axis=axis)
    lo.tensors[str(q.outputs[0].name)] = Tensor(name, tuple(shape), out_scale, out_zp, nhwc)


def clamp(lo: Lowering, node: ir.Node) -> None:
    x = lo.same_scale(node)
    lo.finish(node, lo.clamp_after(x.name, x.shape, node, x.scale, x.zero_point), x.shape, x.nhwc)
