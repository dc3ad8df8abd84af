"""Quantization configs: the requests for a kernel's input activations, output activations, weights and bias.

A config is what a user picks ("int8 with per-channel weights"); a target turns it into the
exact request for each port of each kernel (a ConvTranspose's per-channel axis is 1, not 0; a
bias's scale is derived from the actual input and weight). Configs are frozen, named, and
validated on construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import onnx_ir as ir

from requant.ir.queries import weighted_layers
from requant.ir.requests import DTYPES, FixedSpec, NoQuant, QuantizationSpec, RequestError

__all__ = [
    "A16W8",
    "DEFAULT_PRESET",
    "INT4_BLOCKWISE_WEIGHTS",
    "INT8_DYNAMIC_LINEAR",
    "INT8_FLOAT_BIAS",
    "INT8_FLOAT_OUTPUTS",
    "INT8_PER_CHANNEL_WEIGHTS",
    "INT8_PER_TENSOR",
    "INT8_REDUCED_RANGE_WEIGHTS",
    "LINEAR_DEFAULT_PRESET",
    "PRESETS",
    "UINT8_FLOAT_OUTPUTS",
    "UINT8_PER_CHANNEL_WEIGHTS",
    "DerivedBias",
    "QuantizationConfig",
    "choose_preset",
]


@dataclass(frozen=True)
class DerivedBias:
    """A bias quantized from its kernel's input and weight: scale = input scale x weight scale, zero point 0."""

    dtype: str = "int32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise RequestError(f"bias dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    def __str__(self) -> str:
        return f"derived<{self.dtype}, input scale x weight scale>"


ActivationRequest = QuantizationSpec | FixedSpec | NoQuant
WeightRequest = QuantizationSpec | NoQuant
BiasRequest = DerivedBias | QuantizationSpec | NoQuant


@dataclass(frozen=True)
class QuantizationConfig:
    """The requests a pattern's ports get; ``None`` leaves that kind of port to other quantizers."""

    name: str
    input_activation: ActivationRequest | None = None
    output_activation: ActivationRequest | None = None
    weight: WeightRequest | None = None
    bias: BiasRequest | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RequestError(f"a QuantizationConfig needs a name, got {self.name!r}")
        allowed = {
            "input_activation": (QuantizationSpec, FixedSpec, NoQuant),
            "output_activation": (QuantizationSpec, FixedSpec, NoQuant),
            "weight": (QuantizationSpec, NoQuant),
            "bias": (DerivedBias, QuantizationSpec, NoQuant),
        }
        for port, kinds in allowed.items():
            value = getattr(self, port)
            if value is not None and not isinstance(value, kinds):
                names = ", ".join(k.__name__ for k in kinds)
                raise RequestError(f"{self.name}: {port} must be one of {names} or None, got {value!r}")

    def __str__(self) -> str:
        return self.name

    @property
    def quantizes(self) -> bool:
        """Whether the kernels it accepts compute in integers: their inputs or weights get quantized
        (``FLOAT`` and ``FLOAT_KERNEL`` do not)."""
        return isinstance(self.input_activation, (QuantizationSpec, FixedSpec)) or isinstance(
            self.weight, QuantizationSpec
        )

    @property
    def float_output(self) -> bool:
        """Quantized inputs, a float output: a kernel like MatMulIntegerToFloat (``UINT8_FLOAT_OUTPUTS``)."""
        return isinstance(self.input_activation, QuantizationSpec) and isinstance(self.output_activation, NoQuant)


_U8 = QuantizationSpec("uint8", symmetric=False)
_I8_WEIGHT = QuantizationSpec("int8", symmetric=True)
_I8_PER_CHANNEL = QuantizationSpec("int8", symmetric=True, granularity="per_axis", axis=0)

# Presets. Activations are uint8 (affine) and weights int8 (symmetric): what ONNX Runtime's x86 int8
# kernels run fastest. The per-channel axis is the output-channel axis of the usual layout (0);
# targets adjust it per op.
INT8_PER_TENSOR = QuantizationConfig("INT8_PER_TENSOR", _U8, _U8, _I8_WEIGHT, DerivedBias())
INT8_PER_CHANNEL_WEIGHTS = QuantizationConfig("INT8_PER_CHANNEL_WEIGHTS", _U8, _U8, _I8_PER_CHANNEL, DerivedBias())
# 7-bit weights ([-64, 63]): on x86 CPUs without VNNI, ONNX Runtime's uint8 x int8 kernels add
# pairs of products in int16 (vpmaddubsw), which saturates with full-range weights.
INT8_REDUCED_RANGE_WEIGHTS = QuantizationConfig(
    "INT8_REDUCED_RANGE_WEIGHTS", _U8, _U8, dataclasses.replace(_I8_PER_CHANNEL, reduce_range=True), DerivedBias()
)
# uint8 weights, symmetric about 128, per channel: full 8-bit weights that ONNX Runtime's x86
# kernels multiply exactly (its uint8 x uint8 GEMM widens to int16 before adding pairs), on every
# CPU. Depthwise convs get int8 weights from the ONNX Runtime target's weight rule (its uint8-weight
# depthwise kernel is ~100x slower).
UINT8_PER_CHANNEL_WEIGHTS = QuantizationConfig(
    "UINT8_PER_CHANNEL_WEIGHTS", _U8, _U8, dataclasses.replace(_I8_PER_CHANNEL, dtype="uint8"), DerivedBias()
)
# Quantized inputs and weights, float outputs: ONNX Runtime's MatMulIntegerToFloat and QGemm, the
# kernels its dynamic quantization uses, with calibrated input ranges. For transformers, whose
# linear layers feed float LayerNorm, GELU and residual sums: quantizing those outputs is pure loss
# (all-MiniLM-L6-v2 cosine 0.871 -> 0.99). Other ops are rejected with the reason and stay float.
UINT8_FLOAT_OUTPUTS = QuantizationConfig(
    "UINT8_FLOAT_OUTPUTS", _U8, NoQuant(), UINT8_PER_CHANNEL_WEIGHTS.weight, NoQuant()
)
# The same with int8 weights (per channel): faster than uint8 weights (MiniLM 0.39 against 0.44 of
# float latency, bench 2026-11-24 on a VNNI CPU), the default for linear-layer models on both targets.
# On onnxruntime-cpu the weights are encoded so no int16 pair can saturate
# (requant.encoding.weight_encoding); with smoothing (requant.transforms.smoothing) MiniLM's cosine
# to float is 0.9981 against 0.9982 with uint8 weights (0.9929 / 0.9931 unsmoothed).
INT8_FLOAT_OUTPUTS = QuantizationConfig("INT8_FLOAT_OUTPUTS", _U8, NoQuant(), _I8_PER_CHANNEL, NoQuant())
A16W8 = QuantizationConfig(
    "A16W8", QuantizationSpec("uint16"), QuantizationSpec("uint16"), _I8_PER_CHANNEL, DerivedBias()
)
# ExecuTorch's XNNPACK delegate (its QS8 kernels): int8 activations (affine), symmetric int8 weights per
# channel in [-127, 127], biases float (an int32 bias made its partitioner refuse the convolutions:
# requant.targets.xnnpack); what ExecuTorch's XNNPACKQuantizer asks for, per channel.
INT8_FLOAT_BIAS = QuantizationConfig(
    "INT8_FLOAT_BIAS",
    QuantizationSpec("int8"),
    QuantizationSpec("int8"),
    QuantizationSpec("int8", symmetric=True, narrow_range=True, granularity="per_axis", axis=0),
    NoQuant(),
)
# The same for linear layers with their inputs quantized at run time, per call (dynamic), and float
# outputs: XNNPACK's QD8 kernels. For transformers on executorch-xnnpack: all-MiniLM-L6-v2's cosine to
# float 0.999 (static int8 everywhere: 0.83, its LayerNorm, GELU and residual sums on int8 types).
INT8_DYNAMIC_LINEAR = QuantizationConfig(
    "INT8_DYNAMIC_LINEAR",
    QuantizationSpec("int8", dynamic=True),
    NoQuant(),
    INT8_FLOAT_BIAS.weight,
    NoQuant(),
)
INT4_BLOCKWISE_WEIGHTS = QuantizationConfig(
    "INT4_BLOCKWISE_WEIGHTS",
    NoQuant(),
    NoQuant(),
    QuantizationSpec("int4", symmetric=True, granularity="blockwise", axis=0, block_size=32),
    NoQuant(),
)
# The defaults of `requant quantize` and `requant.quantize` for the onnxruntime-cpu target (each
# target names its own, requant.targets.registry). Conv nets: int8 weights, which the target's
# kernel model encodes so that no int16 pair sum can saturate on x86 CPUs without VNNI: exact on
# every CPU, at full int8 speed (MobileNetV2 0.71 of float latency against 0.91 with uint8
# weights, top-1 agreement 0.867 against 0.877; bench 2026-11-24). Full-range int8 weights would be
# wrong on those CPUs, 7-bit ones lose accuracy. A fixed choice, never a CPU-flag probe: the same
# inputs give the same model everywhere.
DEFAULT_PRESET = "INT8_PER_CHANNEL_WEIGHTS"
# Models with more linear layers than convolutions (transformers, MLPs): their linear layers feed
# ops ONNX Runtime runs in float (LayerNorm, GELU, residual sums). uint8 weights (exact uint8 x
# uint8 kernel): MiniLM keeps cosine 0.993 at 0.52 of float latency.
LINEAR_DEFAULT_PRESET = "INT8_FLOAT_OUTPUTS"


def choose_preset(
    model: ir.Model, presets: tuple[str, str] = (DEFAULT_PRESET, LINEAR_DEFAULT_PRESET)
) -> tuple[str, str]:
    """The preset used when none is given, and why: a rule on the model's weighted ops, never a guess.

    ``presets``: the one for conv nets and the one for models with more linear layers than
    convolutions (a target's, :mod:`requant.targets.registry`).
    """
    linear, convs = weighted_layers(model.graph)
    counts = f"linear layers: {linear}, convolutions: {convs}"
    conv_preset, linear_preset = presets
    if linear > convs:
        return linear_preset, f"{counts}; int8 linear layers with float outputs"
    return conv_preset, f"{counts}; int8 kernels"


PRESETS: dict[str, QuantizationConfig] = {
    c.name: c
    for c in (
        INT8_PER_TENSOR,
        INT8_PER_CHANNEL_WEIGHTS,
        INT8_REDUCED_RANGE_WEIGHTS,
        UINT8_PER_CHANNEL_WEIGHTS,
        UINT8_FLOAT_OUTPUTS,
        INT8_FLOAT_OUTPUTS,
        A16W8,
        INT8_FLOAT_BIAS,
        INT8_DYNAMIC_LINEAR,
        INT4_BLOCKWISE_WEIGHTS,
    )
}
