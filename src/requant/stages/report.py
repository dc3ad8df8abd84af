"""Stage report: the report assembled from the sections the stages recorded, and its summary.

The report is a JSON-able dict: one key (or a few) per stage, each written by that stage (see each
module's "Records"). The summary is the text ``requant quantize`` prints: a line or a few per topic,
in the order of :data:`SUMMARY`, each read from the report by the stage module that wrote its section
(so a saved report gives the same summary: :func:`summary`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from requant.stages import (
    annotate,
    blocks,
    budget,
    check,
    choose,
    convert,
    joins,
    lower,
    outputs,
    pte,
    speed,
    transform,
)

__all__ = ["SUMMARY", "summary"]


def _target(report: Mapping[str, Any]) -> list[str]:
    return [f"target: {report['target']}"]


def _fixed_inputs(report: Mapping[str, Any]) -> list[str]:
    if not report.get("fixed_inputs"):
        return []
    given = ", ".join(f"{k} = {v}" for k, v in report["fixed_inputs"].items())
    return [f"fixed inputs: {given} (constants now: the quantized model does not take them)"]


def _seconds(report: Mapping[str, Any]) -> list[str]:
    return [f"quantized in {report['quantize_seconds']:.1f} s"]


Lines = Callable[[Mapping[str, Any]], list[str]]

# the summary's topics, in the order it prints them
SUMMARY: tuple[Lines, ...] = (
    outputs.alarm_lines,  # first: what makes the model no good, in words
    speed.alarm_lines,
    blocks.alarm_lines,
    _target,
    _fixed_inputs,
    annotate.preset_lines,
    choose.lines,
    annotate.compute_lines,
    transform.lines,
    annotate.placement_lines,
    annotate.warning_lines,
    joins.join_lines,
    convert.rescale_lines,
    lower.lines,
    pte.lines,
    blocks.lines,
    convert.encoding_lines,
    convert.lint_lines,  # and the size
    speed.latency_lines,
    outputs.detection_lines,
    check.evaluation_lines,
    budget.lines,
    convert.bias_lines,
    budget.kept_lines,
    _seconds,
)


def summary(report: Mapping[str, Any]) -> str:
    """The text printed at the end of ``requant quantize``, from a report (a run's, or a saved one)."""
    return "\n".join(line for topic in SUMMARY for line in topic(report))
