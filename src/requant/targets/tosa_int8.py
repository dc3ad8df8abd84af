"""TOSA 1.0, int profile: integer-only kernels, as a support table and a kernel model.

Everything between the model's inputs and outputs is an integer: 8-bit activations with a zero
point, symmetric int8 weights (per output channel or per tensor), int32 biases on the input scale
times the weight scale, and int32 accumulators brought back to int8 by ``tosa.rescale``. So every
op the model computes must be one :mod:`requant.backends.tosa` lowers. A sum of two activations (a
residual connection) is not rounded to int8, as on ONNX Runtime where it stays float: the backend
carries it as an int32 stream on a fine scale. What it lowers so far: ``Conv``
(2-d, and depthwise), ``ConvTranspose`` (2-d, dilated too), ``Gemm`` and ``MatMul``
(a constant weight, or two activations) with a folded
Relu or Clip, ``Add``, ``Mul``, ``Relu``, ``Clip``,
``Sigmoid``, ``Tanh``, ``HardSigmoid``, ``HardSwish``, ``LeakyRelu``, ``Gelu`` (as ``tosa.table``), ``Softmax``,
``LayerNormalization``,
``MaxPool``, ``AveragePool``, ``GlobalAveragePool``, ``Concat``, ``Reshape``, ``Flatten``,
``Transpose``, ``Pad``, ``Slice`` (steps too), nearest and bilinear ``Resize`` (upsampling),
``Gather`` (at known indices, or at an input's: token ids), ``Sub`` of two tensors, ``ReduceMean``,
``ReduceSum``, ``ReduceMax``, ``LpNormalization`` (p 2), and ``ArgMax`` (its indices a result of the function).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir

from requant.ir.queries import constant
from requant.ir.requests import QuantizationSpec
from requant.ir.traits import WEIGHTED
from requant.targets.constraints import RESCALE, Join, SameScale
from requant.targets.decompose import BATCHNORM_TO_MUL_ADD, DIV_TO_MUL, SPATIAL_MEAN, SUB_TO_ADD
from requant.targets.kernels import _CONV, _LINEAR, KernelModel, KernelRule
from requant.targets.table import Accept, Match, Pattern, Reject, SupportTable, Verdict, non_float, sums_activations
from requant.types.accumulation import INT32

if TYPE_CHECKING:
    from requant.quantizers.config import QuantizationConfig

__all__ = ["TOSA_INT8", "TOSA_INT32", "transposed_unlike_tosa"]

ACTIVATION_DTYPES = ("int8", "uint8")  # uint8 is written as int8 (q - 128, zero point - 128): exact
PRODUCERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FOLDED_ACTIVATIONS = ("Relu", "Clip")
STANDALONE = (
    "Add",
    "Mul",
    "Relu",
    "Clip",
    "GlobalAveragePool",
    "Sigmoid",
    "Tanh",
    "HardSigmoid",
    "HardSwish",
    "LeakyRelu",
    "Gelu",
    "Concat",  # its own output type, its inputs quantized as they are: tosa.concat rescales each to it
    # its own output type too, so that a residual sum it reads (an int32 stream, which tosa.resize cannot
    # take) is quantized to int8 before it: PP-OCRv4's FPN upsamples its sums
    "Resize",
    "Softmax",  # its own output type: int8 tables of exp, a row sum, an integer division
    "LayerNormalization",  # its own output type: integer mean, variance, square root (Newton), division
    "Sub",  # of two tensors (a LayerNorm written out: x - mean); one by a constant is decomposed into an Add
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",  # one type in and out (below): tosa.reduce_max of the int8 values
    "LpNormalization",  # p 2, the last axis: as a LayerNorm's integers, not centred
)


def _check(match: Match, config: QuantizationConfig) -> Verdict:
    node = match.nodes[0]
    integer = non_float(match)
    if integer is not None:
        return Reject(f"computes on {integer}, not float activations (shape arithmetic stays as it is)", at=node)
    if config.float_output:
        return Reject("TOSA's int profile has no float outputs: every kernel's output is int8", at=node)
    if isinstance(config.input_activation, QuantizationSpec) and sums_activations(match):
        return Reject(
            "a sum of two activations (a residual connection) is not rounded to int8: the backend carries it as "
            "an int32 stream on a fine scale, and the kernels that read it rescale it to their int8 input "
            "(MobileNetV2's residual sums rounded to int8 lost 12 points of top-1 agreement)",
            at=node,
        )
    for what, spec in (("input activation", config.input_activation), ("output activation", config.output_activation)):
        if not isinstance(spec, QuantizationSpec):
            continue
        if spec.dtype not in ACTIVATION_DTYPES or spec.granularity != "per_tensor":
            return Reject(f"{what}: TOSA's int profile takes 8-bit activations per tensor, not {spec}", at=node)
    if node.op_type in WEIGHTED:
        weight_index, _ = WEIGHTED[node.op_type]
        data = constant(node.inputs[weight_index])
        spec = config.weight
        if data is None and node.op_type == "MatMul":
            return Accept()  # two activations (attention's products): tosa.matmul takes both with their zero points
        if data is None:
            return Reject(f"{node.op_type} weight is not a constant (lowered: constant weights)", at=node)
        if node.op_type in ("Conv", "ConvTranspose") and data.ndim != 4:
            return Reject(f"the tosa-int8 backend lowers 2-d convolutions; this one is {data.ndim - 2}-d", at=node)
        if node.op_type == "ConvTranspose":
            why = transposed_unlike_tosa(node)
            if why:
                return Reject(f"tosa.transpose_conv2d has {why}", at=node)
        if isinstance(spec, QuantizationSpec) and (
            spec.dtype != "int8" or not spec.symmetric or spec.granularity == "blockwise"
        ):
            return Reject(f"TOSA's int profile takes symmetric int8 weights, not {spec}", at=node)
    return Accept()


def transposed_unlike_tosa(node: ir.Node) -> str:
    """What a ConvTranspose has that ``tosa.transpose_conv2d`` has not (explicit pads smaller than its
    kernel, dilated: ``(k - 1) d + 1``), or ``""``; groups are lowered one ``tosa.transpose_conv2d``
    each, a dilation as a kernel with zeros between its taps."""
    a = node.attributes
    if a.get_string("auto_pad", "NOTSET") not in ("NOTSET", "") or "output_shape" in a:
        return "explicit pads only (this one has auto_pad or output_shape)"
    weight = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    dilations = list(a.get_ints("dilations", [1, 1]))
    kernel = [(k - 1) * d + 1 for k, d in zip(weight.shape[2:], dilations, strict=False)] if weight is not None else []
    pads = list(a.get_ints("pads", [0, 0, 0, 0]))
    if len(kernel) == 2 and any(p >= kernel[i % 2] for i, p in enumerate(pads)):  # out_pad = -pad stays above -kernel
        return f"pads smaller than its kernel (this one has pads {pads}, kernel {kernel}, dilated)"
    return ""


def _not_lowered(match: Match, config: QuantizationConfig) -> Verdict:
    node = match.nodes[0]
    return Reject(f"the tosa-int8 backend does not lower {node.op_type} yet", at=node)


def _patterns() -> tuple[Pattern, ...]:
    chains: list[tuple[str, ...]] = [(op,) for op in PRODUCERS + STANDALONE]
    chains += [(p, a) for p in PRODUCERS for a in FOLDED_ACTIVATIONS]
    chains += [("Add", a) for a in FOLDED_ACTIVATIONS]
    later = ("LSTM", "GRU", "RNN")
    return (*(Pattern(chain, _check) for chain in chains), *(Pattern((op,), _not_lowered) for op in later))


def _nearest(node: ir.Node) -> bool:
    return node.attributes.get_string("mode", "nearest") == "nearest"


# TOSA's data-movement ops (and tosa.concat, tosa.resize NEAREST_NEIGHBOR) take and give one int8 type:
# where calibration left the input and the output on different ones, a rescale goes before the op
_ONE_TYPE = SameScale(RESCALE, "TOSA's op takes and gives one int8 type")
SAME_SCALE = {
    **dict.fromkeys(("MaxPool", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice"), _ONE_TYPE),
    **dict.fromkeys(("Pad", "Gather", "Concat", "ReduceMax"), _ONE_TYPE),
    "Resize": SameScale(RESCALE, _ONE_TYPE.why + " (a nearest one: a bilinear one rescales its sums)", _nearest),
}

_CONCAT_ONE_TYPE = Join(
    RESCALE,
    "integer-only: a Concat's inputs are rescaled to its one output type (no float op to keep it in); "
    "keep the model's head float on another target, or export it without the join",
)

TOSA_INT8 = SupportTable(
    "TOSA_INT8_SUPPORT",
    _patterns(),
    None,
    (DIV_TO_MUL, SUB_TO_ADD, BATCHNORM_TO_MUL_ADD, SPATIAL_MEAN),
    SAME_SCALE,
    joins={"Concat": _CONCAT_ONE_TYPE},
)

TOSA_INT32 = KernelModel(
    "TOSA int profile",
    "any TOSA 1.0 implementation of the int profile (IREE, the Arm Ethos-U flow): int32 accumulators",
    (KernelRule("tosa.conv2d, tosa.depthwise_conv2d, tosa.matmul (int32 accumulator)", _CONV | _LINEAR, INT32),),
)
