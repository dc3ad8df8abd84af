"""ExecuTorch's XNNPACK delegate, as a support table of ATen ops: what requant's PT2E quantizer annotates.

The table is read from ExecuTorch 1.5.1's partitioner (``executorch/backends/xnnpack/partition/config``):
the ops whose ``supported_precision_types`` include ``STATIC_QUANT`` are delegated as int8 kernels when
they sit between ``dequantize``/``quantize`` pairs; the others (``avg_pool2d``, ``constant_pad_nd``,
``sigmoid``, ``gelu``, ``_softmax``, ...) only in float. Each row says what the op does to the types of
its ports (:data:`ROLES`), and which ONNX op a user's config names it by (``OpType("Conv")`` selects
``aten.conv2d``), so one config means the same on every target.

Measured (ExecuTorch 1.5.1, torch 2.13): a bias quantized as an int32 ``DerivedQuantizationSpec`` (input
scale x weight scale) made the partitioner refuse the convolutions and ``to_executorch()`` fail on
``dequantize_per_channel``: biases stay float here, as ExecuTorch's own ``XNNPACKQuantizer`` leaves them
(XNNPACK quantizes them itself, with the same derived scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from requant.targets.kernels import _CONV, _LINEAR, KernelModel, KernelRule
from requant.targets.table import SupportTable
from requant.types.accumulation import INT32

__all__ = ["ROLES", "XNNPACK_INT32", "XNNPACK_OPS", "XNNPACK_TABLE", "XnnpackOp"]

# What an op does to its ports' types:
#   kernel      reads an activation and a constant weight (per-channel axis ``weight_axis``), writes its own
#   binary      reads two activations (each its own type), writes its own
#   activation  folded into the int8 op before it (XNNPACK clamps that op's output); alone, not quantized
#   same_scale  reads and writes one type (moves, selects or averages values): shares its input's
#   join        several inputs and its output on the first input's type (XNNPACK's int8 cat needs one)
ROLES = ("kernel", "binary", "activation", "same_scale", "join")


@dataclass(frozen=True)
class XnnpackOp:
    """One row: the ATen op (its overload packet's name), its role, the ONNX op type configs name it
    by, and, for a kernel, its weight's output-channel axis."""

    aten: str
    role: str
    onnx: str
    weight_axis: int | None = None


XNNPACK_OPS: dict[str, XnnpackOp] = {
    op.aten: op
    for op in (
        XnnpackOp("conv2d", "kernel", "Conv", weight_axis=0),
        XnnpackOp("conv1d", "kernel", "Conv", weight_axis=0),
        XnnpackOp("conv_transpose2d", "kernel", "ConvTranspose", weight_axis=1),
        XnnpackOp("linear", "kernel", "Gemm", weight_axis=0),
        XnnpackOp("add", "binary", "Add"),
        XnnpackOp("add_", "binary", "Add"),
        XnnpackOp("sub", "binary", "Sub"),
        XnnpackOp("mul", "binary", "Mul"),
        XnnpackOp("relu", "activation", "Relu"),
        XnnpackOp("relu_", "activation", "Relu"),
        XnnpackOp("hardtanh", "activation", "Clip"),
        XnnpackOp("hardtanh_", "activation", "Clip"),
        XnnpackOp("relu6", "activation", "Clip"),
        XnnpackOp("clamp", "activation", "Clip"),
        XnnpackOp("max_pool2d", "same_scale", "MaxPool"),
        XnnpackOp("adaptive_avg_pool2d", "same_scale", "GlobalAveragePool"),  # mean.dim in the edge dialect
        XnnpackOp("mean", "same_scale", "ReduceMean"),
        XnnpackOp("flatten", "same_scale", "Flatten"),
        XnnpackOp("view", "same_scale", "Reshape"),
        XnnpackOp("reshape", "same_scale", "Reshape"),
        XnnpackOp("permute", "same_scale", "Transpose"),
        XnnpackOp("unsqueeze", "same_scale", "Unsqueeze"),
        XnnpackOp("slice", "same_scale", "Slice"),
        XnnpackOp("dropout", "same_scale", "Identity"),  # eval: the identity
        XnnpackOp("cat", "join", "Concat"),
    )
}

# The ONNX support table is not what this target's quantizer matches (it annotates ATen ops with
# XNNPACK_OPS); an empty one keeps a user's ONNX-side quantizer from claiming any pattern for it.
XNNPACK_TABLE = SupportTable("XNNPACK (ExecuTorch delegate, ATen ops: requant.targets.xnnpack)", ())

XNNPACK_INT32 = KernelModel(
    "XNNPACK QS8",
    "any CPU XNNPACK runs on (x86-64, Arm): int32 accumulators",
    (KernelRule("XNNPACK qs8 convolution / fully connected (int32 accumulator)", _CONV | _LINEAR, INT32),),
)
