"""Pools and reductions: MaxPool, AveragePool, GlobalAveragePool, ReduceMean / ReduceSum / ReduceMax
(int32 sums rescaled by 1/count) and ArgMax (indices).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.lowering import Lowering, exact_pads
from requant.backends.tosa.program import (
    Tensor,
    TosaError,
    named,
)


def max_pool(lo: Lowering, node: ir.Node) -> None:
    x = lo.same_scale(node)
    x = lo.nhwc(x)
    dilated = any(d != 1 for d in node.attributes.get_ints("dilations", [1, 1]))
    if node.attributes.get_int("ceil_mode", 0) or dilated:
        raise TosaError(f"node '{named(node)}': MaxPool with ceil_mode or dilations is not lowered")
    pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
    n, c, h, w = lo.shape_of(node.outputs[0])
    shape = (n, h, w, c)
    kernel = list(node.attributes.get_ints("kernel_shape"))
    strides = list(node.attributes.get_ints("strides", [1, 1]))
    tosa_pads, crop = exact_pads(x.shape[1:3], kernel, pads, strides, [1, 1])
    x = lo.cropped(x, crop)
    name = lo.add("max_pool2d", [x.name], shape, "i8", kernel=kernel, stride=strides, pad=tosa_pads)
    lo.finish(node, name, shape, True)


def global_average_pool(lo: Lowering, node: ir.Node) -> None:
    """The mean over H and W: the int8 values (zero point removed) summed in int32 over each
    axis, then rescaled by ``input scale / (H W output scale)``."""
    x = lo.nhwc(lo.source(node.inputs[0], node))
    n, h, w, c = x.shape
    if h * w * 255 >= 1 << 31:
        raise TosaError(f"node '{named(node)}': a {h}x{w} mean could overflow its int32 sum")
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    wide = lo.rescale_to_i32(x, 1.0, f"GlobalAveragePool '{named(node)}': int8 to int32, zero point removed")
    rows = lo.add("reduce_sum", [wide], (n, 1, w, c), "i32", axis=1)
    total = lo.add("reduce_sum", [rows], (n, 1, 1, c), "i32", axis=2)
    why = f"GlobalAveragePool '{named(node)}': the sum over {h}x{w} positions to the int8 mean"
    result = lo.rescale(total, (n, 1, 1, c), np.array([x.scale / (h * w * out_scale)]), 0, out_zp, "i32", why)
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, (n, 1, 1, c), out_scale, out_zp, True)


def average_pool(lo: Lowering, node: ir.Node) -> None:
    """A mean over each window as a depthwise conv with weights 1 (int32 sums, the zero point
    removed) rescaled by ``1 / window``: exact where every window counts the same (no padding, or
    padding counted). Where padding is not counted (the windows at the edges average fewer values),
    ``tosa.avg_pool2d``, which counts only the input's values, as ONNX does then."""
    x = lo.nhwc(lo.source(node.inputs[0], node))
    pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
    counted, ceil = (bool(node.attributes.get_int(a, 0)) for a in ("count_include_pad", "ceil_mode"))
    if not counted and (any(pads) or ceil):
        average_pool_uncounted(lo, node, x, pads)
        return
    if ceil:
        raise TosaError(f"node '{named(node)}': AveragePool with ceil_mode and counted padding is not lowered")
    kernel = list(node.attributes.get_ints("kernel_shape"))
    strides = list(node.attributes.get_ints("strides", [1, 1]))
    tosa_pads, crop = exact_pads(x.shape[1:3], kernel, pads, strides, [1, 1])
    x = lo.cropped(x, crop)
    n, c, h, w = lo.shape_of(node.outputs[0])
    ones = lo.const(np.ones((*kernel, c, 1)), "i8")
    zeros = [lo.const(np.zeros(c), "i32"), lo.zero_point(x.zero_point), lo.zero_point(0)]
    sums = lo.add("depthwise_conv2d", [x.name, ones, *zeros], (n, h, w, c), "i32", pad=tosa_pads,
                    stride=strides, dilation=[1, 1], node=named(node))  # fmt: skip
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    why = f"AveragePool '{named(node)}': the sum over {kernel[0]}x{kernel[1]} positions to the int8 mean"
    result = lo.rescale(sums, (n, h, w, c), np.array([x.scale / (kernel[0] * kernel[1] * out_scale)]), 0, out_zp,
                          "i32", why)  # fmt: skip
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, (n, h, w, c), out_scale, out_zp, True)


def average_pool_uncounted(lo: Lowering, node: ir.Node, x: Tensor, pads: list[int]) -> None:
    """``tosa.avg_pool2d``: each window's input values (zero point removed) summed in int32 and
    divided by how many there are (TOSA's ``reciprocal_scale``, rounded), on the input's scale;
    then a rescale to the output's, where the QuantizeLinear after the pool asks for another. The
    bottom and right padding are what make TOSA's output size exact (a ``ceil_mode`` window past
    the input counts no more than its values)."""
    kernel = list(node.attributes.get_ints("kernel_shape"))
    strides = list(node.attributes.get_ints("strides", [1, 1]))
    if any(d != 1 for d in node.attributes.get_ints("dilations", [1, 1])):
        raise TosaError(f"node '{named(node)}': AveragePool with dilations is not lowered")
    n, c, h, w = lo.shape_of(node.outputs[0])
    tosa_pads, crop = [pads[0], 0, pads[1], 0], [0, 0]
    for axis, out in ((0, h), (1, w)):  # the end padding TOSA's size formula needs, or rows to crop
        end = (out - 1) * strides[axis] + kernel[axis] - x.shape[1 + axis] - pads[axis]
        tosa_pads[2 * axis + 1], crop[axis] = max(end, 0), max(-end, 0)
    if any(p >= k for p, k in zip(tosa_pads, (kernel[0], kernel[0], kernel[1], kernel[1]), strict=True)):
        raise TosaError(
            f"node '{named(node)}': AveragePool padding {tosa_pads} reaches a whole window (TOSA: pad < kernel)"
        )
    x = lo.cropped(x, crop)
    shape = (n, h, w, c)
    pooled = lo.add("avg_pool2d", [x.name, lo.zero_point(x.zero_point), lo.zero_point(x.zero_point)], shape,
                      "i8", kernel=kernel, stride=strides, pad=tosa_pads)  # fmt: skip
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    if not math.isclose(out_scale, x.scale, rel_tol=1e-6) or out_zp != x.zero_point:
        why = f"AveragePool '{named(node)}': the mean (on the input's scale) to the output's scale and zero point"
        pooled = lo.rescale(pooled, shape, np.array([x.scale / out_scale]), x.zero_point, out_zp, "i8", why)
    lo.tensors[str(q.outputs[0].name)] = Tensor(pooled, shape, out_scale, out_zp, True)


def reduce(lo: Lowering, node: ir.Node) -> None:
    """ReduceMean and ReduceSum: the int8 values (zero point removed) summed in int32 along each
    axis (``tosa.reduce_sum``), rescaled by ``1 / count`` for a mean to the int8 output;
    ReduceMax: ``tosa.reduce_max`` of the int8 values (one type in and out). Axes of ONNX's
    layout; without ``keepdims`` a ``tosa.reshape`` drops them."""
    largest = node.op_type == "ReduceMax"
    x = lo.nchw(lo.same_scale(node) if largest else lo.source(node.inputs[0], node))
    axes = reduce_axes(lo, node, len(x.shape))
    final = lo.shape_of(node.outputs[0])
    why = f"{node.op_type} '{named(node)}'"
    name, dtype = (x.name, "i8") if largest else (lo.rescale_to_i32(x, 1.0, why + ": its input to int32, zero "
                                                                      "point removed"), "i32")  # fmt: skip
    for axis in axes:  # one axis at a time, each kept
        shape = tuple(1 if i in axes and i <= axis else d for i, d in enumerate(x.shape))
        name = lo.add("reduce_max" if largest else "reduce_sum", [name], shape, dtype, axis=axis)
    if largest:
        if final != shape:
            name = lo.add("reshape", [name], final, "i8", new_shape=list(final))
        lo.finish(node, name, final, False)
        return
    count = int(np.prod([x.shape[i] for i in axes])) if node.op_type == "ReduceMean" else 1
    q, out_scale, out_zp = lo.quantized_output(node.outputs[0], node)
    what = f"the sum over {count} values to the int8 mean" if count > 1 else "the int32 sum to its int8 output"
    result = lo.rescale(name, shape, np.array([x.scale / (count * out_scale)]), 0, out_zp, "i32",
                          f"{why}: {what}")  # fmt: skip
    if final != shape:
        result = lo.add("reshape", [result], final, "i8", new_shape=list(final))
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, final, out_scale, out_zp, False)


def reduce_axes(lo: Lowering, node: ir.Node, rank: int) -> list[int]:
    """A Reduce op's axes (its attribute, or its second input from opset 18, 13 for ReduceSum),
    sorted and non-negative; every axis when none are given."""
    given = node.inputs[1] if len(node.inputs) > 1 else None
    axes = lo.known(given) if given is not None else None
    if given is not None and axes is None:
        raise TosaError(f"node '{named(node)}' ({node.op_type}): its axes are not known when the shapes are static")
    if axes is None:
        attribute = node.attributes.get("axes")
        axes = np.asarray(attribute.as_ints() if attribute is not None else [], np.int64)
    if len(axes) == 0:
        if node.attributes.get_int("noop_with_empty_axes", 0):
            raise TosaError(f"node '{named(node)}' ({node.op_type}): a reduction over no axes is not lowered")
        return list(range(rank))
    return sorted({int(a) % rank for a in axes})


def argmax(lo: Lowering, node: ir.Node) -> None:
    """``tosa.argmax`` of the int8 values (the first largest, as ONNX's default): the same index as
    on the dequantized values, whatever the scale; its i32 result is one of the function's results
    (an ArgMax read by other ops is not lowered). Over NHWC channels without a transpose."""
    x = lo.source(node.inputs[0], node)
    if node.attributes.get_int("select_last_index", 0):
        raise TosaError(f"node '{named(node)}': ArgMax with select_last_index (TOSA's argmax takes the first)")
    axis = node.attributes.get_int("axis", 0) % len(x.shape)
    if x.nhwc and axis == 1:
        axis = 3  # channels, last in NHWC: the other axes keep ONNX's order
    else:
        x = lo.nchw(x)
    shape = tuple(d for i, d in enumerate(x.shape) if i != axis)
    name = lo.add("argmax", [x.name], shape, "i32", axis=axis)
    wanted = lo.shape_of(node.outputs[0])  # keepdims: the axis kept, of size 1
    if wanted != shape:
        name = lo.add("reshape", [name], wanted, "i32", new_shape=list(wanted))
    lo.indices[str(node.outputs[0].name)] = (name, wanted)
