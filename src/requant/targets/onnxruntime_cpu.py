"""ONNX Runtime on x86 CPUs: the kernels its QDQ fusion turns into int8 ops, as a support table.

ONNX Runtime fuses ``DequantizeLinear -> op -> QuantizeLinear`` into QLinearConv, QGemm,
QLinearMatMul (or MatMulInteger), QLinearAdd, QLinearMul, QLinearSigmoid,
QLinearLeakyRelu, QLinearAveragePool, QLinearGlobalAveragePool, QLinearConcat...; a Relu or Clip
right after a conv or matmul is folded into that kernel's output range. The table is built from
a few lists rather than written out pattern by pattern.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import onnx_ir as ir

from requant.ir.queries import constant
from requant.ir.requests import NoQuant, QuantizationSpec
from requant.ir.traits import WEIGHTED
from requant.passes.order_gelu import members
from requant.targets.bins import REASON, in_bin_expectation, kept_float
from requant.targets.constraints import RUNTIME_FLOAT, Join, SameScale
from requant.targets.decompose import (
    AVERAGE_POOL_AS_DEPTHWISE,
    BATCHNORM_TO_MUL_ADD,
    DIV_TO_MUL,
    HARD_SIGMOID,
    HARD_SWISH,
    PAD_CONV_CHANNELS,
    SPATIAL_MEAN,
    SUB_TO_ADD,
)
from requant.targets.gates import gate_ops
from requant.targets.table import Accept, Match, Pattern, Reject, SupportTable, Verdict, non_float, sums_activations

if TYPE_CHECKING:
    from requant.quantizers.config import QuantizationConfig

__all__ = ["ACTIVATION_DTYPES", "ONNXRUNTIME_CPU", "WEIGHT_DTYPES"]

ACTIVATION_DTYPES = ("uint8", "int8", "uint16", "int16")
WEIGHT_DTYPES = ("int8", "uint8", "int4", "uint4")
PRODUCERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FOLDED_ACTIVATIONS = ("Relu", "Clip")
STANDALONE = ("Add", "Mul", "Relu", "Clip", "Sigmoid", "LeakyRelu", "AveragePool", "GlobalAveragePool", "Softmax")


def _check_activation(spec: object, what: str) -> Verdict:
    if isinstance(spec, QuantizationSpec):
        if spec.dtype not in ACTIVATION_DTYPES:
            return Reject(
                f"{what} {spec.dtype} is not an activation type ONNX Runtime runs ({', '.join(ACTIVATION_DTYPES)})"
            )
        if spec.granularity != "per_tensor":
            return Reject(f"{what} must be per tensor on ONNX Runtime, not {spec.granularity}")
    return Accept()


def _check_weighted(node_match: Match, config: QuantizationConfig) -> Verdict:
    node = node_match.nodes[0]
    weight_index, _ = WEIGHTED[node.op_type]
    weight = node.inputs[weight_index]
    data = constant(weight)
    spec = config.weight
    if data is None:
        if node.op_type == "MatMul":  # two activations: QLinearMatMul takes both quantized
            return Accept()
        return Reject(f"{node.op_type} weight '{weight.name if weight else '?'}' is not a constant", at=node)
    if node.op_type == "ConvTranspose":
        return Reject(
            "ONNX Runtime 1.31's CPU provider has no int8 ConvTranspose (its QDQ fusion leaves it float "
            "between DequantizeLinear and QuantizeLinear): quantizing its input and weight would only add "
            "rounding and conversions",
            at=node,
        )
    if node.op_type == "Conv" and data.ndim not in (3, 4, 5):
        return Reject(f"ONNX Runtime's int8 {node.op_type} is 1-d to 3-d; this one is {data.ndim - 2}-d", at=node)
    if isinstance(spec, QuantizationSpec):
        if spec.dtype not in WEIGHT_DTYPES:
            return Reject(
                f"weight dtype {spec.dtype} is not one ONNX Runtime runs ({', '.join(WEIGHT_DTYPES)})", at=node
            )
        if spec.granularity == "blockwise":
            if node.op_type not in ("MatMul", "Gemm"):
                return Reject(f"blockwise weights run in MatMul and Gemm only, not {node.op_type}", at=node)
            activation = config.input_activation
            if spec.dtype in ("int8", "uint8") and isinstance(activation, QuantizationSpec):
                return Reject(
                    "ONNX Runtime 1.31 mis-fuses 8-bit activations with blockwise 8-bit weights in MatMul",
                    at=node,
                )
        if spec.dtype in ("int4", "uint4") and spec.granularity != "blockwise" and node.op_type != "MatMul":
            return Reject(f"4-bit weights need blockwise granularity on ONNX Runtime ({node.op_type})", at=node)
    return Accept()


def _check(match: Match, config: QuantizationConfig) -> Verdict:
    integer = non_float(match)
    if integer is not None:
        return Reject(
            f"computes on {integer}, not float activations (shape arithmetic stays as it is)", at=match.nodes[0]
        )
    for what, spec in (("input activation", config.input_activation), ("output activation", config.output_activation)):
        verdict = _check_activation(spec, what)
        if not verdict.accepted:
            return verdict
    if config.float_output:
        verdict = _check_float_output(match.nodes[0])
        if not verdict.accepted:
            return verdict
    quantized_input = isinstance(config.input_activation, QuantizationSpec)
    decoding = next((n for n in match.nodes if in_bin_expectation(n)), None) if quantized_input else None
    if decoding is not None:
        return Reject(REASON, at=decoding)
    if quantized_input and sums_activations(match):
        return Reject(
            "a sum of two activations (a residual connection) stays float: the kernels that read it "
            "quantize it, the stream itself is not rounded at every block (MobileNetV2 KL to float "
            "0.083 -> 0.065; ONNX Runtime's float Add is as fast as QLinearAdd there)",
            at=match.nodes[0],
        )
    if match.nodes[0].op_type in WEIGHTED and not isinstance(config.weight, NoQuant):
        return _check_weighted(match, config)
    return Accept()


def _check_float_output(node: ir.Node) -> Verdict:
    """Quantized inputs, float output: only MatMulIntegerToFloat (a MatMul with a constant weight)
    and QGemm compute that in int8; anything else would run in float between a DequantizeLinear
    and nothing, the inputs' quantization pure loss."""
    if node.op_type == "Gemm" or (node.op_type == "MatMul" and constant(node.inputs[1]) is not None):
        return Accept()
    return Reject(
        f"ONNX Runtime has no int8 {node.op_type} with a float output (MatMul with a constant weight "
        "and Gemm have: MatMulIntegerToFloat, QGemm)",
        at=node,
    )


def _check_lstm(match: Match, config: QuantizationConfig) -> Verdict:
    """An LSTM runs as ``DynamicQuantizeLSTM``: uint8 inputs quantized by the kernel from each run's
    range (its input projection once per run, the hidden state at every step), 8-bit weights per
    gate row, float bias, gates and states."""
    node = match.nodes[0]
    spec = config.weight
    if isinstance(spec, NoQuant):  # a float config (a node the user or a rule names float): kept float, claimed
        return Accept()
    if not isinstance(spec, QuantizationSpec):
        return Reject("the config keeps weights float, and an LSTM's int8 kernel only quantizes weights", at=node)
    if spec.dtype not in ("int8", "uint8") or spec.granularity == "blockwise":
        why = f"{spec.dtype} {spec.granularity.replace('_', '-')} weights"
        return Reject(f"DynamicQuantizeLSTM takes 8-bit weights per tensor or per gate row, not {why}", at=node)
    if spec.dtype == "uint8" and not spec.symmetric:
        return Reject("DynamicQuantizeLSTM takes uint8 weights with one zero point for all rows", at=node)
    layout = node.attributes.get("layout")
    if layout is not None and layout.as_int() != 0:
        return Reject("ONNX Runtime 1.31 runs no batch-first (layout=1) LSTM, float or int8", at=node)
    for index in (1, 2):
        value = node.inputs[index] if index < len(node.inputs) else None
        data = constant(value)
        if data is None or data.ndim != 3:
            name = value.name if value is not None else "?"
            return Reject(f"LSTM weight '{name}' is not a constant [directions, 4 x hidden, size] tensor", at=node)
    return Accept()


def _no_int8_rnn(match: Match, config: QuantizationConfig) -> Verdict:
    node = match.nodes[0]
    return Reject(
        f"ONNX Runtime 1.31 has no int8 {node.op_type} kernel (only LSTM: DynamicQuantizeLSTM); its weights stay float",
        at=node,
    )


_GELU = (
    "a GELU written out with erf: its five ops run as ONNX Runtime's one float Gelu kernel (order-gelu, fused_gelu); "
    "rounding its inside to int8 loses 2-4 dB a block (PP-OCR's detector), its output is quantized by what reads it"
)


def _float_ops(graph: ir.Graph) -> dict[str, str]:
    """The ops computed in float where they stand, with why: each written-out erf GELU's in ONNX Runtime's order,
    each squeeze-and-excitation gate's per-channel ones."""
    return {**dict.fromkeys(members(graph), _GELU), **gate_ops(graph)}


def _patterns() -> tuple[Pattern, ...]:
    chains: list[tuple[str, ...]] = [(op,) for op in PRODUCERS + STANDALONE]
    chains += [(p, a) for p in PRODUCERS for a in FOLDED_ACTIVATIONS]  # conv/matmul + folded activation
    chains += [("Add", a) for a in FOLDED_ACTIVATIONS]  # residual sum + activation
    chains += [("MatMul", "Add"), ("MatMul", "Add", "Relu")]  # linear layers exporters did not fuse
    recurrent = (Pattern(("LSTM",), _check_lstm, dynamic=True), Pattern(("GRU",), _no_int8_rnn))
    return (*(Pattern(chain, _check) for chain in chains), *recurrent, Pattern(("RNN",), _no_int8_rnn))


def is_depthwise(node: ir.Node) -> bool:
    """A Conv whose every group has one input channel (weight ``[C*m, 1, kh, kw]``, ``group > 1``)."""
    group = node.attributes.get("group")
    weight = constant(node.inputs[1]) if node.op_type == "Conv" and len(node.inputs) > 1 else None
    return group is not None and group.as_int() > 1 and weight is not None and weight.shape[1] == 1


def _weight_rule(node: ir.Node, weight: ir.Value, spec: QuantizationSpec) -> tuple[QuantizationSpec, str]:
    """Depthwise convs get full-range int8 weights when the config asks for a reduced range or uint8;
    an LSTM's per-channel weights get one scale per direction and gate row.

    uint8 weights exist for ONNX Runtime's exact uint8 x uint8 GEMM; its uint8-weight depthwise
    kernel is a slow path (measured on EfficientNet-Lite0, ONNX Runtime 1.31: a 5x5 depthwise
    QLinearConv takes 17 ms with uint8 weights, 0.15 ms with int8). The reduced range exists for
    the uint8 x int8 GEMM kernels of x86 CPUs without VNNI, which add pairs of products in int16
    and saturate. ONNX Runtime's depthwise kernel accumulates each product in int32: measured on
    EfficientNet-Lite0, the same per-tensor SQNR with its int8 kernels as with float math on the
    dequantized values, and KL divergence to the float model 0.106 -> 0.058 against 7-bit
    depthwise weights.
    """
    if (spec.reduce_range or spec.dtype == "uint8") and is_depthwise(node):
        note = "depthwise Conv: full-range int8 weights (int32 kernel)"
        return dataclasses.replace(spec, dtype="int8", reduce_range=False), note
    if node.op_type == "LSTM" and spec.granularity == "per_axis" and weight.shape is not None:
        # DynamicQuantizeLSTM's scales are [directions, 4 x hidden]: blocks spanning the reduction axis
        size = weight.shape[-1]
        if isinstance(size, int):
            note = "LSTM: a scale per direction and gate row"
            return dataclasses.replace(spec, granularity="blockwise", axis=2, block_size=size), note
    return spec, ""


# ONNX Runtime 1.31's QDQ transformer drops the DequantizeLinear and QuantizeLinear around these (the op
# then moves integers) only where both have the same scale and zero point (its DropQDQNodesRules and
# SplitQDQRules, qdq_selector_action_transformer.cc); otherwise the op runs in float between them
_DROPS_QDQ = SameScale(
    RUNTIME_FLOAT,
    "ONNX Runtime moves its integers only where its input and output share a scale and zero point; "
    "here it computes it in float between a DequantizeLinear and a QuantizeLinear",
)

_CONCAT_FLOAT = Join(
    RUNTIME_FLOAT,
    "ONNX Runtime computes a Concat kept float between its inputs' DequantizeLinears: each input keeps its own "
    "type (the ops before it stay int8), the output is float",
)

ONNXRUNTIME_CPU = SupportTable(
    "ONNXRUNTIME_CPU_SUPPORT",
    _patterns(),
    _weight_rule,
    (
        *(DIV_TO_MUL, SUB_TO_ADD, BATCHNORM_TO_MUL_ADD, PAD_CONV_CHANNELS, HARD_SIGMOID, HARD_SWISH, SPATIAL_MEAN),
        AVERAGE_POOL_AS_DEPTHWISE,
    ),
    dict.fromkeys(("MaxPool", "Resize", "Gather", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Split"), _DROPS_QDQ),
    lambda node: _check_float_output(node).accepted,
    {"Concat": _CONCAT_FLOAT},
    kept_float,
    _float_ops,
)
