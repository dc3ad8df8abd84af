"""Targets by name: what a model is quantized for.

A target is data: its support table (which int8 kernels exist and which ports they take), its
kernel model (how those kernels add their products, :mod:`requant.targets.kernels`), and the
presets used when none is given (one for conv nets, one for models with more linear layers than
convolutions). The API, the CLI and the quantizers look targets up here by name; adding a target
is adding an entry.

Quantizing never looks at the CPU it runs on: the same model, data and options give the same
bytes on every machine. The target says which CPUs the output is exact on.
"""

from __future__ import annotations

from dataclasses import dataclass

from requant.errors import RequantError
from requant.targets.kernels import ONNXRUNTIME_X86, ONNXRUNTIME_X86_VNNI, KernelModel
from requant.targets.onnxruntime_cpu import ONNXRUNTIME_CPU
from requant.targets.table import SupportTable

__all__ = ["DEFAULT_TARGET", "TARGETS", "Target", "UnknownTargetError", "get_target"]


class UnknownTargetError(RequantError):
    """A target name that is not in the registry."""


@dataclass(frozen=True)
class Target:
    """A target: its name, what it is, its support table, kernel model and default presets."""

    name: str
    description: str
    table: SupportTable
    kernels: KernelModel
    presets: tuple[str, str]  # (conv nets, models with more linear layers than convolutions)

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
        ),
        Target(
            "onnxruntime-cpu-vnni",
            "ONNX Runtime's CPU provider on x86-64 CPUs with AVX-VNNI, AVX512-VNNI or AMX: full-range int8 "
            "weights (exact there; on CPUs without VNNI their int16 pair sums can saturate)",
            ONNXRUNTIME_CPU,
            ONNXRUNTIME_X86_VNNI,
            ("INT8_PER_CHANNEL_WEIGHTS", "INT8_FLOAT_OUTPUTS"),
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
