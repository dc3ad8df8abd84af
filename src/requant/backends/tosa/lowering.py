"""What every op's lowering shares: :class:`Lowering` holds the program being written (its ops, the
int8 tensor each ONNX value became, the static shapes) and writes its common pieces (constants,
rescales, layout transposes); the ops themselves are lowered by the functions of the op-family
modules beside it, which :mod:`requant.backends.tosa.lower` dispatches to.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.backends.tosa.program import (
    Array,
    Tensor,
    TosaError,
    TosaOp,
    multiplier_shift,
    named,
)
from requant.ir.queries import constant


def exact_pads(size: tuple[int, ...], kernel: list[int], pads: list[int], strides: list[int],
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


class Lowering:
    def __init__(self, graph: ir.Graph, shapes: dict[str, tuple[int, ...]], integers: dict[str, Array]) -> None:
        self.graph = graph
        self.shapes = shapes
        self.integers = integers  # integer tensors' values (batch 1)
        self.index_inputs: dict[str, Tensor] = {}  # the i32 arguments of indices a Gather reads, by input name
        self.ops: list[TosaOp] = []
        self.tensors: dict[str, Tensor] = {}  # ONNX value name -> int8 tensor
        self.wide: dict[str, Tensor] = {}  # a float sum's ONNX name -> its int32 stream
        self.constants: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self.transposed: dict[str, Tensor] = {}  # an op's name -> the same values in the other layout
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
    def nhwc(self, t: Tensor) -> Tensor:
        return t if t.nhwc or len(t.shape) != 4 else self.transpose(t, [0, 2, 3, 1])

    def nchw(self, t: Tensor) -> Tensor:
        return self.transpose(t, [0, 3, 1, 2]) if t.nhwc else t

    def transpose(self, t: Tensor, perms: list[int]) -> Tensor:
        """``t`` in the other layout (once per tensor, however many readers want it)."""
        if t.name not in self.transposed:
            shape = tuple(t.shape[p] for p in perms)
            out = self.add("transpose", [t.name], shape, "i32" if t.wide else "i8", perms=perms)
            self.transposed[t.name] = Tensor(out, shape, t.scale, t.zero_point, not t.nhwc, t.wide)
        return self.transposed[t.name]

    def cropped(self, t: Tensor, crop: list[int]) -> Tensor:
        """``t`` (NHWC) without its last ``crop`` rows and columns (never read by the op after it)."""
        if not any(crop):
            return t
        n, h, w, c = t.shape
        shape = (n, h - crop[0], w - crop[1], c)
        name = self.add("slice", [t.name], shape, "i8", start=[0, 0, 0, 0], size=list(shape))
        return Tensor(name, shape, t.scale, t.zero_point, True)

    # -------------------------------------------------------------- the int8 tensor behind a float value
    def source(self, value: ir.Value | None, node: ir.Node) -> Tensor:
        """The int8 tensor a float input of ``node`` dequantizes."""
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear" and producer.inputs[0] is not None:
            found = self.tensors.get(str(producer.inputs[0].name))
            if found is not None:  # read with the DequantizeLinear's own parameters: requant folds a
                scale, zp = q_params(producer)  # constant factor into them (a HardSwish's 1/6)
                same = math.isclose(scale, found.scale, rel_tol=1e-9) and zp == found.zero_point
                return found if same else dataclasses.replace(found, scale=scale, zero_point=zp)
        name = value.name if value is not None else "?"
        raise TosaError(f"node '{named(node)}' ({node.op_type}): input '{name}' is not a quantized tensor")

    def quantized_output(self, value: ir.Value, node: ir.Node) -> tuple[ir.Node, float, int]:
        """The single QuantizeLinear reading ``value``, with its scale and (int8) zero point."""
        uses = [u.node for u in value.uses()]
        if len(uses) == 1 and uses[0].op_type == "QuantizeLinear":
            q = uses[0]
            return q, *q_params(q)
        raise TosaError(
            f"node '{named(node)}' ({node.op_type}): its output '{value.name}' is read in float "
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

    def retyped(self, t: Tensor, scale: float, zp: int, why: str) -> Tensor:
        """The int8 tensor ``t`` on ``scale`` and ``zp``: itself where it already is, else a
        ``tosa.rescale`` (where two quantizations meet)."""
        if math.isclose(t.scale, scale, rel_tol=1e-6) and t.zero_point == zp:
            return t
        name = self.rescale(t.name, t.shape, np.array([t.scale / scale]), t.zero_point, zp, "i8", why)
        return Tensor(name, t.shape, scale, zp, t.nhwc)

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
        self.tensors[str(q.outputs[0].name)] = Tensor(name, shape, scale, zp, nhwc)

    def reshaped(self, t: Tensor, shape: tuple[int, ...]) -> str:
        """``t``'s values as ``shape`` (itself when it already has it)."""
        if tuple(t.shape) == tuple(shape):
            return t.name
        return self.add("reshape", [t.name], shape, "i32" if t.wide else "i8", new_shape=list(shape))

    def same_scale(self, node: ir.Node) -> Tensor:
        """The int8 input of an op that moves or selects values (a tensor, or a constant: an embedding
        table): its output must be quantized alike."""
        x = self.operand(node.inputs[0], node)
        _, scale, zp = self.quantized_output(node.outputs[0], node)
        if not math.isclose(scale, x.scale, rel_tol=1e-6) or zp != x.zero_point:
            raise TosaError(f"node '{named(node)}' ({node.op_type}): its input and output are quantized differently")
        return x

    def known(self, value: ir.Value | None) -> Array | None:
        """An integer input's values (flat): a constant, or what the model computes once the shapes are
        static; None when neither."""
        if value is None:
            return None
        data = constant(value)
        if data is None:
            data = self.integers.get(str(value.name))
        return None if data is None else np.asarray(data, np.int64).reshape(-1)

    def operand(self, value: ir.Value | None, node: ir.Node, rank: int = 0) -> Tensor:
        """An int8 tensor, or a dequantized int8 constant made one, its dimensions padded in front to
        ``rank`` (ONNX broadcasts a per-channel ``[C, 1, 1]`` against ``[N, C, H, W]``; TOSA wants equal
        ranks)."""
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
            data, scale, zp = dequantized_constant(value, node)
            if data.dtype not in (np.int8, np.uint8) or scale.size != 1:
                raise TosaError(f"node '{named(node)}': a per-tensor 8-bit constant operand is lowered, not this one")
            shift = 128 if data.dtype == np.uint8 else 0
            values = (data.astype(np.int16) - shift).astype(np.int8)
            values = values.reshape((1,) * max(0, rank - values.ndim) + values.shape)
            return Tensor(self.const(values, "i8"), values.shape, float(scale), int(zp) - shift)
        return self.source(value, node)

    def sum_to_readers(self, node: ir.Node, total: Tensor) -> None:
        """An int32 sum, rounded to int8 for each QuantizeLinear reading it, kept as a stream for Adds."""
        value = node.outputs[0]
        readers = [u.node for u in value.uses()]
        if value.is_graph_output() or any(r.op_type not in ("QuantizeLinear", "Add", "Sub") for r in readers):
            kinds = ", ".join(sorted({r.op_type for r in readers})) or "a graph output"
            raise TosaError(
                f"node '{named(node)}' ({node.op_type}): its int32 result is read by {kinds}; only by QuantizeLinear, "
                "Add or Sub is lowered"
            )
        self.wide[str(value.name)] = total
        for q in (r for r in readers if r.op_type == "QuantizeLinear"):
            out_scale, out_zp = q_params(q)
            reader = q.outputs[0].name
            why = f"{node.op_type} '{named(node)}': the int32 result to the int8 input '{reader}' of its reader"
            result = self.rescale(total.name, total.shape, np.array([total.scale / out_scale]), 0, out_zp, "i32", why)
            self.tensors[str(q.outputs[0].name)] = Tensor(result, total.shape, out_scale, out_zp, total.nhwc)

    def rescale_to_i32(self, t: Tensor, scale: float, why: str) -> str:
        """``t`` (int8, or an int32 stream) as int32 values of ``t.scale / scale``, its zero point removed."""
        if t.wide and scale == 1.0:
            return t.name
        m, s = multiplier_shift(scale)
        zero = self.zero_point(t.zero_point, "i32" if t.wide else "i8")
        return self.add("rescale", [t.name, self.const(np.array([m]), "i32"),
                                    self.const(np.array([s]), "i8"),
                                    zero, self.zero_point(0, "i32")],
                        t.shape, "i32", per_channel=False, scale32=True, why=why, scale=[scale])  # fmt: skip


def q_params(q: ir.Node) -> tuple[float, int]:
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


def constant_value(value: ir.Value, node: ir.Node) -> Array | None:
    """A float constant, or the real values of a dequantized integer constant; None for a tensor."""
    producer = value.producer()
    if producer is not None and producer.op_type == "DequantizeLinear" and constant(producer.inputs[0]) is not None:
        data, scale, zp = dequantized_constant(value, node)
        return (data.astype(np.float64) - zp) * scale
    return constant(value)


def dequantized_constant(value: ir.Value | None, node: ir.Node) -> tuple[Array, Array, Array]:
    """The integers, scale and zero point of a constant ``DequantizeLinear`` input of ``node``."""
    dq = value.producer() if value is not None else None
    data = constant(dq.inputs[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if dq is None or data is None:
        raise TosaError(
            f"node '{named(node)}': input '{value.name if value else '?'}' is not a quantized constant", named(node)
        )
    scale = constant(dq.inputs[1])
    zp = constant(dq.inputs[2]) if len(dq.inputs) > 2 else None
    assert scale is not None
    return np.asarray(data), np.asarray(scale, np.float64), np.asarray(zp if zp is not None else 0)
