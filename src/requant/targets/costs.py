"""What ops cost on a runtime, in float and in int8, and what a conversion costs: a target's cost model.

Placement (:mod:`requant.quantizers.placement`) weighs these to decide whether a group of int8 ops
pays for itself: ONNX Runtime runs each elementwise op as one QLinear op, and on this kind of CPU
none is faster than its float version; int8 wins only where it saves the QuantizeLinear /
DequantizeLinear that float ops between int8 kernels need. The cost of an op is
``fixed_us + ns_per_element * elements / 1000`` (elements of its output; of its input for
GlobalAveragePool).

Measured with ``bench/bench_op_costs.py`` (chains of 2 and 10 ops, interleaved in one process, 2
threads, batch 1) on ONNX Runtime 1.31.1 with the AVX2 kernels of a CPU without VNNI
(``bench/ort_without_vnni.py`` on an AMD EPYC Zen 5), at 3,136 and 200,704 elements, 2026-11-25
(``bench/results/op_costs.json``). A QuantizeLinear and a DequantizeLinear were measured
as a pair (0.33 ns an element); each is modelled as half of it.

Modelled as costing the same either way (``free``): layout ops (Reshape, Transpose, Concat, Slice,
Resize, Pad, a Relu/Clip that a QuantizeLinear absorbs...), which move bytes or floats without
arithmetic (ONNX Runtime merges chains of them, so they cannot be measured in chains), and pools.
Pools were measured in context, between two int8 convs (``bench/bench_placement.py``): a float
MaxPool there brings NHWC transposes and NCHWc reorders besides its conversions, and was slower than
ONNX Runtime's ``NhwcMaxPool`` in 5 of 6 cases (3x3, 5x5 and 13x13 windows on 56x56 and 13x13 maps;
faster only with a 13x13 window on 56x56); a lone AveragePool there is fused whatever requant writes
(the target rewrites it as a depthwise conv where it can: ``AVERAGE_POOL_AS_DEPTHWISE``).

``fused_alone``: the ops ONNX Runtime fuses from ``DequantizeLinear -> op -> QuantizeLinear`` into its
int8 op whatever the quantization parameters (its unary, binary and variadic QDQ selectors): such an
op between int8 kernels cannot be kept float in a QDQ model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["KERNEL_CLASSES", "ONNXRUNTIME_X86_COSTS", "ONNXRUNTIME_X86_VNNI_COSTS", "CostModel", "KernelCost", "OpCost"]


@dataclass(frozen=True)
class OpCost:
    """``fixed_us`` a run plus ``ns_per_element`` for each element."""

    fixed_us: float
    ns_per_element: float

    def us(self, elements: float) -> float:
        return self.fixed_us + self.ns_per_element * elements / 1000.0


@dataclass(frozen=True)
class KernelCost:
    """A kernel class's cost in float and in int8 (``ns_per_element`` counts multiply-adds), and what
    a float one costs besides when an int8 kernel writes its input (``input_crossing``, per element of
    the input: the conversion, and the reorders into ONNX Runtime's float layout). Its output going
    back to int8 kernels was measured at about nothing (within -45 and +22 us at 200,704 elements)."""

    float_op: OpCost
    int8_op: OpCost
    input_crossing: OpCost


@dataclass(frozen=True)
class CostModel:
    """Measured costs of a runtime's ops: ``float_ops`` and ``int8_ops`` by op type (an op with no
    int8 entry has no int8 kernel: it runs in float between conversions), the conversions, the
    ``free`` ops modelled as costing the same either way, and the ops the runtime fuses into int8
    ones whenever it sees them between conversions (``fused_alone``)."""

    name: str
    float_ops: Mapping[str, OpCost]
    int8_ops: Mapping[str, OpCost]
    quantize: OpCost
    dequantize: OpCost
    free: frozenset[str]
    fused_alone: frozenset[str]
    kernels: Mapping[str, KernelCost] = field(default_factory=dict)  # by class: KERNEL_CLASSES

    def op_us(self, op_type: str, int8: bool, elements: float) -> float:
        """Modelled microseconds of one ``op_type`` on ``elements``; 0 for a free op."""
        if op_type in self.free:
            return 0.0
        table = self.int8_ops if int8 else self.float_ops
        return table[op_type].us(elements)


_PAIR = OpCost(0.22, 0.330)  # QuantizeLinear -> DequantizeLinear, measured together
_HALF = OpCost(_PAIR.fixed_us / 2, _PAIR.ns_per_element / 2)

# Kernel classes (requant.report.budget.kernel_class): 1x1 convs, depthwise convs, other convs (measured
# 3x3), linear layers (MatMul, Gemm, MatMulIntegerToFloat)
KERNEL_CLASSES = ("pointwise", "depthwise", "dense", "linear")

ONNXRUNTIME_X86_COSTS = CostModel(
    name="ONNX Runtime 1.31 CPU, AVX2 kernels, 2 threads (bench/bench_op_costs.py, 2026-11-25)",
    float_ops={
        "Add": OpCost(0.24, 0.059),
        "Mul": OpCost(0.26, 0.061),
        "Sigmoid": OpCost(0.47, 0.116),
        "LeakyRelu": OpCost(0.40, 0.095),
        "Softmax": OpCost(5.28, 0.165),
        "GlobalAveragePool": OpCost(2.63, 0.032),
    },
    int8_ops={
        "Add": OpCost(0.35, 0.057),  # QLinearAdd
        "Mul": OpCost(0.49, 0.096),  # QLinearMul
        "Sigmoid": OpCost(0.49, 0.125),  # QLinearSigmoid (a lookup table)
        "LeakyRelu": OpCost(0.49, 0.125),  # QLinearLeakyRelu (a lookup table)
        "Softmax": OpCost(3.22, 1.001),  # QLinearSoftmax: 6x float
        "GlobalAveragePool": OpCost(0.91, 0.028),  # QLinearGlobalAveragePool; elements of its input
    },
    quantize=_HALF,
    dequantize=_HALF,
    free=frozenset(
        {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather"}
        | {"Pad", "Resize", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Max", "Min", "Relu", "Clip"}
        | {"MaxPool", "AveragePool"}
    ),
    fused_alone=frozenset(
        {"Add", "Mul", "Sigmoid", "LeakyRelu", "Softmax", "AveragePool", "GlobalAveragePool", "Concat"}
    ),
    # bench/bench_kernel_costs.py (chains of 3 and 11 kernels, 64-channel pointwise and depthwise convs and
    # 32-channel 3x3 ones at 14x14 and 56x56, 384-wide linear layers on 16 and 128 tokens), AVX2
    # kernels, 40 rounds, 2026-11-25 (bench/results/kernel_costs.json). Int8 depthwise convs are slower
    # than float ones here (ONNX Runtime's NCHWc float kernel against MLAS's widening int8 one), but
    # a float one reading an int8 kernel's output costs more in conversion and reorders than it saves.
    # A float linear layer reading an int8 one's output measured no dearer (modelled free).
    kernels={
        "pointwise": KernelCost(OpCost(0.84, 0.0079), OpCost(1.19, 0.0047), OpCost(1.94, 0.503)),
        "depthwise": KernelCost(OpCost(0.84, 0.0145), OpCost(1.42, 0.0252), OpCost(6.95, 0.474)),
        "dense": KernelCost(OpCost(0.56, 0.0074), OpCost(1.49, 0.0042), OpCost(7.37, 2.216)),
        "linear": KernelCost(OpCost(3.69, 0.0083), OpCost(3.69, 0.0044), OpCost(0.0, 0.0)),
    },
)


_VNNI_PAIR = OpCost(0.40, 0.116)  # AVX-512 conversions: a third of the AVX2 ones' per-element cost

# The same ops with ONNX Runtime's own kernel choice on a CPU with AVX512-VNNI (AMD EPYC Zen 5; the
# onnxruntime-cpu-vnni target's CPUs), bench/bench_op_costs.py without the AVX2 copy, 2026-11-25
# (bench/results/op_costs_vnni.json). The int8 elementwise ops cost what they cost with
# AVX2; the conversions and the float pools are cheaper.
ONNXRUNTIME_X86_VNNI_COSTS = CostModel(
    name="ONNX Runtime 1.31 CPU, AVX512-VNNI kernels, 2 threads (bench/bench_op_costs.py, 2026-11-25)",
    float_ops={
        "Add": OpCost(0.29, 0.050),
        "Mul": OpCost(0.30, 0.051),
        "Sigmoid": OpCost(0.50, 0.107),
        "LeakyRelu": OpCost(0.43, 0.086),
        "Softmax": OpCost(4.91, 0.245),
        "GlobalAveragePool": OpCost(2.16, 0.010),
    },
    int8_ops={
        "Add": OpCost(0.39, 0.044),
        "Mul": OpCost(0.54, 0.084),
        "Sigmoid": OpCost(0.53, 0.113),
        "LeakyRelu": OpCost(0.53, 0.114),
        "Softmax": OpCost(3.26, 0.988),
        "GlobalAveragePool": OpCost(0.95, 0.015),
    },
    quantize=OpCost(_VNNI_PAIR.fixed_us / 2, _VNNI_PAIR.ns_per_element / 2),
    dequantize=OpCost(_VNNI_PAIR.fixed_us / 2, _VNNI_PAIR.ns_per_element / 2),
    free=ONNXRUNTIME_X86_COSTS.free,
    fused_alone=ONNXRUNTIME_X86_COSTS.fused_alone,
    # bench/bench_kernel_costs.py with ONNX Runtime's own kernels on the Zen 5, 2026-11-25
    # (bench/results/kernel_costs_vnni.json); a float linear layer reading an int8 one's output
    # measured cheaper than the sum of its parts (-6 and -61 us): modelled free
    kernels={
        "pointwise": KernelCost(OpCost(4.30, 0.0039), OpCost(3.85, 0.0012), OpCost(20.4, 0.236)),
        "depthwise": KernelCost(OpCost(1.46, 0.0072), OpCost(1.55, 0.0137), OpCost(8.07, 0.534)),
        "dense": KernelCost(OpCost(1.44, 0.0040), OpCost(1.45, 0.0014), OpCost(7.64, 1.738)),
        "linear": KernelCost(OpCost(6.50, 0.0085), OpCost(7.92, 0.0032), OpCost(0.0, 0.0)),
    },
)
