"""Integer-only TOSA from a quantized (QDQ) model: the ``tosa-int8`` target's backend.

The QDQ model requant writes for ONNX Runtime already holds every decision: each activation's
``QuantizeLinear`` (scale, zero point), each kernel's int8 weights (per output channel, zero point
0) and int32 bias. Lowering reads those and writes a TOSA 1.0 program (the int profile) in which
nothing is float:

- the function takes the model's inputs quantized (int8) and returns its outputs quantized; the
  host quantizes and dequantizes with the parameters of :class:`Edge` (the MLIR file's header);
- a ``Conv`` becomes ``tosa.conv2d`` / ``tosa.depthwise_conv2d`` (NHWC; transposes where the
  layout changes), a ``ConvTranspose`` ``tosa.transpose_conv2d``, a ``Gemm`` ``tosa.matmul`` plus
  an int32 ``tosa.add`` of its bias, a ``MatMul`` ``tosa.matmul`` (a constant weight, or two
  activations batch by batch); each kernel's int32 accumulator goes to the next int8 tensor
  through ``tosa.rescale`` with a fixed-point multiplier and shift per output channel (``input
  scale x weight scale / output scale``), and a Relu or Clip after it becomes a ``tosa.clamp`` on
  the int8 result;
- ``MaxPool``, ``Reshape`` / ``Flatten``, ``Transpose``, ``Relu`` and ``Clip`` between conversions of one scale run
  on the int8 values; an elementwise ``Add`` of two int8 tensors rescales both to int32 on a common
  scale, adds, and rescales to its output.

uint8 activations (ONNX Runtime's presets) become int8 exactly: ``q - 128`` with zero point
``zp - 128``. Shapes are static (the batch is fixed to 1). ``backends.tosa_mlir`` writes the
program as MLIR text, ``backends.tosa_reference`` computes it in NumPy, bit for bit as TOSA defines
it, and ``backends.tosa_tools`` checks it with ``mlir-opt`` and runs it in IREE.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.provenance import RESCALE_KEY
from requant.ir.queries import constant
from requant.targets.tosa_int8 import transposed_unlike_tosa
from requant.types import UniformQuantizedType, dcast, qcast

__all__ = ["Edge", "TosaError", "TosaOp", "TosaProgram", "lower_to_tosa", "multiplier_shift"]

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


def _name(node: ir.Node) -> str:
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
class _Tensor:
    """An int8 tensor of the program: its op name, its shape as the op holds it, and its layout."""

    name: str
    shape: tuple[int, ...]
    scale: float
    zero_point: int  # int8
    nhwc: bool = False  # a 4-d tensor held as NHWC (its ONNX shape is NCHW)
    wide: bool = False  # an int32 stream (a residual sum), zero point 0


def _exact_pads(size: tuple[int, ...], kernel: list[int], pads: list[int], strides: list[int],
                dilations: list[int]) -> tuple[list[int], list[int]]:  # fmt: skip
    """ONNX's pads ``[top, left, bottom, right]`` as TOSA's ``[top, bottom, left, right]``, with the
    bottom and right trimmed of what no output reads, and the input rows and columns to crop off
    its end where the padding is not enough: TOSA wants ``in - 1 + pads - (k - 1) d`` to divide by
    the stride exactly, where ONNX rounds the output size down."""
    out, crop = [pads[0], pads[2], pads[1], pads[3]], [0, 0]
    for axis in (0, 1):
        extent = size[axis] - 1 + out[2 * axis] + out[2 * axis + 1] - (kernel[axis] - 1) * dilations[axis]
        extra = extent % strides[axis]
        trimmed = min(extra, out[2 * axis + 1])
        out[2 * axis + 1] -= trimmed
        crop[axis] = extra - trimmed
    return out, crop


class _Lowering:
    def __init__(self, graph: ir.Graph, shapes: dict[str, tuple[int, ...]], integers: dict[str, Array]) -> None:
        self.graph = graph
        self.shapes = shapes
        self.integers = integers  # integer tensors' values (batch 1)
        self.index_inputs: dict[str, _Tensor] = {}  # the i32 arguments of indices a Gather reads, by input name
        self.ops: list[TosaOp] = []
        self.tensors: dict[str, _Tensor] = {}  # ONNX value name -> int8 tensor
        self.wide: dict[str, _Tensor] = {}  # a float sum's ONNX name -> its int32 stream
        self.constants: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self.transposed: dict[str, _Tensor] = {}  # an op's name -> the same values in the other layout
        self.indices: dict[str, tuple[str, tuple[int, ...]]] = {}  # an ArgMax's ONNX output -> its i32 result
        self.count = 0

    def add(self, kind: str, inputs: list[str], shape: tuple[int, ...], dtype: str, **attrs: Any) -> str:
        value = attrs.pop("value", None)
        name = f"%v{self.count}"
        self.count += 1
        self.ops.append(TosaOp(kind, inputs, name, tuple(int(d) for d in shape), dtype, attrs, value))
        return name

    def const(self, array: Array, dtype: str) -> str:
        """A constant; the same values twice are one op."""
        array = np.ascontiguousarray(array, {"i8": np.int8, "i32": np.int32}[dtype])
        key = (dtype, array.shape, array.tobytes())
        if key not in self.constants:
            self.constants[key] = self.add("const", [], array.shape, dtype, value=array)
        return self.constants[key]

    def zero_point(self, value: int, dtype: str = "i8") -> str:
        return self.const(np.array([value]), dtype)

    def shape_of(self, value: ir.Value) -> tuple[int, ...]:
        shape = self.shapes.get(str(value.name))
        if shape is None:
            raise TosaError(f"value '{value.name}' has no static shape (the tosa-int8 backend needs static shapes)")
        return shape

    # -------------------------------------------------------------- layouts
    def nhwc(self, t: _Tensor) -> _Tensor:
        return t if t.nhwc or len(t.shape) != 4 else self.transpose(t, [0, 2, 3, 1])

    def nchw(self, t: _Tensor) -> _Tensor:
        return self.transpose(t, [0, 3, 1, 2]) if t.nhwc else t

    def transpose(self, t: _Tensor, perms: list[int]) -> _Tensor:
        """``t`` in the other layout (once per tensor, however many readers want it)."""
        if t.name not in self.transposed:
            shape = tuple(t.shape[p] for p in perms)
            out = self.add("transpose", [t.name], shape, "i32" if t.wide else "i8", perms=perms)
            self.transposed[t.name] = _Tensor(out, shape, t.scale, t.zero_point, not t.nhwc, t.wide)
        return self.transposed[t.name]

    def cropped(self, t: _Tensor, crop: list[int]) -> _Tensor:
        """``t`` (NHWC) without its last ``crop`` rows and columns (never read by the op after it)."""
        if not any(crop):
            return t
        n, h, w, c = t.shape
        shape = (n, h - crop[0], w - crop[1], c)
        name = self.add("slice", [t.name], shape, "i8", start=[0, 0, 0, 0], size=list(shape))
        return _Tensor(name, shape, t.scale, t.zero_point, True)

    # -------------------------------------------------------------- the int8 tensor behind a float value
    def source(self, value: ir.Value | None, node: ir.Node) -> _Tensor:
        """The int8 tensor a float input of ``node`` dequantizes."""
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear" and producer.inputs[0] is not None:
            found = self.tensors.get(str(producer.inputs[0].name))
            if found is not None:  # read with the DequantizeLinear's own parameters: requant folds a
                scale, zp = _params(producer)  # constant factor into them (a HardSwish's 1/6)
                same = math.isclose(scale, found.scale, rel_tol=1e-9) and zp == found.zero_point
                return found if same else dataclasses.replace(found, scale=scale, zero_point=zp)
        name = value.name if value is not None else "?"
        raise TosaError(f"node '{_name(node)}' ({node.op_type}): input '{name}' is not a quantized tensor")

    def quantized_output(self, value: ir.Value, node: ir.Node) -> tuple[ir.Node, float, int]:
        """The single QuantizeLinear reading ``value``, with its scale and (int8) zero point."""
        uses = [u.node for u in value.uses()]
        if len(uses) == 1 and uses[0].op_type == "QuantizeLinear":
            q = uses[0]
            return q, *_params(q)
        raise TosaError(
            f"node '{_name(node)}' ({node.op_type}): its output '{value.name}' is read in float "
            f"({', '.join(sorted({u.op_type for u in uses})) or 'a graph output'}), not by one QuantizeLinear"
        )

    def rescale(self, name: str, shape: tuple[int, ...], scales: Array, input_zp: int, output_zp: int,
                dtype_in: str, why: str, dtype_out: str = "i8") -> str:  # fmt: skip
        """``name`` (``dtype_in``) times ``scales`` (one, or one per last-axis channel) to ``dtype_out``
        (int8, or int32 with a zero point of 0); ``why`` it is there, for the report. A channel
        of a scale below ``2**-32`` (a dead channel, its weights all zero) gets the multiplier 0 (and
        the shift 62, which takes any int32): no int32 value reaches half a step of its output, so it
        is the zero point either way (TOSA's shift stops at 62, for scales from ``2**-32``)."""
        pairs = [multiplier_shift(float(s)) if s >= 2.0**-32 else (0, 62) for s in np.atleast_1d(scales)]
        multipliers = self.const(np.array([m for m, _ in pairs]), "i32")
        shifts = self.const(np.array([s for _, s in pairs]), "i8")
        return self.add(
            "rescale",
            [name, multipliers, shifts, self.zero_point(input_zp, dtype_in), self.zero_point(output_zp, dtype_out)],
            shape, dtype_out, per_channel=len(pairs) > 1, scale32=True, why=why,
            scale=[float(x) for x in np.atleast_1d(scales)],
        )  # fmt: skip

    def retyped(self, t: _Tensor, scale: float, zp: int, why: str) -> _Tensor:
        """The int8 tensor ``t`` on ``scale`` and ``zp``: itself where it already is, else a
        ``tosa.rescale`` (where two quantizations meet)."""
        if math.isclose(t.scale, scale, rel_tol=1e-6) and t.zero_point == zp:
            return t
        name = self.rescale(t.name, t.shape, np.array([t.scale / scale]), t.zero_point, zp, "i8", why)
        return _Tensor(name, t.shape, scale, zp, t.nhwc)

    def clamp_after(self, name: str, shape: tuple[int, ...], node: ir.Node, scale: float, zp: int) -> str:
        """A Relu or Clip (``node``) on an int8 tensor of ``scale`` and ``zp``."""
        if node.op_type == "Relu":
            low, high = 0.0, math.inf
        else:
            low_v = constant(node.inputs[1]) if len(node.inputs) > 1 else None
            high_v = constant(node.inputs[2]) if len(node.inputs) > 2 else None
            low = float(low_v) if low_v is not None else -math.inf
            high = float(high_v) if high_v is not None else math.inf
        q_low = -128 if low == -math.inf else int(np.clip(np.rint(low / scale) + zp, -128, 127))
        q_high = 127 if high == math.inf else int(np.clip(np.rint(high / scale) + zp, -128, 127))
        return self.add("clamp", [name], shape, "i8", min_val=q_low, max_val=q_high)

    # -------------------------------------------------------------- ops
    def finish(self, node: ir.Node, name: str, shape: tuple[int, ...], nhwc: bool) -> None:
        """Record the int8 result of ``node`` under its QuantizeLinear's output name."""
        q, scale, zp = self.quantized_output(node.outputs[0], node)
        self.tensors[str(q.outputs[0].name)] = _Tensor(name, shape, scale, zp, nhwc)

    def kernel_output(
        self, node: ir.Node, acc: str, shape: tuple[int, ...], scales: Array, nhwc: bool, final: tuple[int, ...] = ()
    ) -> None:
        """An int32 accumulator of ``scales`` (per last axis) to the int8 tensor its QuantizeLinear
        asks for, through a Relu or Clip when one follows (reshaped to ``final`` when given)."""
        value = node.outputs[0]
        uses = [u.node for u in value.uses()]
        activation = uses[0] if len(uses) == 1 and uses[0].op_type in ("Relu", "Clip") else None
        q, out_scale, out_zp = self.quantized_output(activation.outputs[0] if activation else value, node)
        why = f"{node.op_type} '{_name(node)}': int32 accumulator to its int8 output"
        result = self.rescale(acc, shape, scales / out_scale, 0, out_zp, "i32", why)
        if activation is not None:
            result = self.clamp_after(result, shape, activation, out_scale, out_zp)
        if final and tuple(final) != tuple(shape):
            result, shape = self.add("reshape", [result], final, "i8", new_shape=list(final)), final
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, shape, out_scale, out_zp, nhwc)

    def conv(self, node: ir.Node) -> None:
        x = self.nhwc(self.source(node.inputs[0], node))
        w, w_scale, w_zp = _dequantized_constant(node.inputs[1], node)
        bias = _dequantized_constant(node.inputs[2], node)[0] if len(node.inputs) > 2 else None
        if w.ndim != 4 or np.any(w_zp != 0):
            raise TosaError(f"node '{_name(node)}': 2-d convs with symmetric weights are lowered, not this one")
        group = node.attributes.get_int("group", 1)
        pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
        strides = list(node.attributes.get_ints("strides", [1, 1]))
        dilations = list(node.attributes.get_ints("dilations", [1, 1]))
        if node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", ""):
            raise TosaError(f"node '{_name(node)}': auto_pad is not lowered (canonicalize writes explicit pads)")
        out_c = w.shape[0]
        n, c, h, wd = self.shape_of(node.outputs[0])
        shape = (n, h, wd, c)
        bias_q = bias.astype(np.int32) if bias is not None else np.zeros(out_c, np.int32)
        tosa_pads, crop = _exact_pads(x.shape[1:3], list(w.shape[2:]), pads, strides, dilations)
        x = self.cropped(x, crop)
        attrs = {"pad": tosa_pads, "stride": strides, "dilation": dilations}
        zps = [self.zero_point(x.zero_point), self.zero_point(0)]
        if group == 1:
            weight = self.const(w.transpose(0, 2, 3, 1), "i8")  # OIHW -> OHWI
            acc = self.add("conv2d", [x.name, weight, self.const(bias_q, "i32"), *zps], shape, "i32", **attrs,
                           node=_name(node))  # fmt: skip
        elif group == x.shape[3] and w.shape[1] == 1:
            multiplier = out_c // group
            weight = self.const(w.reshape(group, multiplier, *w.shape[2:]).transpose(2, 3, 0, 1), "i8")  # KH KW C M
            acc = self.add("depthwise_conv2d", [x.name, weight, self.const(bias_q, "i32"), *zps], shape, "i32",
                           **attrs, node=_name(node))  # fmt: skip
        else:
            raise TosaError(
                f"node '{_name(node)}': a grouped conv ({group} groups) that is not depthwise is not lowered"
            )
        scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (out_c,)) * x.scale
        self.kernel_output(node, acc, shape, scales, True)

    def conv_transpose(self, node: ir.Node) -> None:
        """A 2-d ConvTranspose as ``tosa.transpose_conv2d``: input row ``iy`` times kernel row ``ky`` adds
        to output row ``iy * stride + ky + out_pad_top``, so TOSA's ``out_pad`` is ONNX's pads negated
        (``output_padding`` added at the bottom and right), and the weight ``[I, O, KH, KW]`` becomes
        ``[O, KH, KW, I]``. TOSA's has no groups: a grouped one is one ``tosa.transpose_conv2d`` per
        group, on its slice of the input channels, concatenated in int32 (its weight's per-channel
        scales, on axis 1, are one group's output channels: every group reads them); nor dilations: a
        dilated one has its kernel spread out with zeros between the taps (the same sums)."""
        x = self.nhwc(self.source(node.inputs[0], node))
        w, w_scale, w_zp = _dequantized_constant(node.inputs[1], node)
        bias = _dequantized_constant(node.inputs[2], node)[0] if len(node.inputs) > 2 else None
        why = transposed_unlike_tosa(node)
        if w.ndim != 4 or np.any(w_zp != 0) or why:
            raise TosaError(f"node '{_name(node)}': 2-d ConvTransposes with symmetric weights are lowered, and "
                            f"tosa.transpose_conv2d has {why or 'int8 weights of zero point 0'}")  # fmt: skip
        dh, dw = node.attributes.get_ints("dilations", [1, 1])
        if (dh, dw) != (1, 1):  # tosa.transpose_conv2d has no dilation: the same kernel with zeros between its taps
            dilated = np.zeros((*w.shape[:2], (w.shape[2] - 1) * dh + 1, (w.shape[3] - 1) * dw + 1), w.dtype)
            dilated[:, :, ::dh, ::dw] = w
            w = dilated
        top, left, bottom, right = node.attributes.get_ints("pads", [0, 0, 0, 0])
        extra_h, extra_w = node.attributes.get_ints("output_padding", [0, 0])
        group = node.attributes.get_int("group", 1)
        n, c, h, wd = self.shape_of(node.outputs[0])
        shape = (n, h, wd, c)
        bias_q = bias.astype(np.int32) if bias is not None else np.zeros(c, np.int32)
        zps = [self.zero_point(x.zero_point), self.zero_point(0)]
        inputs, outputs = w.shape[0] // group, w.shape[1]  # per group
        attrs = {"out_pad": [-top, extra_h - bottom, -left, extra_w - right],
                 "stride": list(node.attributes.get_ints("strides", [1, 1])), "node": _name(node)}  # fmt: skip
        parts = []
        for g in range(group):
            part = x
            if group > 1:
                size = [*x.shape[:3], inputs]
                part = _Tensor(self.add("slice", [x.name], tuple(size), "i8", start=[0, 0, 0, g * inputs], size=size),
                               tuple(size), x.scale, x.zero_point, True)  # fmt: skip
            weight = self.const(w[g * inputs : (g + 1) * inputs].transpose(1, 2, 3, 0), "i8")  # IOHW -> OHWI
            biases = self.const(bias_q[g * outputs : (g + 1) * outputs], "i32")
            parts.append(self.add("transpose_conv2d", [part.name, weight, biases, *zps], (n, h, wd, outputs), "i32",
                                  **attrs))  # fmt: skip
        acc = parts[0] if group == 1 else self.add("concat", parts, shape, "i32", axis=3)
        scales = np.resize(np.asarray(w_scale, np.float64).reshape(-1), c) * x.scale  # repeated for every group
        self.kernel_output(node, acc, shape, scales, True)

    def gemm(self, node: ir.Node) -> None:
        x = self.nchw(self.source(node.inputs[0], node))
        w, w_scale, w_zp = _dequantized_constant(node.inputs[1], node)
        if node.attributes.get_int("transA", 0) or len(x.shape) != 2 or np.any(w_zp != 0):
            raise TosaError(f"node '{_name(node)}': a Gemm of a 2-d input (transA 0) and symmetric weights is lowered")
        if node.attributes.get_float("alpha", 1.0) != 1.0 or node.attributes.get_float("beta", 1.0) != 1.0:
            raise TosaError(f"node '{_name(node)}': a Gemm with alpha or beta other than 1 is not lowered")
        weight = w.T if node.attributes.get_int("transB", 0) else w  # [K, M]
        rows, depth = x.shape
        out = weight.shape[1]
        x3 = self.add("reshape", [x.name], (1, rows, depth), "i8", new_shape=[1, rows, depth])
        acc = self.add("matmul", [x3, self.const(weight[None], "i8"), self.zero_point(x.zero_point),
                                  self.zero_point(0)], (1, rows, out), "i32", node=_name(node))  # fmt: skip
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = _dequantized_constant(node.inputs[2], node)[0].astype(np.int32).reshape(1, 1, -1)
            acc = self.add("add", [acc, self.const(np.broadcast_to(bias, (1, 1, out)), "i32")], (1, rows, out), "i32")
        scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (out,)) * x.scale
        self.kernel_output(node, acc, (1, rows, out), scales, False, (rows, out))

    def matmul(self, node: ir.Node) -> None:
        """``tosa.matmul`` (int8 operands, their zero points, an int32 result) on 3-d views: a constant
        weight ``[K, N]`` (symmetric int8, per tensor or per column) times every row of the input; or
        two activations batch by batch (attention's products; their batch dimensions must agree). The
        int32 result is rescaled to the int8 output, per column for a per-column weight."""
        a = self.nchw(self.source(node.inputs[0], node))
        b_value = node.inputs[1]
        out = self.shape_of(node.outputs[0])
        producer = b_value.producer() if b_value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
            w, w_scale, w_zp = _dequantized_constant(b_value, node)
            if w.ndim != 2 or np.any(w_zp != 0) or w.dtype != np.int8:
                raise TosaError(
                    f"node '{_name(node)}' (MatMul): a constant weight is lowered as a symmetric int8 matrix"
                )
            rows = int(np.prod(a.shape[:-1], dtype=np.int64))
            depth, columns = w.shape
            x3 = self.reshaped(a, (1, rows, depth))
            acc = self.add("matmul", [x3, self.const(w[None], "i8"), self.zero_point(a.zero_point),
                                      self.zero_point(0)], (1, rows, columns), "i32", node=_name(node))  # fmt: skip
            scales = np.broadcast_to(np.asarray(w_scale, np.float64).reshape(-1), (columns,)) * a.scale
            self.kernel_output(node, acc, (1, rows, columns), scales, False, out)
            return
        b = self.nchw(self.source(b_value, node))
        if len(a.shape) < 2 or len(a.shape) != len(b.shape) or a.shape[:-2] != b.shape[:-2]:
            raise TosaError(f"node '{_name(node)}' (MatMul): activations {list(a.shape)} and {list(b.shape)} with "
                            "different batch dimensions are not lowered")  # fmt: skip
        batch = int(np.prod(a.shape[:-2], dtype=np.int64))
        (m, depth), n = a.shape[-2:], b.shape[-1]
        a3, b3 = self.reshaped(a, (batch, m, depth)), self.reshaped(b, (batch, depth, n))
        acc = self.add("matmul", [a3, b3, self.zero_point(a.zero_point), self.zero_point(b.zero_point)],
                       (batch, m, n), "i32", node=_name(node))  # fmt: skip
        self.kernel_output(node, acc, (batch, m, n), np.array([a.scale * b.scale]), False, out)

    def reshaped(self, t: _Tensor, shape: tuple[int, ...]) -> str:
        """``t``'s values as ``shape`` (itself when it already has it)."""
        if tuple(t.shape) == tuple(shape):
            return t.name
        return self.add("reshape", [t.name], shape, "i32" if t.wide else "i8", new_shape=list(shape))

    def same_scale(self, node: ir.Node) -> _Tensor:
        """The int8 input of an op that moves or selects values (a tensor, or a constant: an embedding
        table): its output must be quantized alike."""
        x = self.operand(node.inputs[0], node)
        _, scale, zp = self.quantized_output(node.outputs[0], node)
        if not math.isclose(scale, x.scale, rel_tol=1e-6) or zp != x.zero_point:
            raise TosaError(f"node '{_name(node)}' ({node.op_type}): its input and output are quantized differently")
        return x

    def max_pool(self, node: ir.Node) -> None:
        x = self.same_scale(node)
        x = self.nhwc(x)
        dilated = any(d != 1 for d in node.attributes.get_ints("dilations", [1, 1]))
        if node.attributes.get_int("ceil_mode", 0) or dilated:
            raise TosaError(f"node '{_name(node)}': MaxPool with ceil_mode or dilations is not lowered")
        pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
        n, c, h, w = self.shape_of(node.outputs[0])
        shape = (n, h, w, c)
        kernel = list(node.attributes.get_ints("kernel_shape"))
        strides = list(node.attributes.get_ints("strides", [1, 1]))
        tosa_pads, crop = _exact_pads(x.shape[1:3], kernel, pads, strides, [1, 1])
        x = self.cropped(x, crop)
        name = self.add("max_pool2d", [x.name], shape, "i8", kernel=kernel, stride=strides, pad=tosa_pads)
        self.finish(node, name, shape, True)

    def global_average_pool(self, node: ir.Node) -> None:
        """The mean over H and W: the int8 values (zero point removed) summed in int32 over each
        axis, then rescaled by ``input scale / (H W output scale)``."""
        x = self.nhwc(self.source(node.inputs[0], node))
        n, h, w, c = x.shape
        if h * w * 255 >= 1 << 31:
            raise TosaError(f"node '{_name(node)}': a {h}x{w} mean could overflow its int32 sum")
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        wide = self.rescale_to_i32(x, 1.0, f"GlobalAveragePool '{_name(node)}': int8 to int32, zero point removed")
        rows = self.add("reduce_sum", [wide], (n, 1, w, c), "i32", axis=1)
        total = self.add("reduce_sum", [rows], (n, 1, 1, c), "i32", axis=2)
        why = f"GlobalAveragePool '{_name(node)}': the sum over {h}x{w} positions to the int8 mean"
        result = self.rescale(total, (n, 1, 1, c), np.array([x.scale / (h * w * out_scale)]), 0, out_zp, "i32", why)
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, (n, 1, 1, c), out_scale, out_zp, True)

    def gather(self, node: ir.Node) -> None:
        """A Gather of int8 values at indices known once the shapes are static: ``tosa.gather`` on
        the values as ``[outer, K, inner]`` with the indices repeated for each outer row; or at the
        indices of an input (:meth:`lookup`)."""
        if node.inputs[1] is not None and str(node.inputs[1].name) in self.index_inputs:
            self.lookup(node)
            return
        x = self.same_scale(node)
        x = self.nchw(x)
        indices = self.known(node.inputs[1])
        if indices is None:
            raise TosaError(f"node '{_name(node)}' (Gather): its indices are not known when the shapes are static")
        axis = node.attributes.get_int("axis", 0) % len(x.shape)
        outer, size = int(np.prod(x.shape[:axis], dtype=np.int64)), x.shape[axis]
        inner = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
        flat = np.asarray(indices, np.int64).reshape(-1) % size
        values = self.add("reshape", [x.name], (outer, size, inner), "i8", new_shape=[outer, size, inner])
        table = self.const(np.tile(flat, (outer, 1)), "i32")
        picked = self.add("gather", [values, table], (outer, len(flat), inner), "i8")
        shape = self.shape_of(node.outputs[0])
        self.finish(node, self.add("reshape", [picked], shape, "i8", new_shape=list(shape)), shape, False)

    def lookup(self, node: ir.Node) -> None:
        """An embedding: rows of a constant int8 table (``[K, C]``, axis 0) at the indices the host gives
        (an i32 input: token ids), one ``tosa.gather`` of the table as ``[1, K, C]``."""
        table = self.operand(node.inputs[0], node)
        if len(table.shape) != 2 or node.attributes.get_int("axis", 0) != 0:
            raise TosaError(f"node '{_name(node)}' (Gather): rows of a 2-d table at an input's indices are lowered, "
                            f"not axis {node.attributes.get_int('axis', 0)} of {list(table.shape)}")  # fmt: skip
        ids = self.index_inputs[str(node.inputs[1].name)]  # type: ignore[union-attr]
        count = int(np.prod(ids.shape, dtype=np.int64))
        rows, width = table.shape
        values = self.add("reshape", [table.name], (1, rows, width), "i8", new_shape=[1, rows, width])
        flat = self.add("reshape", [ids.name], (1, count), "i32", new_shape=[1, count])
        picked = self.add("gather", [values, flat], (1, count, width), "i8")
        shape = self.shape_of(node.outputs[0])
        q, scale, zp = self.quantized_output(node.outputs[0], node)
        if not math.isclose(scale, table.scale, rel_tol=1e-6) or zp != table.zero_point:
            raise TosaError(f"node '{_name(node)}' (Gather): its table and its rows are quantized differently")
        self.tensors[str(q.outputs[0].name)] = _Tensor(
            self.add("reshape", [picked], shape, "i8", new_shape=list(shape)), shape, scale, zp
        )

    def identity(self, node: ir.Node) -> None:
        """An Identity moves its int8 values; one propagation inserted (``RESCALE_KEY``: where an op
        bound to one type got two, :mod:`requant.calibration.propagate`) is a ``tosa.rescale`` to its
        output's type, for the reason it records."""
        why = node.metadata_props.get(RESCALE_KEY)
        if why is None:
            x = self.same_scale(node)
            self.finish(node, x.name, x.shape, x.nhwc)
            return
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        t = self.retyped(self.source(node.inputs[0], node), out_scale, out_zp, why)
        self.tensors[str(q.outputs[0].name)] = t

    def reshape(self, node: ir.Node) -> None:
        x = self.same_scale(node)
        x = self.nchw(x)
        shape = self.shape_of(node.outputs[0])
        self.finish(node, self.add("reshape", [x.name], shape, "i8", new_shape=list(shape)), shape, False)

    def transpose_op(self, node: ir.Node) -> None:
        """A Transpose of int8 values (ONNX's axes, on the tensor as NCHW), quantized alike before and after."""
        x = self.nchw(self.same_scale(node))
        perm = list(node.attributes.get_ints("perm", list(range(len(x.shape)))[::-1]))
        shape = tuple(x.shape[p] for p in perm)
        self.finish(node, self.add("transpose", [x.name], shape, "i8", perms=perm), shape, False)

    def pad(self, node: ir.Node) -> None:
        """A constant Pad of int8 values as ``tosa.pad`` (a batch of one padded as 3-d: mlir-opt 22's level
        check counts a 4-d padding's 8 numbers as a rank above 6). Both forms requant writes: padding
        the integers with the zero point (the int8 input is the QuantizeLinear's output), or a float Pad
        between conversions of one type (its value quantized)."""
        source = node.inputs[0]
        x = self.tensors.get(str(source.name)) if source is not None else None
        integer = x is not None
        if x is None:
            x = self.same_scale(node)
        if node.attributes.get_string("mode", "constant") != "constant" or (len(node.inputs) > 3 and node.inputs[3]):
            raise TosaError(f"node '{_name(node)}' (Pad): a constant pad of every axis is lowered, not this one")
        pads = self.known(node.inputs[1]) if len(node.inputs) > 1 else None
        if pads is None:
            raise TosaError(f"node '{_name(node)}' (Pad): its pads are not known when the shapes are static")
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
            view = _Tensor(self.reshaped(x, x.shape[1:]), x.shape[1:], x.scale, x.zero_point, x.nhwc)
            before, after, padded = before[1:], after[1:], shape[1:]
        padding = [int(v) for pair in zip(before, after, strict=True) for v in pair]
        name = self.add("pad", [view.name, self.zero_point(fill)], padded, "i8", padding=padding)
        if padded != shape:
            name = self.add("reshape", [name], shape, "i8", new_shape=list(shape))
        result = _Tensor(name, shape, x.scale, x.zero_point, x.nhwc)
        if integer:
            self.tensors[str(node.outputs[0].name)] = result
        else:
            self.finish(node, name, shape, x.nhwc)

    def resize(self, node: ir.Node) -> None:
        """Nearest-neighbour upsampling by whole factors (every output pixel a copy of
        ``input[out // factor]``: what ONNX's asymmetric/floor and half-pixel nearest modes compute
        then) as ``tosa.resize``: scale ``2 f / 2`` with offset ``-f``, so TOSA's rounding to the
        nearest source lands on the floor (``tosa.resize`` rounds half up)."""
        mode = node.attributes.get_string("mode", "nearest")
        if mode == "linear":
            self.resize_bilinear(node)
            return
        _, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"Resize '{_name(node)}': its input to the output's scale and zero point"
        x = self.retyped(self.nhwc(self.source(node.inputs[0], node)), out_scale, out_zp, why)
        transform = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
        rounding = node.attributes.get_string("nearest_mode", "round_prefer_floor")
        n, c, oh, ow = self.shape_of(node.outputs[0])
        _, ih, iw, _ = x.shape
        whole = oh % ih == 0 and ow % iw == 0 and n == x.shape[0] and c == x.shape[3]
        floor = transform in ("half_pixel", "pytorch_half_pixel") or (transform == "asymmetric" and rounding == "floor")
        if mode != "nearest" or not whole or not floor:
            raise TosaError(f"node '{_name(node)}' (Resize): nearest upsampling of H and W by whole factors is "
                            f"lowered, not {mode} ({transform}, {rounding}) from {ih}x{iw} to {oh}x{ow}")  # fmt: skip
        fy, fx = oh // ih, ow // iw
        scale = [2 * fy, 2, 2 * fx, 2]
        offset = [-fy, -fx]
        border = [(oh - 1) * 2 - (ih - 1) * 2 * fy - fy, (ow - 1) * 2 - (iw - 1) * 2 * fx - fx]
        shape = (n, oh, ow, c)
        name = self.add("resize", [x.name], shape, "i8", scale=scale, offset=offset, border=border)
        self.finish(node, name, shape, True)

    def resize_bilinear(self, node: ir.Node) -> None:
        """Bilinear upsampling of H and W as ``tosa.resize``: each output the sum of its four source
        values weighted in whole units (the weights of an axis add up to its ``scale_n``), in int32;
        the zero point taken out by one add (``zp * scale_y_n * scale_x_n``), then rescaled to the
        output's int8. ``half_pixel`` (and ``pytorch_half_pixel``) and ``asymmetric`` by whole
        factors, ``align_corners`` by any; TOSA clamps the source rows and columns at the edges as
        ONNX does."""
        x = self.nhwc(self.source(node.inputs[0], node))
        transform = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
        n, c, oh, ow = self.shape_of(node.outputs[0])
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
                raise TosaError(f"node '{_name(node)}' (Resize): linear upsampling ({transform}) from {ih}x{iw} to "
                                f"{oh}x{ow} is not lowered (whole factors; align_corners any)")  # fmt: skip
        if max(scale[0], scale[2]) > 1 << 11:
            raise TosaError(f"node '{_name(node)}' (Resize): TOSA's bilinear scale is at most 2048, not {scale}")
        border = [(oh - 1) * scale[1] - (ih - 1) * scale[0] + offset[0],
                  (ow - 1) * scale[3] - (iw - 1) * scale[2] + offset[1]]  # fmt: skip
        shape = (n, oh, ow, c)
        units = scale[0] * scale[2]
        sums = self.add("resize", [x.name], shape, "i32", scale=scale, offset=offset, border=border, mode="BILINEAR")
        if x.zero_point:
            sums = self.add("add", [sums, self.const(np.full((1, 1, 1, 1), -x.zero_point * units), "i32")], shape,
                            "i32")  # fmt: skip
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"Resize '{_name(node)}': the bilinear sums (in 1/{units} units) to the int8 output"
        result = self.rescale(sums, shape, np.array([x.scale / (units * out_scale)]), 0, out_zp, "i32", why)
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, shape, out_scale, out_zp, True)

    def slice_op(self, node: ir.Node) -> None:
        """A Slice of int8 values (static starts, ends, axes and positive steps) as ``tosa.slice``; an
        axis taken every ``k``-th element (YOLOX's Focus stem, ``x[..., ::2, ::2]``) is first viewed as
        ``[size / k, k]`` (TOSA's slice has no step), sliced on both, and merged back."""
        x = self.nchw(self.same_scale(node))
        known = [self.known(v) for v in node.inputs[1:5]]
        starts, ends = known[0], known[1]
        if starts is None or ends is None:
            raise TosaError(f"node '{_name(node)}' (Slice): its starts and ends are not known for static shapes")
        rank = len(x.shape)
        axes = known[2] if len(known) > 2 and known[2] is not None else np.arange(len(starts))
        steps = known[3] if len(known) > 3 and known[3] is not None else np.ones(len(starts), np.int64)
        name, shape = x.name, list(x.shape)
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            axis, size, step = int(axis) % rank, shape[int(axis) % rank], int(step)
            first, stop, _ = slice(int(start), int(end), step).indices(size)
            count = len(range(first, stop, step))
            if step < 1 or count == 0 or (step > 1 and size % step):
                raise TosaError(f"node '{_name(node)}' (Slice): step {step} on an axis of {size} is not lowered")
            if step == 1:
                begin, sizes = [0] * rank, list(shape)
                begin[axis], sizes[axis] = first, count
                name = self.add("slice", [name], tuple(sizes), "i8", start=begin, size=sizes)
                shape = sizes
                continue
            view = [*shape[:axis], size // step, step, *shape[axis + 1 :]]
            name = self.add("reshape", [name], tuple(view), "i8", new_shape=view)
            begin, sizes = [0] * (rank + 1), list(view)
            begin[axis], sizes[axis] = first // step, count
            begin[axis + 1], sizes[axis + 1] = first % step, 1
            name = self.add("slice", [name], tuple(sizes), "i8", start=begin, size=sizes)
            shape = [*shape[:axis], count, *shape[axis + 1 :]]
            name = self.add("reshape", [name], tuple(shape), "i8", new_shape=list(shape))
        self.finish(node, name, tuple(shape), False)

    def known(self, value: ir.Value | None) -> Array | None:
        """An integer input's values (flat): a constant, or what the model computes once the shapes are
        static; None when neither."""
        if value is None:
            return None
        data = constant(value)
        if data is None:
            data = self.integers.get(str(value.name))
        return None if data is None else np.asarray(data, np.int64).reshape(-1)

    def clamp(self, node: ir.Node) -> None:
        x = self.same_scale(node)
        self.finish(node, self.clamp_after(x.name, x.shape, node, x.scale, x.zero_point), x.shape, x.nhwc)

    def concat(self, node: ir.Node) -> None:
        """``tosa.concat`` of int8 tensors, each first rescaled to the output's scale and zero point
        where its own differ (a concat's inputs rarely share one: the rescale is where they meet)."""
        parts = [self.source(v, node) for v in node.inputs if v is not None]
        nhwc = all(t.nhwc for t in parts)
        parts = [self.nhwc(t) if nhwc else self.nchw(t) for t in parts]
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        rank = len(parts[0].shape)
        axis = node.attributes.get_int("axis", 0) % rank
        if nhwc:
            axis = [0, 2, 3, 1].index(axis)
        names = []
        for value, t in zip((v for v in node.inputs if v is not None), parts, strict=True):
            why = f"Concat '{_name(node)}': input '{value.name}' to the output's scale and zero point"
            names.append(self.retyped(t, out_scale, out_zp, why).name)
        shape = list(parts[0].shape)
        shape[axis] = sum(t.shape[axis] for t in parts)
        name = self.add("concat", names, tuple(shape), "i8", axis=axis)
        self.tensors[str(q.outputs[0].name)] = _Tensor(name, tuple(shape), out_scale, out_zp, nhwc)

    def average_pool(self, node: ir.Node) -> None:
        """A mean over each window as a depthwise conv with weights 1 (int32 sums, the zero point
        removed) rescaled by ``1 / window``: exact where every window counts the same (no padding, or
        padding counted). Where padding is not counted (the windows at the edges average fewer values),
        ``tosa.avg_pool2d``, which counts only the input's values, as ONNX does then."""
        x = self.nhwc(self.source(node.inputs[0], node))
        pads = list(node.attributes.get_ints("pads", [0, 0, 0, 0]))
        counted, ceil = (bool(node.attributes.get_int(a, 0)) for a in ("count_include_pad", "ceil_mode"))
        if not counted and (any(pads) or ceil):
            self.average_pool_uncounted(node, x, pads)
            return
        if ceil:
            raise TosaError(f"node '{_name(node)}': AveragePool with ceil_mode and counted padding is not lowered")
        kernel = list(node.attributes.get_ints("kernel_shape"))
        strides = list(node.attributes.get_ints("strides", [1, 1]))
        tosa_pads, crop = _exact_pads(x.shape[1:3], kernel, pads, strides, [1, 1])
        x = self.cropped(x, crop)
        n, c, h, w = self.shape_of(node.outputs[0])
        ones = self.const(np.ones((*kernel, c, 1)), "i8")
        zeros = [self.const(np.zeros(c), "i32"), self.zero_point(x.zero_point), self.zero_point(0)]
        sums = self.add("depthwise_conv2d", [x.name, ones, *zeros], (n, h, w, c), "i32", pad=tosa_pads,
                        stride=strides, dilation=[1, 1], node=_name(node))  # fmt: skip
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"AveragePool '{_name(node)}': the sum over {kernel[0]}x{kernel[1]} positions to the int8 mean"
        result = self.rescale(sums, (n, h, w, c), np.array([x.scale / (kernel[0] * kernel[1] * out_scale)]), 0, out_zp,
                              "i32", why)  # fmt: skip
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, (n, h, w, c), out_scale, out_zp, True)

    def average_pool_uncounted(self, node: ir.Node, x: _Tensor, pads: list[int]) -> None:
        """``tosa.avg_pool2d``: each window's input values (zero point removed) summed in int32 and
        divided by how many there are (TOSA's ``reciprocal_scale``, rounded), on the input's scale;
        then a rescale to the output's, where the QuantizeLinear after the pool asks for another. The
        bottom and right padding are what make TOSA's output size exact (a ``ceil_mode`` window past
        the input counts no more than its values)."""
        kernel = list(node.attributes.get_ints("kernel_shape"))
        strides = list(node.attributes.get_ints("strides", [1, 1]))
        if any(d != 1 for d in node.attributes.get_ints("dilations", [1, 1])):
            raise TosaError(f"node '{_name(node)}': AveragePool with dilations is not lowered")
        n, c, h, w = self.shape_of(node.outputs[0])
        tosa_pads, crop = [pads[0], 0, pads[1], 0], [0, 0]
        for axis, out in ((0, h), (1, w)):  # the end padding TOSA's size formula needs, or rows to crop
            end = (out - 1) * strides[axis] + kernel[axis] - x.shape[1 + axis] - pads[axis]
            tosa_pads[2 * axis + 1], crop[axis] = max(end, 0), max(-end, 0)
        if any(p >= k for p, k in zip(tosa_pads, (kernel[0], kernel[0], kernel[1], kernel[1]), strict=True)):
            raise TosaError(
                f"node '{_name(node)}': AveragePool padding {tosa_pads} reaches a whole window (TOSA: pad < kernel)"
            )
        x = self.cropped(x, crop)
        shape = (n, h, w, c)
        pooled = self.add("avg_pool2d", [x.name, self.zero_point(x.zero_point), self.zero_point(x.zero_point)], shape,
                          "i8", kernel=kernel, stride=strides, pad=tosa_pads)  # fmt: skip
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        if not math.isclose(out_scale, x.scale, rel_tol=1e-6) or out_zp != x.zero_point:
            why = f"AveragePool '{_name(node)}': the mean (on the input's scale) to the output's scale and zero point"
            pooled = self.rescale(pooled, shape, np.array([x.scale / out_scale]), x.zero_point, out_zp, "i8", why)
        self.tensors[str(q.outputs[0].name)] = _Tensor(pooled, shape, out_scale, out_zp, True)

    def argmax(self, node: ir.Node) -> None:
        """``tosa.argmax`` of the int8 values (the first largest, as ONNX's default): the same index as
        on the dequantized values, whatever the scale; its i32 result is one of the function's results
        (an ArgMax read by other ops is not lowered). Over NHWC channels without a transpose."""
        x = self.source(node.inputs[0], node)
        if node.attributes.get_int("select_last_index", 0):
            raise TosaError(f"node '{_name(node)}': ArgMax with select_last_index (TOSA's argmax takes the first)")
        axis = node.attributes.get_int("axis", 0) % len(x.shape)
        if x.nhwc and axis == 1:
            axis = 3  # channels, last in NHWC: the other axes keep ONNX's order
        else:
            x = self.nchw(x)
        shape = tuple(d for i, d in enumerate(x.shape) if i != axis)
        name = self.add("argmax", [x.name], shape, "i32", axis=axis)
        wanted = self.shape_of(node.outputs[0])  # keepdims: the axis kept, of size 1
        if wanted != shape:
            name = self.add("reshape", [name], wanted, "i32", new_shape=list(wanted))
        self.indices[str(node.outputs[0].name)] = (name, wanted)

    def table(self, node: ir.Node) -> None:
        """A unary op on int8 values as ``tosa.table``: its 256 results, each the op on the dequantized
        input then quantized (half to even) as the QuantizeLinear after it says: what ONNX Runtime
        computes for the QDQ model, and how it runs QLinearSigmoid itself."""
        x = self.source(node.inputs[0], node)
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        real = (np.arange(-128, 128, dtype=np.float64) - x.zero_point) * x.scale
        with np.errstate(over="ignore"):
            y = UNARY[node.op_type](real.astype(np.float32), node).astype(np.float64)
        values = np.clip(np.rint(y / out_scale) + out_zp, -128, 127).astype(np.int8)
        name = self.add("table", [x.name, self.const(values, "i8")], x.shape, "i8")
        self.tensors[str(q.outputs[0].name)] = _Tensor(name, x.shape, out_scale, out_zp, x.nhwc)

    def softmax(self, node: ir.Node) -> None:
        """Softmax of int8 values along an axis, in integers (TOSA 1.0's int profile, no int16). With
        ``d = q - max(q)`` (in ``[-255, 0]``: the zero point gone), ``E(d) = T exp(scale d)`` (``T`` <
        ``2**21``) is three int8 ``tosa.table`` lookups of ``d + 127``, 7 bits of ``E`` each, put together
        by rescales (``* 2**14``, ``* 2**7``) and adds; its row sum, shifted right by ``s`` bits, divides
        ``2**30`` once per row (``tosa.intdiv``); a ``tosa.mul`` with a shift of ``8 + s`` gives each
        value's share of its row times ``2**22``, which a rescale takes to the int8 output. ``T`` keeps
        the row sum in int32; ``s`` balances the two truncations (the divisor's and the quotient's): a
        share is off by about ``2**-12`` of itself at most, against an output step of ``1/256`` or more."""
        x = self.nchw(self.source(node.inputs[0], node))
        rank = len(x.shape)
        opset = self.graph.opset_imports.get("", 13)
        axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1) % rank
        if opset < 13 and axis != rank - 1:
            raise TosaError(f"node '{_name(node)}' (Softmax): before opset 13 only the last axis is lowered")
        n = x.shape[axis]
        top_value = min(2**21 - 1, (2**31 - 1) // n)
        if top_value < 2**12:
            raise TosaError(f"node '{_name(node)}' (Softmax): {n} values along its axis leave int32 in their sum")
        bits = math.log2(top_value)
        shift = int(np.clip(round(bits + (math.log2(n) - 29) / 2), 0, math.floor(bits)))
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"Softmax '{_name(node)}'"
        reduced = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
        values = self.rescale_to_i32(x, 1.0, why + ": its input to int32, zero point removed")
        top = self.add("reduce_max", [values], reduced, "i32", axis=axis)
        below = self.add("sub", [values, top], x.shape, "i32")  # d, in [-255, 0]
        index = self.rescale(below, x.shape, np.array([1.0]), 0, 127, "i32", why + ": d + 127, the tables' index")
        exp = np.rint(top_value * np.exp(x.scale * np.arange(-255.0, 1.0))).astype(np.int64)  # E(d), d = -255..0
        parts = []
        for low_bit in (14, 7, 0):  # E = hi 2**14 + mid 2**7 + lo, each in [0, 127]
            table = self.add("table", [index, self.const(exp >> low_bit & 127, "i8")], x.shape, "i8")
            parts.append(self.rescale_to_i32(_Tensor(table, x.shape, 1.0, 0), 2.0**low_bit, why + ": 7 bits of exp"))
        e = self.add("add", [self.add("add", parts[:2], x.shape, "i32"), parts[2]], x.shape, "i32")
        total = self.add("reduce_sum", [e], reduced, "i32", axis=axis)
        divisor = self.rescale(total, reduced, np.array([2.0**-shift]), 0, 0, "i32", why + ": the row sum, shifted",
                               dtype_out="i32")  # fmt: skip
        inverse = self.add("intdiv", [self.const(np.full((1,) * rank, 2**30), "i32"), divisor], reduced, "i32")
        share = self.add("mul", [e, inverse, self.const(np.array([8 + shift]), "i8")], x.shape, "i32")
        result = self.rescale(share, x.shape, np.array([2.0**-22 / out_scale]), 0, out_zp, "i32",
                              why + ": each value's share of its row to the int8 output")  # fmt: skip
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, x.shape, out_scale, out_zp)

    def layer_norm(self, node: ir.Node) -> None:
        """LayerNormalization over the last axis, in integers (:meth:`normalized`, centred): the
        normalized value times ``sqrt(n) 2**s``; a rescale per channel by ``|gamma|`` (its sign a
        ``tosa.mul``), ``beta`` added 2**8 finer, a rescale to the int8 output."""
        x = self.nchw(self.source(node.inputs[0], node))
        rank = len(x.shape)
        axis = node.attributes.get_int("axis", -1) % rank
        if axis != rank - 1:
            raise TosaError(f"node '{_name(node)}' (LayerNormalization): only the last axis is lowered, not {axis}")
        n = x.shape[axis]
        gamma = _constant_value(node.inputs[1], node) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        beta = _constant_value(node.inputs[2], node) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if gamma is None:
            raise TosaError(f"node '{_name(node)}' (LayerNormalization): its scale is not a constant")
        gamma = np.broadcast_to(np.asarray(gamma, np.float64).reshape(-1), (n,))
        beta = np.zeros(n) if beta is None else np.broadcast_to(np.asarray(beta, np.float64).reshape(-1), (n,))
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"LayerNormalization '{_name(node)}'"
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        unit, step = self.normalized(node, x, why, epsilon * n / x.scale**2, centred=True)
        ones = (1,) * rank
        signs = np.where(gamma < 0, -1, 1).reshape((*ones[:-1], n))
        unit = self.add("mul", [unit, self.const(signs, "i32"), self.const(np.zeros(1), "i8")], x.shape, "i32")
        fine = 256.0 / out_scale
        scaled = self.rescale(unit, x.shape, np.abs(gamma) * step * fine, 0, 0, "i32",
                              why + ": times gamma, 2**8 finer than its output", dtype_out="i32")  # fmt: skip
        offset = self.const(np.rint(beta * fine).astype(np.int64).reshape((*ones[:-1], n)), "i32")
        total = self.add("add", [scaled, offset], x.shape, "i32")
        result = self.rescale(total, x.shape, np.array([1 / 256]), 0, out_zp, "i32", why + ": to its int8 output")
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, x.shape, out_scale, out_zp)

    def l2_normalize(self, node: ir.Node) -> None:
        """LpNormalization with ``p`` 2 over the last axis (a sentence embedding's, fused from ReduceL2,
        Clip, Expand, Div by the target's pass), in integers (:meth:`normalized`, not centred): each
        value over the row's root sum of squares, times ``2**s``, rescaled to the int8 output."""
        x = self.nchw(self.source(node.inputs[0], node))
        rank = len(x.shape)
        if node.attributes.get_int("axis", -1) % rank != rank - 1 or node.attributes.get_int("p", 2) != 2:
            raise TosaError(f"node '{_name(node)}' (LpNormalization): p 2 over the last axis is lowered")
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"LpNormalization '{_name(node)}'"
        unit, step = self.normalized(node, x, why, 0.0, centred=False)
        scale = np.array([step / out_scale])
        result = self.rescale(unit, x.shape, scale, 0, out_zp, "i32", f"{why}: to its int8 output")
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, x.shape, out_scale, out_zp)

    def normalized(self, node: ir.Node, x: _Tensor, why: str, epsilon: float, centred: bool) -> tuple[str, float]:
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
            raise TosaError(f"node '{_name(node)}' ({node.op_type}): rows of {n} values (46,340 at most)")
        reduced = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
        ones, no_shift = (1,) * rank, self.const(np.zeros(1), "i8")

        def op(kind: str, *args: str, shape: tuple[int, ...] = reduced) -> str:
            return self.add(kind, list(args) + ([no_shift] if kind == "mul" else []), shape, "i32")

        def number(value: int) -> str:
            return self.const(np.full(ones, value), "i32")

        values = self.rescale_to_i32(x, 1.0, why + ": its input to int32, zero point removed")
        total = self.add("reduce_sum", [values], reduced, "i32", axis=axis) if centred else ""
        squares = self.add("reduce_sum", [op("mul", values, values, shape=x.shape)], reduced, "i32", axis=axis)
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
        root = self.const(np.full(reduced, 46341), "i32")  # >= sqrt(2**31): Newton from above
        for _ in range(6):
            root = op("intdiv", op("add", root, op("intdiv", normal, root)), number(2))
        centre = op("sub", op("mul", values, number(n), shape=x.shape), total, shape=x.shape) if centred else values
        moved = op("logical_left_shift", centre, op("add", half, number(shift + j)), shape=x.shape)
        unit = op("intdiv", moved, root, shape=x.shape)
        return unit, 1.0 / ((math.sqrt(n) if centred else 1.0) * 2.0**shift)

    def mul(self, node: ir.Node) -> None:
        """A product of two int8 tensors (or one and an int8 constant), broadcast as ONNX does: both
        to int32 with their zero points removed, ``tosa.mul``, rescaled to the output."""
        rank = max(len(self.shape_of(v)) for v in node.inputs[:2] if v is not None)
        a, b = (self.operand(v, node, rank) for v in node.inputs[:2])
        if len(a.shape) == len(b.shape) == 4 and a.nhwc != b.nhwc:
            a, b = self.nhwc(a), self.nhwc(b)
        if len(a.shape) != len(b.shape):
            raise TosaError(f"node '{_name(node)}' (Mul): operands of ranks {len(a.shape)} and {len(b.shape)}")
        shape = tuple(int(d) for d in np.broadcast_shapes(a.shape, b.shape))
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        why = f"Mul '{_name(node)}': an input to int32, zero point removed"
        wide = [self.rescale_to_i32(t, 1.0, why) for t in (a, b)]
        product = self.add("mul", [*wide, self.const(np.zeros(1), "i8")], shape, "i32")
        why = f"Mul '{_name(node)}': the int32 product to its int8 output"
        result = self.rescale(product, shape, np.array([a.scale * b.scale / out_scale]), 0, out_zp, "i32", why)
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, shape, out_scale, out_zp, a.nhwc or b.nhwc)

    def operand(self, value: ir.Value | None, node: ir.Node, rank: int = 0) -> _Tensor:
        """An int8 tensor, or a dequantized int8 constant made one, its dimensions padded in front to
        ``rank`` (ONNX broadcasts a per-channel ``[C, 1, 1]`` against ``[N, C, H, W]``; TOSA wants equal
        ranks)."""
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
            data, scale, zp = _dequantized_constant(value, node)
            if data.dtype not in (np.int8, np.uint8) or scale.size != 1:
                raise TosaError(f"node '{_name(node)}': a per-tensor 8-bit constant operand is lowered, not this one")
            shift = 128 if data.dtype == np.uint8 else 0
            values = (data.astype(np.int16) - shift).astype(np.int8)
            values = values.reshape((1,) * max(0, rank - values.ndim) + values.shape)
            return _Tensor(self.const(values, "i8"), values.shape, float(scale), int(zp) - shift)
        return self.source(value, node)

    def add_op(self, node: ir.Node) -> None:
        """A sum of two tensors, int8 or int32 streams, on a common int32 scale. Rounded to int8 when
        one QuantizeLinear is all that reads it; otherwise (a residual connection, which requant
        keeps float on ONNX Runtime) it stays an int32 stream: each QuantizeLinear reading it gets
        its own rescale to int8, and the next sum reads the stream. A tensor plus a constant:
        :meth:`add_constant`."""
        values = [v for v in node.inputs[:2] if v is not None]
        fixed = [_constant_value(v, node) for v in values]
        if any(c is not None for c in fixed):
            tensor, addend = (values[1], fixed[0]) if fixed[0] is not None else (values[0], fixed[1])
            self.add_constant(node, tensor, addend)
            return
        self.sum_to_readers(node, self.two_tensors(node, "add"))

    def sub_op(self, node: ir.Node) -> None:
        """A difference of two tensors (a LayerNorm written out: ``x - mean``), broadcast, on a common
        int32 scale as a sum is (``tosa.sub``), then rescaled to its int8 output. A tensor minus a
        constant is an Add (the target's decomposition); a constant minus a tensor is not lowered."""
        if any(_constant_value(v, node) is not None for v in node.inputs[:2] if v is not None):
            raise TosaError(f"node '{_name(node)}' (Sub): a constant minus a tensor is not lowered")
        self.sum_to_readers(node, self.two_tensors(node, "sub"))

    def two_tensors(self, node: ir.Node, kind: str) -> _Tensor:
        """``tosa.add`` or ``tosa.sub`` of ``node``'s two tensors (int8, or int32 streams), broadcast (of
        one rank), on one int32 scale: a stream's, or 2**16 times finer than the coarser int8 input."""
        a, b = (self.wide.get(str(v.name)) or self.source(v, node) for v in node.inputs[:2] if v is not None)
        if a.nhwc != b.nhwc or a.shape != b.shape:  # one layout for both (a square map hides the difference)
            a, b = self.nhwc(a), self.nhwc(b)
        try:
            shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        except ValueError:
            shape = ()
        if not shape or len(a.shape) != len(b.shape) or a.nhwc != b.nhwc:
            raise TosaError(f"node '{_name(node)}' ({node.op_type}): tensors of shapes {list(a.shape)} and "
                            f"{list(b.shape)} do not broadcast in one rank")  # fmt: skip
        streams = [t for t in (a, b) if t.wide]
        common = streams[0].scale if streams else max(a.scale, b.scale) / (1 << STREAM_BITS)
        result = "sum" if kind == "add" else "difference"
        why = f"{node.op_type} '{_name(node)}': an input to the {result}'s int32 scale"
        parts = [self.rescale_to_i32(t, t.scale / common, why) for t in (a, b)]
        return _Tensor(self.add(kind, parts, shape, "i32"), shape, common, 0, a.nhwc, True)

    def reduce(self, node: ir.Node) -> None:
        """ReduceMean and ReduceSum: the int8 values (zero point removed) summed in int32 along each
        axis (``tosa.reduce_sum``), rescaled by ``1 / count`` for a mean to the int8 output;
        ReduceMax: ``tosa.reduce_max`` of the int8 values (one type in and out). Axes of ONNX's
        layout; without ``keepdims`` a ``tosa.reshape`` drops them."""
        largest = node.op_type == "ReduceMax"
        x = self.nchw(self.same_scale(node) if largest else self.source(node.inputs[0], node))
        axes = self.reduce_axes(node, len(x.shape))
        final = self.shape_of(node.outputs[0])
        why = f"{node.op_type} '{_name(node)}'"
        name, dtype = (x.name, "i8") if largest else (self.rescale_to_i32(x, 1.0, why + ": its input to int32, zero "
                                                                          "point removed"), "i32")  # fmt: skip
        for axis in axes:  # one axis at a time, each kept
            shape = tuple(1 if i in axes and i <= axis else d for i, d in enumerate(x.shape))
            name = self.add("reduce_max" if largest else "reduce_sum", [name], shape, dtype, axis=axis)
        if largest:
            if final != shape:
                name = self.add("reshape", [name], final, "i8", new_shape=list(final))
            self.finish(node, name, final, False)
            return
        count = int(np.prod([x.shape[i] for i in axes])) if node.op_type == "ReduceMean" else 1
        q, out_scale, out_zp = self.quantized_output(node.outputs[0], node)
        what = f"the sum over {count} values to the int8 mean" if count > 1 else "the int32 sum to its int8 output"
        result = self.rescale(name, shape, np.array([x.scale / (count * out_scale)]), 0, out_zp, "i32",
                              f"{why}: {what}")  # fmt: skip
        if final != shape:
            result = self.add("reshape", [result], final, "i8", new_shape=list(final))
        self.tensors[str(q.outputs[0].name)] = _Tensor(result, final, out_scale, out_zp, False)

    def reduce_axes(self, node: ir.Node, rank: int) -> list[int]:
        """A Reduce op's axes (its attribute, or its second input from opset 18, 13 for ReduceSum),
        sorted and non-negative; every axis when none are given."""
        given = node.inputs[1] if len(node.inputs) > 1 else None
        axes = self.known(given) if given is not None else None
        if given is not None and axes is None:
            raise TosaError(f"node '{_name(node)}' ({node.op_type}): its axes are not known when the shapes are static")
        if axes is None:
            attribute = node.attributes.get("axes")
            axes = np.asarray(attribute.as_ints() if attribute is not None else [], np.int64)
        if len(axes) == 0:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                raise TosaError(f"node '{_name(node)}' ({node.op_type}): a reduction over no axes is not lowered")
            return list(range(rank))
        return sorted({int(a) % rank for a in axes})

    def add_constant(self, node: ir.Node, value: ir.Value, addend: Array | None) -> None:
        """A tensor plus a float constant that broadcasts to it (a number: a HardSwish written out; per
        channel: a batch norm's shift): the tensor to int32 on a scale 2**16 times finer (coarser where
        the constant would not fit in 2**30 steps), the constant rounded to that scale."""
        t = self.wide.get(str(value.name)) or self.source(value, node)
        rank = len(self.shape_of(value))
        if addend is None or np.ndim(addend) > rank or not np.isfinite(addend).all():
            raise TosaError(f"node '{_name(node)}' (Add): a tensor plus a finite constant is lowered, not this one")
        c = np.asarray(addend, np.float64).reshape((1,) * (rank - np.ndim(addend)) + np.shape(addend))
        if t.nhwc:
            c = c.transpose(0, 2, 3, 1)
        try:
            np.broadcast_shapes(c.shape, t.shape)
        except ValueError:
            raise TosaError(f"node '{_name(node)}' (Add): its constant {list(np.shape(addend))} does not broadcast "
                            f"to the tensor") from None  # fmt: skip
        largest = float(np.abs(c).max(initial=0.0))
        common = t.scale if t.wide else max(t.scale / (1 << STREAM_BITS), largest / (1 << 30))
        steps = np.rint(c / common)
        if np.abs(steps).max(initial=0) >= 1 << 31:
            raise TosaError(f"node '{_name(node)}' (Add): {largest} is beyond the int32 range of the sum's scale")
        why = f"Add '{_name(node)}': the tensor to the int32 scale of its sum with a constant"
        part = self.rescale_to_i32(t, t.scale / common, why)
        shifted = self.add("add", [part, self.const(steps.astype(np.int64), "i32")], t.shape, "i32")
        self.sum_to_readers(node, _Tensor(shifted, t.shape, common, 0, t.nhwc, True))

    def sum_to_readers(self, node: ir.Node, total: _Tensor) -> None:
        """An int32 sum, rounded to int8 for each QuantizeLinear reading it, kept as a stream for Adds."""
        value = node.outputs[0]
        readers = [u.node for u in value.uses()]
        if value.is_graph_output() or any(r.op_type not in ("QuantizeLinear", "Add", "Sub") for r in readers):
            kinds = ", ".join(sorted({r.op_type for r in readers})) or "a graph output"
            raise TosaError(
                f"node '{_name(node)}' ({node.op_type}): its int32 result is read by {kinds}; only by QuantizeLinear, "
                "Add or Sub is lowered"
            )
        self.wide[str(value.name)] = total
        for q in (r for r in readers if r.op_type == "QuantizeLinear"):
            out_scale, out_zp = _params(q)
            reader = q.outputs[0].name
            why = f"{node.op_type} '{_name(node)}': the int32 result to the int8 input '{reader}' of its reader"
            result = self.rescale(total.name, total.shape, np.array([total.scale / out_scale]), 0, out_zp, "i32", why)
            self.tensors[str(q.outputs[0].name)] = _Tensor(result, total.shape, out_scale, out_zp, total.nhwc)

    def rescale_to_i32(self, t: _Tensor, scale: float, why: str) -> str:
        """``t`` (int8, or an int32 stream) as int32 values of ``t.scale / scale``, its zero point removed."""
        if t.wide and scale == 1.0:
            return t.name
        m, s = multiplier_shift(scale)
        zero = self.zero_point(t.zero_point, "i32" if t.wide else "i8")
        return self.add("rescale", [t.name, self.const(np.array([m]), "i32"),
                                    self.const(np.array([s]), "i8"),
                                    zero, self.zero_point(0, "i32")],
                        t.shape, "i32", per_channel=False, scale32=True, why=why, scale=[scale])  # fmt: skip


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

LOWERINGS = {"Conv": _Lowering.conv, "ConvTranspose": _Lowering.conv_transpose, "Gemm": _Lowering.gemm,
             "MatMul": _Lowering.matmul, "MaxPool": _Lowering.max_pool,
             "Reshape": _Lowering.reshape, "Flatten": _Lowering.reshape, "Relu": _Lowering.clamp,
             "Clip": _Lowering.clamp, "Add": _Lowering.add_op,
             "GlobalAveragePool": _Lowering.global_average_pool, "Gather": _Lowering.gather,
             "Identity": _Lowering.identity, "Squeeze": _Lowering.reshape, "Unsqueeze": _Lowering.reshape,
             "Mul": _Lowering.mul, "Concat": _Lowering.concat, "AveragePool": _Lowering.average_pool,
             "Transpose": _Lowering.transpose_op, "Pad": _Lowering.pad, "Resize": _Lowering.resize,
             "Slice": _Lowering.slice_op, "Softmax": _Lowering.softmax, "LayerNormalization": _Lowering.layer_norm,
             "LpNormalization": _Lowering.l2_normalize,
             "Sub": _Lowering.sub_op, "ReduceMean": _Lowering.reduce, "ReduceSum": _Lowering.reduce,
             "ReduceMax": _Lowering.reduce,
             **{op: _Lowering.table for op in UNARY}}  # fmt: skip


def _params(q: ir.Node) -> tuple[float, int]:
    """A QuantizeLinear's (or DequantizeLinear's) scale and zero point, the zero point as int8 (uint8
    shifted by -128). One scale written once per index of an axis (the QDQ backend's DequantizeLinear
    before a float kernel, which ONNX Runtime would otherwise quantize itself) is one scale."""
    scale = constant(q.inputs[1]) if len(q.inputs) > 1 else None
    zp = constant(q.inputs[2]) if len(q.inputs) > 2 else None
    one_scale = scale is not None and scale.size > 1 and bool((scale == scale.flat[0]).all())
    if scale is not None and one_scale and (zp is None or bool((zp == zp.flat[0]).all())):
        scale, zp = scale.reshape(-1)[:1], (zp.reshape(-1)[:1] if zp is not None else None)
    if scale is None or scale.size != 1:
        raise TosaError(f"QuantizeLinear '{q.name}': a constant per-tensor scale is lowered, not this one")
    zero = zp if zp is not None else np.zeros((), np.uint8)
    if zero.dtype not in (np.uint8, np.int8):
        raise TosaError(f"QuantizeLinear '{q.name}': 8-bit activations are lowered, not {zero.dtype}")
    return float(scale.reshape(())), int(zero.reshape(())) - (128 if zero.dtype == np.uint8 else 0)


def _constant_value(value: ir.Value, node: ir.Node) -> Array | None:
    """A float constant, or the real values of a dequantized integer constant; None for a tensor."""
    producer = value.producer()
    if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
        data, scale, zp = _dequantized_constant(value, node)
        return (data.astype(np.float64) - zp) * scale
    return constant(value)


def _dequantized_constant(value: ir.Value | None, node: ir.Node) -> tuple[Array, Array, Array]:
    """The integers, scale and zero point of a constant ``DequantizeLinear`` input of ``node``."""
    dq = value.producer() if value is not None else None
    data = constant(dq.inputs[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if dq is None or data is None:
        raise TosaError(
            f"node '{_name(node)}': input '{value.name if value else '?'}' is not a quantized constant", _name(node)
        )
    scale = constant(dq.inputs[1])
    zp = constant(dq.inputs[2]) if len(dq.inputs) > 2 else None
    assert scale is not None
    return np.asarray(data), np.asarray(scale, np.float64), np.asarray(zp if zp is not None else 0)


def _static_shapes(
    model: ir.Model, given: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, Array]]:
    """Every value's shape with the inputs' batch fixed to 1 and their other dynamic dimensions as
    ``given`` (by input name: a sample's shape), and the values of its integer tensors (shape
    arithmetic, an exporter's gather indices): the model runs once in ONNX Runtime on zeros (shape
    inference does not follow an exporter's shape arithmetic into a Reshape)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    from requant.runtime import cpu_session

    proto = ir.to_proto(model)
    feeds = {}
    for graph_input in proto.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        shape = []
        sample = (given or {}).get(graph_input.name)
        for i, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif i == 0:
                shape.append(1)
            elif sample is not None and len(sample) == len(dims):
                shape.append(int(sample[i]))
            else:
                raise TosaError(
                    f"input '{graph_input.name}' has a dynamic dimension {i} and no sample gives it: TOSA programs "
                    "have static shapes (export the model with that dimension fixed)"
                )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
        feeds[graph_input.name] = np.zeros(shape, dtype)
    known = {o.name for o in proto.graph.output}
    inferred = onnx.shape_inference.infer_shapes(proto)  # element types the model may not state
    types = {i.name: i.type.tensor_type.elem_type for i in inferred.graph.value_info if i.type.HasField("tensor_type")}
    types.update({str(v.name): int(v.dtype) for n in model.graph for v in n.outputs if v.dtype is not None})
    for name in (o for n in proto.graph.node for o in n.output if o and o not in known):
        if types.get(name):
            proto.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = cpu_session(proto.SerializeToString(), options)
    outputs = [o.name for o in session.get_outputs()]
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    integers = {}
    for name, array in zip(outputs, session.run(outputs, feeds), strict=True):
        shapes[name] = tuple(np.shape(array))
        if np.asarray(array).dtype.kind in "iu" and np.size(array) <= 1 << 16:
            integers[name] = np.asarray(array)
    return shapes, integers


def _indices_only(value: ir.Value) -> bool:
    """An integer input read only as the indices of Gathers (and by shape arithmetic)."""
    integer = value.dtype in (ir.DataType.INT64, ir.DataType.INT32)
    uses = [u for u in value.uses() if u.node.op_type not in SHAPE_OPS]
    return integer and bool(uses) and all(u.node.op_type == "Gather" and u.idx == 1 for u in uses)


def _computed_from_indices(model: ir.Model) -> set[str]:
    """The values computed from an input of indices (their values depend on what the host gives)."""
    found = {str(v.name) for v in model.graph.inputs if _indices_only(v)}
    for node in model.graph:
        if any(v is not None and str(v.name) in found for v in node.inputs):
            found |= {str(o.name) for o in node.outputs}
    return found


def _reads_dequantized(node: ir.Node) -> bool:
    producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


def lower_to_tosa(
    model: ir.Model, rounding: str = "single_round", shapes: Mapping[str, tuple[int, ...]] | None = None
) -> TosaProgram:
    """The integer TOSA program of a QDQ ``model`` (requant's output), batch 1; its rescales round as
    ``rounding`` says (``single_round``, TOSA's; ``double_round``, TFLite's: TOSA's extension).
    ``shapes``: the inputs' shapes by name (a calibration sample's), for dimensions the model leaves
    dynamic after the batch: the program is for that size."""
    if rounding not in ROUNDING:
        raise TosaError(f"rounding must be one of {', '.join(ROUNDING)}, got {rounding!r}")
    for node in model.graph:  # integer-only: a node computing on float values is an error, named
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", *SHAPE_OPS):
            continue
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if value is None or value.dtype != ir.DataType.FLOAT or constant(value) is not None:
                continue
            if producer is None or producer.op_type != "DequantizeLinear":
                if producer is not None and producer.op_type in KERNELS and node.op_type in ("Relu", "Clip"):
                    continue  # an activation lowered with its kernel
                if producer is not None and producer.op_type == "Add" and node.op_type in ("Add", "Sub"):
                    continue  # a residual stream (int32)
                raise TosaError(
                    f"node '{_name(node)}' ({node.op_type}) computes in float: its input '{value.name}' is not "
                    "quantized, and the tosa-int8 target is integer-only",
                    _name(node),
                )
    static, integers = _static_shapes(model, shapes)
    for name in _computed_from_indices(model):  # ran on zeros: not what the program computes from its inputs
        integers.pop(name, None)
    lowering = _Lowering(model.graph, static, integers)
    inputs: list[Edge] = []
    arguments: list[str] = []
    for value in model.graph.inputs:
        uses = [u.node for u in value.uses()]
        if _indices_only(value):  # token ids: an i32 argument, rows of a table gathered at run time
            shape = lowering.shape_of(value)
            name = f"%arg{len(arguments)}"
            arguments.append(name)
            inputs.append(Edge(str(value.name), shape, 1.0, 0, "i32"))
            lowering.index_inputs[str(value.name)] = _Tensor(name, shape, 1.0, 0)
            continue
        quantizers = [n for n in uses if n.op_type == "QuantizeLinear"]
        if len(quantizers) != 1 or any(n.op_type not in ("QuantizeLinear", *SHAPE_OPS) for n in uses):
            raise TosaError(f"input '{value.name}' is not read through one QuantizeLinear (the function takes int8)")
        scale, zp = _params(quantizers[0])
        shape = lowering.shape_of(value)
        name = f"%arg{len(arguments)}"
        arguments.append(name)
        inputs.append(Edge(str(value.name), shape, scale, zp))
        lowering.tensors[str(quantizers[0].outputs[0].name)] = _Tensor(name, shape, scale, zp)
    for node in model.graph:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.op_type in SHAPE_OPS:
            continue
        if node.op_type == "Pad" and node.inputs[0] is not None and str(node.inputs[0].name) in lowering.tensors:
            lowering.pad(node)  # requant's Pad on the integers
            continue
        if node.op_type == "ArgMax" and _reads_dequantized(node):
            lowering.argmax(node)  # of int8 values: indices
            continue
        if all(o.dtype is not None and o.dtype != ir.DataType.FLOAT for o in node.outputs):
            continue  # shape arithmetic (int64): the shapes are static here
        if node.op_type in ("Relu", "Clip") and node.inputs[0] is not None:
            producer = node.inputs[0].producer()
            if producer is not None and producer.op_type in KERNELS:
                continue  # written with its kernel
        lower = LOWERINGS.get(node.op_type)
        if lower is None:
            raise TosaError(f"node '{_name(node)}' ({node.op_type}): the tosa-int8 backend does not lower this op yet")
        lower(lowering, node)
    outputs: list[Edge] = []
    results: list[str] = []
    for value in model.graph.outputs:
        if str(value.name) in lowering.indices:  # an ArgMax's: i32 indices, not quantized
            index, shape = lowering.indices[str(value.name)]
            outputs.append(Edge(str(value.name), shape, 1.0, 0, "i32"))
            results.append(index)
            continue
        dq = value.producer()
        found = lowering.tensors.get(str(dq.inputs[0].name)) if dq is not None and dq.inputs[0] is not None else None
        if dq is None or dq.op_type != "DequantizeLinear" or found is None:
            raise TosaError(
                f"output '{value.name}' is not a dequantized int8 tensor (the function returns int8, or an ArgMax's "
                "indices)"
            )
        found = lowering.nchw(found)
        outputs.append(Edge(str(value.name), found.shape, found.scale, found.zero_point))
        results.append(found.name)
    types = {
        str(v.name): str(t)
        for v in (n.outputs[0] for n in model.graph if n.op_type == "QuantizeLinear")
        if (t := v.meta.get("requant.quant_type")) is not None
    }
    return TosaProgram(inputs, outputs, lowering.ops, arguments, results, types, rounding)
