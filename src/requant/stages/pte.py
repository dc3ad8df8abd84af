"""Stages lower and check of the ``executorch-xnnpack`` target: the converted program as a ``.pte``, run
by ExecuTorch's runtime against the program it was lowered from, against float, and timed.

- lower: ``torch.export`` of the converted PT2E module, XNNPACK's partitioner, ``to_executorch``
  (:func:`requant.backends.executorch.lower_to_pte`): the ``.pte`` and its delegation coverage;
- the ``.pte`` against its program: both run on the first calibration samples; the ``.pte`` must be as
  close to float as the converted module is (within ``GAP_DB``): a ``.pte`` further away computes other
  numbers than the program it came from (a runtime or delegate fault, not quantization), and requant
  refuses it (:class:`~requant.backends.executorch.lower.LoweringError`, nothing written);
- against float: top-1 agreement, cosine, SQNR of the first output on the evaluation data (or the
  samples the method was chosen on), as for every target (:mod:`requant.report.agreement`); an output
  under ``POOR_DB`` is said first in the summary (``NOT USABLE AS IS``), and ``--strict`` exits 3;
- speed: the float program lowered the same way, both ``.pte`` timed interleaved in one process
  (batch 1, medians of alternating blocks); an int8 ``.pte`` no faster is said first
  (``SLOWER THAN FLOAT``).

Reads: the exported float program, the converted module, the samples, the options (eval data,
measure). Records: ``executorch`` (coverage, size, the ``.pte`` against its program), ``evaluation``,
``latency_ms_batch1``, ``outputs`` (when poor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from requant.options import Options
from requant.report.agreement import Reference, agreement
from requant.report.latency import interleaved_latency_ms
from requant.report.outputs import POOR_DB

if TYPE_CHECKING:  # torch and executorch are the executorch extra's: imported where this target runs
    from requant.backends.executorch import Lowered, PteSession
    from requant.calibration.samples import Samples
    from requant.stages.pt2e import Exported

__all__ = ["GAP_DB", "check_pte", "lines", "lower_converted"]

GAP_DB = 3.0  # the .pte's noise against float may exceed its program's by this much (2x the power)
CHECK_SAMPLES = 8  # calibration samples the .pte and its program both run


def lower_converted(exported: Exported, converted: Any) -> Lowered:
    """The converted module exported again (from the same contiguous examples) and lowered."""
    import torch

    from requant.backends.executorch import lower_to_pte
    from requant.backends.executorch.lower import LoweringError
    from requant.backends.executorch.runtime import contiguous

    example = tuple(contiguous(t) for t in _example(exported))
    try:
        program = torch.export.export(converted, example)
    except Exception as exc:
        raise LoweringError(f"the converted PT2E module cannot be exported: {type(exc).__name__}: {exc}") from exc
    return lower_to_pte(program)


def _example(exported: Exported) -> tuple[Any, ...]:
    import torch

    placeholders = {n.name: n for n in exported.program.graph.nodes if n.op == "placeholder"}
    return tuple(torch.zeros(tuple(placeholders[n].meta["val"].shape), dtype=placeholders[n].meta["val"].dtype)
                 for n in exported.names)  # fmt: skip


def _against_program(exported: Exported, converted: Any, pte: PteSession, samples: Samples) -> dict[str, Any]:
    from requant.backends.executorch import ModuleSession

    first = samples.head(exported.signature, CHECK_SAMPLES)
    program = agreement(exported.signature, exported.reference, ModuleSession(converted, exported.names), first)
    lowered = agreement(exported.signature, exported.reference, pte, first)
    gap = program["sqnr_db"] - lowered["sqnr_db"]
    return {"samples": len(first), "program_sqnr_db": program["sqnr_db"], "pte_sqnr_db": lowered["sqnr_db"],
            "program_top1": program["top1_agreement"], "pte_top1": lowered["top1_agreement"],
            "gap_db": gap, "same": gap <= GAP_DB}  # fmt: skip


def check_pte(exported: Exported, converted: Any, lowered: Lowered, samples: Samples, evaluation: Samples | None,
              options: Options) -> dict[str, Any]:  # fmt: skip
    """The ``.pte`` against its program (refused when further from float), against float, and timed."""
    from requant.backends.executorch import PteSession, lower_to_pte
    from requant.backends.executorch.lower import LoweringError
    from requant.stages.pt2e import CHOICE_SAMPLES

    pte = PteSession(lowered.pte, exported.names)
    against = _against_program(exported, converted, pte, samples)
    if not against["same"]:
        raise LoweringError(
            f"the .pte computes other numbers than the program it was lowered from: on {against['samples']} "
            f"calibration samples its output is {against['pte_sqnr_db']:.1f} dB from float, the program's "
            f"{against['program_sqnr_db']:.1f} dB (top-1 agreement {against['pte_top1']:.2f} against "
            f"{against['program_top1']:.2f}); not written. Delegated: {lowered.section()['delegated']}"
        )
    not_applied = ["equalization"] if options.equalization else []
    not_applied += ["smoothing"] if options.smoothing else []
    report: dict[str, Any] = {"executorch": {**lowered.section(), "against_program": against,
                                             "not_applied": not_applied}}  # fmt: skip
    data: Any = evaluation
    reference = Reference(None, session=exported.float_session)
    if evaluation is None:  # the first calibration samples: float's outputs there are known
        data, reference = samples.head(exported.signature, CHOICE_SAMPLES), exported.reference
    report["evaluation"] = agreement(exported.signature, reference, pte, data)
    if report["evaluation"]["sqnr_db"] < POOR_DB:
        report["outputs"] = {"poor": [f"its output is {report['evaluation']['sqnr_db']:.1f} dB from float "
                                      f"(under {POOR_DB:.0f} dB)"]}  # fmt: skip
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
        *([f"not applied on this target yet: {', '.join(section['not_applied'])} (docs/targets.md)"]
          if section.get("not_applied") else []),
    ]  # fmt: skip
