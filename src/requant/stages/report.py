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
    encoder_blocks,
    joins,
    lower,
    outputs,
    pte,
    speed,
    transform,
)

__all__ = ["ALARMS", "SUMMARY", "headline", "parts_summary", "summary"]


def headline(report: Mapping[str, Any]) -> list[str]:
    """The summary's first line where no alarm is: what the int8 model gained (speed, size) and kept (accuracy
    with labels, else top-1 agreement with float), from the figures the later lines give in full."""
    if any(alarm(report) for alarm in ALARMS):
        return []
    from requant.targets.registry import TARGETS

    parts = []
    latency, target = report.get("latency_ms_batch1"), TARGETS.get(report.get("target", ""))
    if latency and latency["quantized"] < latency["float"] and not (target and target.integer_only):  # (its QDQ twin's)
        parts.append(f"{latency['float'] / latency['quantized']:.2f}x as fast as float (batch 1)")
    size = report.get("size_bytes")
    if size:
        parts.append(f"{size['quantized'] / size['float']:.2f}x its size")
    ev = report.get("evaluation")
    if ev and "float_accuracy" in ev:
        parts.append(f"accuracy {ev['float_accuracy']:.4f} -> {ev['int8_accuracy']:.4f} ({int(ev['samples'])} samples)")
    elif ev and "feature extraction" in report.get("model_source", ""):  # hidden states: no class to agree on
        parts.append(f"cosine to float {ev['cosine_similarity']:.5f} ({int(ev['samples'])} rows)")
    elif ev and not ev.get("class_scores", 1.0):  # a map (a text detector's), a value: the argmax is one pixel's
        parts.append(f"cosine to float {ev['cosine_similarity']:.5f}, SQNR {ev['sqnr_db']:.1f} dB "
                     f"({int(ev['samples'])} samples)")  # fmt: skip
    elif ev:
        parts.append(f"top-1 agreement with float {ev['top1_agreement']:.4f} ({int(ev['samples'])} samples)")
    return [f"{speed.quantized_model(report)}: " + ", ".join(parts)] if parts else []


def _target(report: Mapping[str, Any]) -> list[str]:
    return [f"target: {report['target']}"]


def _source(report: Mapping[str, Any]) -> list[str]:
    lines = [f"model: {report['model_source']}"] if report.get("model_source") else []
    return lines + ([f"example inputs: {report['example_inputs']}"] if report.get("example_inputs") else [])


def _fixed_inputs(report: Mapping[str, Any]) -> list[str]:
    if not report.get("fixed_inputs"):
        return []
    given = ", ".join(f"{k} = {v}" for k, v in report["fixed_inputs"].items())
    return [f"fixed inputs: {given} (constants now: the quantized model does not take them)"]


def _seconds(report: Mapping[str, Any]) -> list[str]:
    return [f"quantized in {report['quantize_seconds']:.1f} s"]


Lines = Callable[[Mapping[str, Any]], list[str]]

# what makes the model no good, in words: the summary's first lines
ALARMS: tuple[Lines, ...] = (outputs.alarm_lines, speed.alarm_lines, blocks.alarm_lines, encoder_blocks.alarm_lines)

# the summary's topics, in the order it prints them
SUMMARY: tuple[Lines, ...] = (
    *ALARMS,
    headline,  # where no alarm is
    _target,
    _source,
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
    encoder_blocks.lines,
    convert.encoding_lines,
    convert.table_lines,
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
    if "parts" in report:
        return parts_summary(report)
    return "\n".join(line for topic in SUMMARY for line in topic(report))


def parts_summary(report: Mapping[str, Any]) -> str:
    """A model of parts' summary (:func:`requant.pipeline.quantize_parts`): each part's, under its name."""
    parts = report["parts"]
    from requant.frontends.hf_parts import check_lines

    together = check_lines(report.get("together", {}))  # NOT USABLE AS IS first, when the parts together are poor
    lines = [f"a model of {len(parts)} parts ({', '.join(parts)}), each quantized as a model of its own"]
    lines = [*together, *lines] if report.get("together", {}).get("poor") else [*lines, *together]
    for name, part in parts.items():
        lines += ["", f"== {name}", str(part["summary"])]
    return "\n".join(lines)
