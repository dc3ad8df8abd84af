"""Targets by name: what a model is quantized for.

A target is data: its support table (which int8 kernels exist and which ports they take), its
kernel model (how those kernels add their products, :mod:`requant.targets.kernels`), its cost
model (what its ops cost in float and int8, :mod:`requant.targets.costs`: where int8 ends), the
presets used when none is given (one for conv nets, one for models with more linear layers than
convolutions), and its backend: ``qdq`` (a QDQ ONNX model, which ONNX Runtime fuses into int8
kernels), ``tosa`` (integer-only TOSA MLIR, :mod:`requant.backends.tosa`, lowered from the QDQ
model) or ``executorch`` (a PyTorch program quantized through PT2E, lowered to a ``.pte``:
:mod:`requant.pt2e`, :mod:`requant.backends.executorch`). The API, the CLI and the quantizers look
targets up here by name; adding a target is adding an entry (and, for a new kind of output, a backend).

Quantizing never looks at the CPU it runs on: the same model, data and options give the same
bytes on every machine. The target says which CPUs the output is exact on.
"""

from __future__ import annotations

from dataclasses import dataclass

from requant.errors import RequantError
from requant.targets.costs import ONNXRUNTIME_X86_COSTS, ONNXRUNTIME_X86_VNNI_COSTS, CostModel
from requant.targets.kernels import ONNXRUNTIME_X86, ONNXRUNTIME_X86_VNNI, KernelModel
from requant.targets.onnxruntime_cpu import ONNXRUNTIME_CPU
from requant.targets.table import SupportTable
from requant.targets.tosa_int8 import TOSA_INT8, TOSA_INT32
from requant.targets.xnnpack import XNNPACK_INT32, XNNPACK_TABLE
from requant.transforms.smoothing import DEFAULT_ALPHA

__all__ = ["DEFAULT_TARGET", "TARGETS", "Target", "UnknownTargetError", "get_target"]


class UnknownTargetError(RequantError):
    """A target name that is not in the registry."""


@dataclass(frozen=True)
class Target:
    """A target: its name, what it is, its support table, kernel model, default presets, backend and
    cost model."""

    name: str
    description: str
    table: SupportTable
    kernels: KernelModel
    presets: tuple[str, str]  # (conv nets, models with more linear layers than convolutions)
    # "qdq": the QDQ ONNX model; "tosa": integer-only TOSA MLIR lowered from it; "executorch": a PyTorch
    # program quantized through PT2E and lowered to a .pte (requant.pipeline.quantize_pt2e)
    backend: str = "qdq"
    # what its ops and kernels cost, for placement and the accuracy budget's choice (None: every int8 op
    # the table allows is placed int8, and the budget keeps the fewest kernels float)
    costs: CostModel | None = None
    # passes run after canonicalize for this target (by name): rewrites its backend needs, such as a
    # LayerNorm written out fused into the op tosa-int8 lowers (the model's opset raised where one needs it)
    passes: tuple[str, ...] = ()
    # nothing computes in float on it: no op can be kept float (smoothing's Muls become rescales; the
    # remedies that keep ops float for accuracy or speed do not apply, and the report says so)
    integer_only: bool = False
    # SmoothQuant's alpha when the smoothing option is not given (executorch-xnnpack: its linear inputs are
    # quantized per call, per tensor, where 0.5 measured best; requant.pt2e.smooth)
    smoothing_alpha: float = DEFAULT_ALPHA

    def __str__(self) -> str:
        return self.name


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "onnxruntime-cpu",
            "ONNX Runtime's CPU provider on any x86-64 CPU: int8 weights encoded so that no int16 pair "
            "sum of the uint8 x int8 kernels can saturate on CPUs without VNNI (exact everywhere)",
            ONNXRUNTIME_CPU,
            ONNXRUNTIME_X86,
            ("INT8_PER_CHANNEL_WEIGHTS", "INT8_FLOAT_OUTPUTS"),
            costs=ONNXRUNTIME_X86_COSTS,
        ),
        Target(
            "onnxruntime-cpu-vnni",
            "ONNX Runtime's CPU provider on x86-64 CPUs with AVX-VNNI, AVX512-VNNI or AMX: full-range int8 "
            "weights (exact there; on CPUs without VNNI their int16 pair sums can saturate)",
            ONNXRUNTIME_CPU,
            ONNXRUNTIME_X86_VNNI,
            ("INT8_PER_CHANNEL_WEIGHTS", "INT8_FLOAT_OUTPUTS"),
            costs=ONNXRUNTIME_X86_VNNI_COSTS,
        ),
        Target(
            "tosa-int8",
            "TOSA 1.0, int profile (integer-only MLIR for IREE and the Arm Ethos-U flow): int8 activations, "
            "symmetric int8 weights per channel, int32 biases and accumulators, fixed-point rescales",
            TOSA_INT8,
            TOSA_INT32,
            ("INT8_PER_CHANNEL_WEIGHTS", "INT8_PER_CHANNEL_WEIGHTS"),  # no float outputs: integer-only
            backend="tosa",
            passes=("fuse-layer-norm", "fuse-l2-normalize"),
            integer_only=True,
        ),
        Target(
            "executorch-xnnpack",
            "ExecuTorch with its XNNPACK delegate (phones, edge boards, x86 servers): a PyTorch program "
            "quantized through PT2E (requant's annotations) and lowered to a .pte; int8 activations, "
            "symmetric int8 weights per channel, float biases (XNNPACK quantizes them)",
            XNNPACK_TABLE,
            XNNPACK_INT32,
            ("INT8_FLOAT_BIAS", "INT8_DYNAMIC_LINEAR"),
            backend="executorch",
            smoothing_alpha=0.5,
        ),
    )
}
DEFAULT_TARGET = "onnxruntime-cpu"


def get_target(name: str) -> Target:
    """The target called ``name``; an error listing the known ones otherwise."""
    target = TARGETS.get(name) if isinstance(name, str) else None
    if target is None:
        raise UnknownTargetError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return target
