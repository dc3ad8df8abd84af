"""Stages lower and check of the ``executorch-xnnpack`` target: the converted program as a ``.pte``, run
by ExecuTorch's runtime against the program it was lowered from, against float, and timed.

- lower: ``torch.export`` of the converted PT2E module, XNNPACK's partitioner, ``to_executorch``
  (:func:`requant.backends.executorch.lower_to_pte`): the ``.pte`` and its delegation coverage;
- the ``.pte`` against its program: both run on the first calibration samples; the ``.pte`` must be as
  close to float as the converted module is (within ``GAP_DB``, or ``FLOAT_DB`` from float: float up to the
  kernels' last digits): a ``.pte`` further away computes other
  numbers than the program it came from (a runtime or delegate fault, not quantization), and requant
  refuses it (:class:`~requant.backends.executorch.lower.LoweringError`, nothing written), naming the
  first op whose lowered prefix departs (:mod:`requant.stages.pte_bisect`);
- against float: top-1 agreement, cosine, SQNR of the first output on the evaluation data (or the
  samples the method was chosen on), as for every target (:mod:`requant.report.agreement`); every output,
  part by part, is the outputs stage's (:mod:`requant.stages.pte_outputs`);
- speed: the float program lowered the same way, both ``.pte`` timed interleaved in one process
  (batch 1, medians of alternating blocks); an int8 ``.pte`` no faster is said first
  (``SLOWER THAN FLOAT``).

Reads: the exported float program, the converted module, the samples, the options (eval data,
measure). Records: ``executorch`` (coverage, size, the ``.pte`` against its program), ``evaluation``,
``latency_ms_batch1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from requant.options import Options
from requant.report.agreement import Reference, agreement
from requant.report.latency import interleaved_latency_ms

if TYPE_CHECKING:  # torch and executorch are the executorch extra's: imported where this target runs
    from requant.backends.executorch import Lowered, PteSession
    from requant.backends.executorch.lower import LoweringError
    from requant.calibration.samples import Samples
    from requant.stages.pt2e import Exported

__all__ = ["FLOAT_DB", "GAP_DB", "check_pte", "examples", "lines", "lower_converted", "same"]

GAP_DB = 3.0  # the .pte's noise against float may exceed its program's by this much (2x the power)
# a .pte this close to float is float up to its kernels' last digits, whatever its program's figure: with every
# op kept float (an accuracy budget's try), the digits CNN's .pte read 130.5 dB from float, its program 137.7
FLOAT_DB = 60.0
CHECK_SAMPLES = 8  # calibration samples the .pte and its program both run
BISECT_SAMPLES = 4  # those the lowered prefixes run, when the .pte departs (each prefix is lowered and run)


def lower_converted(exported: Exported, converted: Any, example: tuple[Any, ...] | None = None) -> Lowered:
    """The converted module exported again (from contiguous examples, or ``example``) and lowered."""
    import torch

    from requant.backends.executorch import lower_to_pte
    from requant.backends.executorch.lower import LoweringError

    try:
        program = torch.export.export(converted, example or examples(exported))
    except Exception as exc:
        raise LoweringError(f"the converted PT2E module cannot be exported: {type(exc).__name__}: {exc}") from exc
    return lower_to_pte(program)


def examples(exported: Exported) -> tuple[Any, ...]:
    """Contiguous zeros of the program's inputs' shapes and dtypes (what its samples are checked against)."""
    from requant.backends.executorch.runtime import contiguous

    inputs = exported.signature.graph.inputs
    return tuple(contiguous(np.zeros(v.shape.numpy(), v.dtype.numpy())) for v in inputs)  # type: ignore[union-attr]


def _against_program(exported: Exported, converted: Any, pte: PteSession, samples: Samples) -> dict[str, Any]:
    from requant.backends.executorch import ModuleSession
    from requant.pt2e.fused import fused

    first = samples.head(exported.signature, CHECK_SAMPLES)
    converted_run = ModuleSession(fused(converted), exported.names)  # the converted numbers, in half the time
    program = agreement(exported.signature, exported.reference, converted_run, first)
    lowered = agreement(exported.signature, exported.reference, pte, first)
    gap = program["sqnr_db"] - lowered["sqnr_db"]
    return {"samples": len(first), "program_sqnr_db": program["sqnr_db"], "pte_sqnr_db": lowered["sqnr_db"],
            "program_top1": program["top1_agreement"], "pte_top1": lowered["top1_agreement"],
            "gap_db": gap, "same": same(lowered["sqnr_db"], program["sqnr_db"])}  # fmt: skip


def same(pte_db: float, program_db: float) -> bool:
    """Whether a ``.pte`` ``pte_db`` from float computes what its program (``program_db``) does."""
    return pte_db >= program_db - GAP_DB or pte_db >= FLOAT_DB


def _refusal(exported: Exported, converted: Any, lowered: Lowered, against: dict[str, Any], samples: Samples,
             example: tuple[Any, ...] | None) -> LoweringError:  # fmt: skip
    """The error that refuses a ``.pte`` departing from its program, with the first op that departs."""
    from requant.backends.executorch.lower import LoweringError
    from requant.stages.pte_bisect import departing_op

    found = departing_op(exported, converted, samples.head(exported.signature, BISECT_SAMPLES),
                         example or examples(exported))  # fmt: skip
    where = "every op's lowered prefix computes what the program does: the departure is after its last op"
    if found:
        where = (f"the first op whose lowered prefix departs: {found[0]} ({found[1]}), {found[2]:.1f} dB from float "
                 f"as lowered, {found[3]:.1f} dB as the program computes it")  # fmt: skip
    return LoweringError(
        f"the .pte computes other numbers than the program it was lowered from: on {against['samples']} "
        f"calibration samples its output is {against['pte_sqnr_db']:.1f} dB from float, the program's "
        f"{against['program_sqnr_db']:.1f} dB (top-1 agreement {against['pte_top1']:.2f} against "
        f"{against['program_top1']:.2f}); {where}; not written. Delegated: {lowered.section()['delegated']}"
    )


def check_pte(exported: Exported, converted: Any, lowered: Lowered, samples: Samples, evaluation: Samples | None,
              options: Options, example: tuple[Any, ...] | None = None) -> dict[str, Any]:  # fmt: skip
    """The ``.pte`` against its program (refused when further from float, with the first op that departs),
    against float, and timed. ``example``: the inputs ``lowered`` was exported from (contiguous zeros)."""
    from requant.backends.executorch import PteSession, lower_to_pte
    from requant.stages.pt2e import CHOICE_SAMPLES

    pte = PteSession(lowered.pte, exported.names)
    against = _against_program(exported, converted, pte, samples)
    if not against["same"]:
        raise _refusal(exported, converted, lowered, against, samples, example)
    report: dict[str, Any] = {"executorch": {**lowered.section(), "against_program": against}}
    data: Any = evaluation
    reference = Reference(None, session=exported.float_session)
    if evaluation is None:  # the first calibration samples: float's outputs there are known
        data, reference = samples.head(exported.signature, CHOICE_SAMPLES), exported.reference
    report["evaluation"] = agreement(exported.signature, reference, pte, data)
    if options.measure:
        float_pte = PteSession(lower_to_pte(exported.program).pte, exported.names)
        sample = samples.head(exported.signature, 1)[0]
        float_ms, int8_ms = interleaved_latency_ms([float_pte, pte], sample)
        report["latency_ms_batch1"] = {"float": float_ms, "quantized": int8_ms}
        report["size_bytes"] = {"float": len(float_pte.pte), "quantized": len(lowered.pte)}
    return report


def lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's lines on the ``.pte``: its delegation and size, and how it ran against its program."""
    section = report.get("executorch")
    if not section:
        return []
    against = section["against_program"]
    outside = ", ".join(f"{op} x{n}" for op, n in section["not_delegated"].items()) or "none"
    return [
        f"executorch: {section['ops_delegated']} of {section['ops_delegated'] + section['ops_not_delegated']} ops "
        f"delegated to XNNPACK in {section['delegates']} delegate(s) (not delegated: {outside}); "
        f".pte {section['pte_bytes'] / 1e6:.1f} MB",
        f"the .pte against its program on {against['samples']} calibration samples: {against['pte_sqnr_db']:.1f} dB "
        f"from float, the program {against['program_sqnr_db']:.1f} dB (the same numbers, up to XNNPACK's rounding)",
        *_rounding_lines(report),
    ]  # fmt: skip


def _rounding_lines(report: Mapping[str, Any]) -> list[str]:
    rounded = report.get("weight_rounding", {}).get("kernels", [])
    if not rounded:
        return []
    gains = sorted(r["output_sqnr_db"] - r["nearest_output_sqnr_db"] for r in rounded)
    return [f"weight rounding: {len(rounded)} of {report['weight_rounding']['watched']} convolutions rounded by error "
            f"feedback against their float inputs (their output SQNR on them +{gains[len(gains) // 2]:.1f} dB median, "
            f"+{gains[-1]:.1f} dB at most)"]  # fmt: skip
