"""Kernels: Conv, ConvTranspose, Gemm and MatMul as tosa.conv2d / depthwise_conv2d /
transpose_conv2d / matmul, their int32 sums rescaled to the next int8 tensor (an activation after
one clamped there).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.lowering import Lowering, dequantized_constant, exact_pads
from requant.backends.tosa.program import (
    Array,
    Tensor,
    TosaError,
    named,
)
from requant.ir.queries import constant
from requant.targets.tosa_int8 import transposed_unlike_tosa


def kernel_output(
    lo: Lowering,
    node: ir.Node,
    acc: str,
    shape: tuple[int, ...],
    scales: Array,
    nhwc: bool,
    final: tuple[int, ...] = (),
) -> None:
    """An int32 accumulator of ``scales`` (per last axis) to the int8 tensor its QuantizeLinear
    asks for, through a Relu or Clip when one follows (reshaped to ``final`` when given)."""
    value = node.outputs[0]
    uses = [u.node for u in value.uses()]
    activation = uses[0] if len(uses) == 1 and uses[0].op_type in ("Relu", "Clip") else None
    q, out_scale, out_zp = lo.quantized_output(activation.outputs[0] if activation else value, node)
    why = f"{node.op_type} '{named(node)}': int32 accumulator to its int8 output"
    result = lo.rescale(acc, shape, scales / out_scale, 0, out_zp, "i32", why)
    if activation is not None:
        result = lo.clamp_after(result, shape, activation, out_scale, out_zp)
    if final and tuple(final) != tuple(shape):
        result, shape = lo.add("reshape", [result], final, "i8", new_shape=list(final)), final
    lo.tensors[str(q.outputs[0].name)] = Tensor(result, shape, out_scale, out_zp, nhwc)


def conv(lo: Lowering, node: ir.Node) -> None:
    x = lo.nhwc(lo.source(node.inputs[0], node))
    w, w_scale, w_zp = dequantized_constant(node.inputs[1], node)
    bias = dequantized_constant(node.inputs[2], node)[0] if len(node.inputs) > 2 else None
    if w.ndim != 4 or np.any(w_zp != 0):
        raise TosaError(f"node '{named(node)}': 2-d convs with symmetric weights are lowered, not this one")
    group = node.attributes.get_int("group", 1)
    pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
    strides = list(node.attributes.get_ints("strides", [1, 1]))
    dilations = list(node.attributes.get_ints("dilations", [1, 1]))
    if node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", ""):
        raise TosaError(f"node '{named(node)}': auto_pad is not lowered (canonicalize writes explicit pads)")
    out_c = w.shape[0]
    n, c, h, wd = lo.shape_of(node.outputs[0])
    shape = (n, h, wd, c)
    bias_q = bias.astype(np.int32) if bias is not None else np.zeros(out_c, np.int32)
    tosa_pads, crop = exact_pads(x.shape[1:3], list(w.shape[2:]), pads, strides, dilations)
    x = lo.cropped(x, crop)
    attrs = {"pad": tosa_pads, "stride": strides, "dilation": dilations}
    zps = [lo.zero_point(x.zero_point), lo.zero_point(0)]
    if group == 1:
        weight = lo.const(w.transpose(0, 2, 3, 1), "i8")  # OIHW -> OHWI
        acc = lo.add("conv2d", [x.name, weight, lo.const(bias_q, "i32"), *zps], shape, "i32", **attrs,
                       node=named(node))  # fmt: skip
    elif group == x.shape[3] and w.shape[1] == 1:
        multiplier = out_c // group
        weight = lo.const(w.reshape(group, multiplier, *w.shape[2:]).transpose(2, 3, 0, 1), "i8")  # KH KW C M
        acc = lo.add("depthwise_conv2d", [x.name, weight, lo.const(bias_q, "i32"), *zps], shape, "i32",
                       **attrs, node=named(node))  # fmt: skip
    else:
        raise TosaError(f"node '{named(node)}': a grouped conv ({group} groups) that is not depthwise is not lowered")
    scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (out_c,)) * x.scale
    kernel_output(lo, node, acc, shape, scales, True)


def conv_transpose(lo: Lowering, node: ir.Node) -> None:
    """A 2-d ConvTranspose as ``tosa.transpose_conv2d``: input row ``iy`` times kernel row ``ky`` adds
    to output row ``iy * stride + ky + out_pad_top``, so TOSA's ``out_pad`` is ONNX's pads negated
    (``output_padding`` added at the bottom and right), and the weight ``[I, O, KH, KW]`` becomes
    ``[O, KH, KW, I]``. TOSA's has no groups: a grouped one is one ``tosa.transpose_conv2d`` per
    group, on its slice of the input channels, concatenated in int32 (its weight's per-channel
    scales, on axis 1, are one group's output channels: every group reads them); nor dilations: a
    dilated one has its kernel spread out with zeros between the taps (the same sums)."""
    x = lo.nhwc(lo.source(node.inputs[0], node))
    w, w_scale, w_zp = dequantized_constant(node.inputs[1], node)
    bias = dequantized_constant(node.inputs[2], node)[0] if len(node.inputs) > 2 else None
    why = transposed_unlike_tosa(node)
    if w.ndim != 4 or np.any(w_zp != 0) or why:
        raise TosaError(f"node '{named(node)}': 2-d ConvTransposes with symmetric weights are lowered, and "
                        f"tosa.transpose_conv2d has {why or 'int8 weights of zero point 0'}")  # fmt: skip
    dh, dw = node.attributes.get_ints("dilations", [1, 1])
    if (dh, dw) != (1, 1):  # tosa.transpose_conv2d has no dilation: the same kernel with zeros between its taps
        dilated = np.zeros((*w.shape[:2], (w.shape[2] - 1) * dh + 1, (w.shape[3] - 1) * dw + 1), w.dtype)
        dilated[:, :, ::dh, ::dw] = w
        w = dilated
    top, left, bottom, right = node.attributes.get_ints("pads", [0, 0, 0, 0])
    extra_h, extra_w = node.attributes.get_ints("output_padding", [0, 0])
    group = node.attributes.get_int("group", 1)
    n, c, h, wd = lo.shape_of(node.outputs[0])
    shape = (n, h, wd, c)
    bias_q = bias.astype(np.int32) if bias is not None else np.zeros(c, np.int32)
    zps = [lo.zero_point(x.zero_point), lo.zero_point(0)]
    inputs, outputs = w.shape[0] // group, w.shape[1]  # per group
    attrs = {"out_pad": [-top, extra_h - bottom, -left, extra_w - right],
             "stride": list(node.attributes.get_ints("strides", [1, 1])), "node": named(node)}  # fmt: skip
    parts = []
    for g in range(group):
        part = x
        if group > 1:
            size = [*x.shape[:3], inputs]
            part = Tensor(lo.add("slice", [x.name], tuple(size), "i8", start=[0, 0, 0, g * inputs], size=size),
                           tuple(size), x.scale, x.zero_point, True)  # fmt: skip
        weight = lo.const(w[g * inputs : (g + 1) * inputs].transpose(1, 2, 3, 0), "i8")  # IOHW -> OHWI
        biases = lo.const(bias_q[g * outputs : (g + 1) * outputs], "i32")
        parts.append(lo.add("transpose_conv2d", [part.name, weight, biases, *zps], (n, h, wd, outputs), "i32",
                              **attrs))  # fmt: skip
    acc = parts[0] if group == 1 else lo.add("concat", parts, shape, "i32", axis=3)
    scales = np.resize(np.asarray(w_scale, np.float64).reshape(-1), c) * x.scale  # repeated for every group
    kernel_output(lo, node, acc, shape, scales, True)


def gemm(lo: Lowering, node: ir.Node) -> None:
    x = lo.nchw(lo.source(node.inputs[0], node))
    w, w_scale, w_zp = dequantized_constant(node.inputs[1], node)
    if node.attributes.get_int("transA", 0) or len(x.shape) != 2 or np.any(w_zp != 0):
        raise TosaError(f"node '{named(node)}': a Gemm of a 2-d input (transA 0) and symmetric weights is lowered")
    if node.attributes.get_float("alpha", 1.0) != 1.0 or node.attributes.get_float("beta", 1.0) != 1.0:
        raise TosaError(f"node '{named(node)}': a Gemm with alpha or beta other than 1 is not lowered")
    weight = w.T if node.attributes.get_int("transB", 0) else w  # [K, M]
    rows, depth = x.shape
    out = weight.shape[1]
    x3 = lo.add("reshape", [x.name], (1, rows, depth), "i8", new_shape=[1, rows, depth])
    acc = lo.add("matmul", [x3, lo.const(weight[None], "i8"), lo.zero_point(x.zero_point),
                              lo.zero_point(0)], (1, rows, out), "i32", node=named(node))  # fmt: skip
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = dequantized_constant(node.inputs[2], node)[0].astype(np.int32).reshape(1, 1, -1)
        acc = lo.add("add", [acc, lo.const(np.broadcast_to(bias, (1, 1, out)), "i32")], (1, rows, out), "i32")
    scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (out,)) * x.scale
    kernel_output(lo, node, acc, (1, rows, out), scales, False, (rows, out))


def matmul(lo: Lowering, node: ir.Node) -> None:
    """``tosa.matmul`` (int8 operands, their zero points, an int32 result) on 3-d views: a constant
    weight ``[K, N]`` (symmetric int8, per tensor or per column) times every row of the input; or
    two activations batch by batch (attention's products; their batch dimensions must agree). The
    int32 result is rescaled to the int8 output, per column for a per-column weight."""
    a = lo.nchw(lo.source(node.inputs[0], node))
    b_value = node.inputs[1]
    out = lo.shape_of(node.outputs[0])
    producer = b_value.producer() if b_value is not None else None
    if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
        w, w_scale, w_zp = dequantized_constant(b_value, node)
        if w.ndim != 2 or np.any(w_zp != 0) or w.dtype != np.int8:
            raise TosaError(f"node '{named(node)}' (MatMul): a constant weight is lowered as a symmetric int8 matrix")
        rows = int(np.prod(a.shape[:-1], dtype=np.int64))
        depth, columns = w.shape
        x3 = lo.reshaped(a, (1, rows, depth))
        acc = lo.add("matmul", [x3, lo.const(w[None], "i8"), lo.zero_point(a.zero_point),
                                  lo.zero_point(0)], (1, rows, columns), "i32", node=named(node))  # fmt: skip
        scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (columns,)) * a.scale
        kernel_output(lo, node, acc, (1, rows, columns), scales, False, out)
        return
    b = lo.nchw(lo.source(b_value, node))
    if len(a.shape) < 2 or len(a.shape) != len(b.shape) or a.shape[:-2] != b.shape[:-2]:
        raise TosaError(f"node '{named(node)}' (MatMul): activations {list(a.shape)} and {list(b.shape)} with "
                        "different batch dimensions are not lowered")  # fmt: skip
    batch = int(np.prod(a.shape[:-2], dtype=np.int64))
    (m, depth), n = a.shape[-2:], b.shape[-1]
    a3, b3 = lo.reshaped(a, (batch, m, depth)), lo.reshaped(b, (batch, depth, n))
    acc = lo.add("matmul", [a3, b3, lo.zero_point(a.zero_point), lo.zero_point(b.zero_point)],
                   (batch, m, n), "i32", node=named(node))  # fmt: skip
    kernel_output(lo, node, acc, (batch, m, n), np.array([a.scale * b.scale]), False, out)
