"""MLIR text of a :class:`~requant.backends.tosa.TosaProgram`: TOSA 1.0 ops in MLIR's generic form
(which both LLVM 22's ``mlir-opt`` and IREE 3.13's bundled MLIR parse; their custom syntaxes
differ), constants as hex ``dense`` literals, and a header with the host's quantization of the
inputs and outputs and every tensor's ``!quant.uniform`` type."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from requant.backends.tosa.program import ROUNDING, TosaError, TosaOp, TosaProgram

__all__ = ["to_mlir"]

Array = npt.NDArray[Any]


def _type(shape: tuple[int, ...], dtype: str) -> str:
    return f"tensor<{'x'.join(str(d) for d in shape)}{'x' if shape else ''}{dtype}>"


def _dense(array: Array) -> str:
    data = np.ascontiguousarray(array)
    return f'dense<"0x{data.astype(data.dtype.newbyteorder("<")).tobytes().hex().upper()}">'


def _array(values: list[int]) -> str:
    return f"array<i64: {', '.join(str(int(v)) for v in values)}>"


def _attributes(op: TosaOp, rounding: str) -> str:
    a = op.attrs
    if op.kind == "const":
        assert op.value is not None
        return f"values = {_dense(op.value)} : {_type(op.shape, op.dtype)}"
    if op.kind in ("conv2d", "depthwise_conv2d"):
        return (f"acc_type = i32, dilation = {_array(a['dilation'])}, pad = {_array(a['pad'])}, "
                f"stride = {_array(a['stride'])}")  # fmt: skip
    if op.kind == "transpose_conv2d":
        return f"acc_type = i32, out_pad = {_array(a['out_pad'])}, stride = {_array(a['stride'])}"
    if op.kind == "rescale":
        return (f"input_unsigned = false, output_unsigned = false, per_channel = {str(a['per_channel']).lower()}, "
                f"rounding_mode = #tosa.rounding_mode<{rounding.upper()}>, scale32 = true")  # fmt: skip
    if op.kind == "clamp":
        return f"max_val = {a['max_val']} : i8, min_val = {a['min_val']} : i8, nan_mode = #tosa.nan_mode<PROPAGATE>"
    if op.kind == "avg_pool2d":
        return (f"acc_type = i32, kernel = {_array(a['kernel'])}, pad = {_array(a['pad'])}, "
                f"stride = {_array(a['stride'])}")  # fmt: skip
    if op.kind == "argmax":
        return f"axis = {a['axis']} : i32, nan_mode = #tosa.nan_mode<PROPAGATE>"
    if op.kind == "max_pool2d":
        return (f"kernel = {_array(a['kernel'])}, nan_mode = #tosa.nan_mode<PROPAGATE>, pad = {_array(a['pad'])}, "
                f"stride = {_array(a['stride'])}")  # fmt: skip
    if op.kind == "transpose":
        return f"perms = array<i32: {', '.join(str(p) for p in a['perms'])}>"
    if op.kind == "concat":
        return f"axis = {a['axis']} : i32"
    if op.kind == "resize":
        return f"mode = #tosa.resize_mode<{a.get('mode', 'NEAREST_NEIGHBOR')}>"
    if op.kind == "reduce_sum":
        return f"axis = {a['axis']} : i32"
    if op.kind == "minimum":
        return "nan_mode = #tosa.nan_mode<PROPAGATE>"
    if op.kind == "reduce_max":
        return f"axis = {a['axis']} : i32, nan_mode = #tosa.nan_mode<PROPAGATE>"
    return ""


def to_mlir(program: TosaProgram, rounding: str | None = None, name: str = "main") -> str:
    """``program`` as MLIR text in the generic op form (what both LLVM 22's ``mlir-opt`` and IREE's
    bundled MLIR parse), with a header giving each edge's quantization and each tensor's type;
    ``rounding`` overrides the program's."""
    rounding = rounding or program.rounding
    if rounding not in ROUNDING:
        raise TosaError(f"rounding must be one of {', '.join(ROUNDING)}, got {rounding!r}")
    types: dict[str, str] = {}
    lines = ["// requant: integer-only TOSA 1.0 (int profile); the host quantizes the inputs and",
             "// dequantizes the outputs with these parameters (real = scale * (q - zero_point)):"]  # fmt: skip
    for what, edges in (("input", program.inputs), ("output", program.outputs)):
        for e in edges:
            if e.dtype != "i8":
                lines.append(f"//   {what} {e.name}: {e.dtype} {list(e.shape)} indices (not quantized)")
                continue
            lines.append(f"//   {what} {e.name}: i8 {list(e.shape)} scale {e.scale!r} zero_point {e.zero_point}")
    lines.append("// quantized tensors of the model (requant's types; uint8 ones are stored here as int8, zp - 128):")
    lines += [f"//   {n}: {t}" for n, t in sorted(program.types.items())]
    args = ", ".join(f"{a}: {_type(e.shape, e.dtype)}" for a, e in zip(program.arguments, program.inputs, strict=True))
    for a, e in zip(program.arguments, program.inputs, strict=True):
        types[a] = _type(e.shape, e.dtype)
    results = ", ".join(_type(e.shape, e.dtype) for e in program.outputs)
    lines.append(f"func.func @{name}({args}) -> ({results}) {{")
    for op in program.ops:
        result_type = _type(op.shape, op.dtype)
        operands = list(op.inputs)
        operand_types = [types[o] for o in operands]
        for key in ("start", "size") if op.kind == "slice" else ():  # !tosa.shape operands
            rank = len(op.attrs[key])
            lines.append(f"  {op.output}_{key} = \"tosa.const_shape\"() <{{values = dense<{list(op.attrs[key])}> : "
                         f"tensor<{rank}xindex>}}> : () -> !tosa.shape<{rank}>")  # fmt: skip
            operands.append(f"{op.output}_{key}")
            operand_types.append(f"!tosa.shape<{rank}>")
        shaped = {"reshape": ("new_shape",), "pad": ("padding",), "resize": ("scale", "offset", "border")}
        for position, key in enumerate(shaped.get(op.kind, ()), start=1):  # !tosa.shape operands after the input
            shape_name = f"{op.output}_{key}" if op.kind == "resize" else f"{op.output}_shape"
            rank = len(op.attrs[key])
            dims = list(op.attrs[key])
            lines.append(f"  {shape_name} = \"tosa.const_shape\"() <{{values = dense<{dims}> : "
                         f"tensor<{rank}xindex>}}> : () -> !tosa.shape<{rank}>")  # fmt: skip
            operands.insert(position, shape_name)
            operand_types.insert(position, f"!tosa.shape<{rank}>")
        attrs = _attributes(op, rounding)
        lines.append(
            f'  {op.output} = "tosa.{op.kind}"({", ".join(operands)})'
            + (f" <{{{attrs}}}>" if attrs else "")
            + f" : ({', '.join(operand_types)}) -> {result_type}"
        )
        types[op.output] = result_type
    lines.append(f"  func.return {', '.join(program.results)} : {results}")
    lines.append("}")
    return "\n".join(lines) + "\n"
