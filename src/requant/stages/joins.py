"""The joins of ranges that cannot share one int8 type: the report's section and its summary line.

A detector's head concatenates box coordinates in pixels (0 to 320) with class probabilities (0 to 1)
into one output: one int8 type for both gives the probabilities less than one step (0 or 1), and the
int8 model detects nothing while its output's SQNR, which the pixels dominate, looks fine. Propagation
decides it, once the types are known (:func:`requant.propagation.propagate._joins`, by the target
table's ``joins``): a join whose input spans fewer than ``MIN_STEPS`` steps of its output type is kept
float where the target computes it in float (ONNX Runtime: each input keeps its own type, the ops
before it stay int8), in every run, at no extra cost; on integer-only TOSA it is reported.

Reads: the run's propagation notes. Records: ``joins`` (each join found, its inputs' steps, what was
done and why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from requant.stages.run import Run
from requant.targets.constraints import MIN_STEPS, RUNTIME_FLOAT

__all__ = ["join_lines", "section"]


def section(run: Run) -> dict[str, Any]:
    """The report's ``joins``: present when propagation found one."""
    found = []
    for note in run.converted.notes:
        if note.join is not None:
            node, how, steps = note.join
            inputs = [{"value": value, "steps": count} for value, count in steps.items()]
            found.append({"node": node, "output": note.value, "inputs": inputs, "how": how, "why": note.why})
    return {"joins": {"min_steps": MIN_STEPS, "found": found}} if found else {}


def join_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's line on joins of ranges that cannot share one type."""
    found = report.get("joins", {}).get("found", [])
    if not found:
        return []
    kept = [j for j in found if j["how"] == RUNTIME_FLOAT]
    worst = min((i for j in found for i in j["inputs"]), key=lambda i: i["steps"])
    line = (
        f"joins of ranges that cannot share one int8 type: {len(found)} ({', '.join(j['node'] for j in found[:3])}"
        f"{', ...' if len(found) > 3 else ''}); '{worst['value']}' spans {worst['steps']:g} of the output's steps"
    )
    kept_all = len(kept) == len(found)
    line += "; kept float, each input its own type" if kept_all else "; the target cannot keep them float"
    return [line]
