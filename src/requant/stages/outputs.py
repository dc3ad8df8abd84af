"""Stage outputs: every output of the int8 model against float, and a remedy where one is far from it.

Each output is measured part by part on calibration samples the model was not calibrated on (the
ones ``method="auto"`` held out; without ``auto``, the first ``CHOICE_SAMPLES``), its integers computed
exactly as the target's CPUs compute them (``runtime.exact_twin``):
:mod:`requant.report.outputs` says how, and when a part is poor. Where one is, the region feeding
that output (the ops between it and the kernels before it) is kept float in another run, measured
again, and the better of the two kept. A part still poor after that is an alarm: the summary's first
lines say it in words, and ``requant quantize --strict`` exits 3.

Reads: the final run, its float model, the samples. Adds: the run with the region float, when it is
better. Records: ``outputs`` (every part's figures, what was tried, what is poor).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.report import detections
from requant.report.latency import session
from requant.report.outputs import Split, compare_outputs, describe, poor_parts
from requant.runtime import exact_twin, in_stage
from requant.stages.choose import CHOICE_SAMPLES
from requant.stages.run import Flow, Run

__all__ = ["KERNELS", "MAX_REGION", "alarm_lines", "check_outputs", "detection_lines", "remedy_record", "worse"]

log = logging.getLogger("requant")

KERNELS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU")  # where the region feeding an output stops
MAX_REGION = 64  # nodes at most kept float for one output


def _splits(proto: onnx.ModelProto) -> dict[str, tuple[int, list[str]]]:
    """The graph outputs a Concat writes: its axis and its inputs' names."""
    outputs = {o.name for o in proto.graph.output}
    found = {}
    for node in proto.graph.node:
        if node.op_type == "Concat" and node.domain in ("", "ai.onnx") and node.output[0] in outputs:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            found[node.output[0]] = (axis, list(node.input))
    return found


def _float_runs(
    proto: onnx.ModelProto, samples: Sequence[Mapping[str, Any]]
) -> tuple[list[list[Any]], dict[str, Split]]:
    """The float model's outputs on each sample, and each joined output's parts (their sizes read from
    the first sample's run, the Concat's inputs exposed as outputs)."""
    joined = _splits(proto)
    names = [o.name for o in proto.graph.output]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    extra = [i for _, inputs in joined.values() for i in inputs if i not in names]
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(i) for i in dict.fromkeys(extra))
    runner = session(exposed)
    runs = [list(runner.run(None, dict(s))) for s in samples]
    given = dict(zip([*names, *dict.fromkeys(extra)], runs[0], strict=True)) if runs else {}
    splits: dict[str, Split] = {}
    for output, (axis, inputs) in joined.items():
        splits[output] = (axis, [(i, int(np.shape(given[i])[axis])) for i in inputs])
    return [r[: len(names)] for r in runs], splits


def _measure(
    run: Run, samples: Sequence[Mapping[str, Any]], floats: list[list[Any]], splits: Mapping[str, Split],
    heads: Sequence[detections.Head],
) -> list[dict[str, Any]]:  # fmt: skip
    """Every output's parts against float's; a detection head's (``heads``, found once in float's outputs) as its
    detections too, its box and score parts judged by those alone (:mod:`requant.report.detections`)."""
    # the integers requant chose, computed exactly (int32 sums) as on the target's CPUs: a CPU without VNNI
    # saturates full-range weights (the VNNI target's), which lint reports apart
    runner = session(exact_twin(run.converted.proto))
    names = [str(o.name) for o in run.converted.model.graph.outputs]
    ints = [list(runner.run(None, dict(s))) for s in samples]
    parts = compare_outputs(names, floats, ints, splits)
    for head in heads:
        for part in _parts_of_head(parts, head, splits):
            part["judged_by"] = "detections"
        parts.append(detections.judge(head, floats, ints))
    return parts


def _parts_of_head(
    parts: list[dict[str, Any]], head: detections.Head, splits: Mapping[str, Split]
) -> list[dict[str, Any]]:
    """The parts holding a head's boxes, class scores and an oriented box's angle (judged on the matched boxes);
    not a segmentation head's mask coefficients (judged as values)."""
    scores = range(head.first, head.first + head.classes)
    split = len(head.names) > 1
    last = scores.stop + (head.angle is not None)
    rows = {head.names[0]: range(4), head.names[-1]: scores} if split else {head.names[0]: range(last)}
    found = []
    for part in parts:
        taken = rows.get(part["output"])
        if taken is None:
            continue
        joined = splits.get(part["output"], (0, []))[1]
        starts = dict(zip([name for name, _ in joined], np.cumsum([0, *(size for _, size in joined)]), strict=False))
        if "joins" not in part or starts[part["joins"]] in taken:
            found.append(part)
    return found


def _feeding(model: ir.Model, outputs: set[str]) -> list[str]:
    """The ops between each of ``outputs`` and the kernels before it (the kernel itself when one writes
    the output), at most ``MAX_REGION``."""
    region: dict[str, None] = {}
    for value in model.graph.outputs:
        producer = _skip_conversions(value.producer())
        if str(value.name) not in outputs or producer is None:
            continue
        if producer.op_type in KERNELS:
            region[str(producer.name)] = None
            continue
        stack: list[ir.Node | None] = [producer]
        while stack and len(region) < MAX_REGION:
            node = _skip_conversions(stack.pop())
            if node is None or node.name in region or node.op_type in KERNELS:
                continue
            region[str(node.name)] = None
            stack += [v.producer() for v in node.inputs if v is not None and v.const_value is None]
    return list(region)


def _skip_conversions(node: ir.Node | None) -> ir.Node | None:
    """The first node up from ``node`` that is not a QuantizeLinear or DequantizeLinear."""
    while node is not None and node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        x = node.inputs[0]
        node = x.producer() if x is not None else None
    return node


def remedy_record(parts: list[dict[str, Any]], region: list[str], tried: list[dict[str, Any]]) -> dict[str, Any]:
    """What keeping ``region`` float did: the parts it gave (``tried``), and whether it is kept (closer to
    float than ``parts``)."""
    return {"kept_float": region, "parts": tried, "kept": worse(tried) < worse(parts)}


def worse(parts: list[dict[str, Any]]) -> tuple[int, float, float]:
    """How far from float: poor parts, then the score parts' changed decisions (a detector's: the detections
    it misses or adds), then the worst SQNR (a detector's: its boxes' shift, as a loss in IoU)."""
    judged = [p for p in parts if p["part"] == "detections"]
    flipped = sum(p.get("flipped", 0.0) for p in parts if not p.get("judged_by"))
    flipped += sum(2 - p["recall"] - p["precision"] for p in judged)
    worst = min((p["sqnr_db"] for p in parts if "sqnr_db" in p and not p.get("judged_by")), default=0.0)
    return len(poor_parts(parts)), flipped + sum(1 - p["iou"] for p in judged), -worst


@in_stage("output check (every output against float)")
def check_outputs(flow: Flow, run: Run, held_out: int) -> tuple[Run, dict[str, Any]]:
    """The run kept (the remedied one when it is closer to float), and the record."""
    model = run.converted.model
    samples = flow.samples.head(model, held_out or CHOICE_SAMPLES)
    assert run.float_proto is not None  # kept for the checks
    floats, splits = _float_runs(run.float_proto, samples)
    heads = detections.heads([str(o.name) for o in model.graph.outputs], floats)
    parts = _measure(run, samples, floats, splits, heads)
    record: dict[str, Any] = {"samples": len(samples), "held_out": bool(held_out), "parts": parts}
    poor = poor_parts(parts)
    far = {name for p in poor for name in p.get("outputs", [p["output"]])}  # a split head's: both its outputs
    region = _feeding(model, far) if poor and not flow.target.integer_only else []
    if poor and flow.target.integer_only:
        record["remedy"] = None  # nothing can be kept float on an integer-only target
        log.warning("%s; %s is integer-only: nothing can be kept float", describe(poor[0]), flow.target.name)
    if region:
        log.warning("%s; keeping the %d ops feeding it float and quantizing again", describe(poor[0]), len(region))
        other = flow.again(run, region)
        tried = _measure(other, samples, floats, splits, heads)
        record["remedy"] = remedy_record(parts, region, tried)
        if record["remedy"]["kept"]:
            run, poor = other, poor_parts(tried)
            flow.kept_float += region
    record["poor"] = [describe(p) for p in poor]
    return run, {"outputs": record}


def alarm_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's first lines: what makes the int8 model no good, in words."""
    checked = report.get("outputs", {})
    lines = [f"NOT USABLE AS IS: {text}" for text in checked.get("poor", [])]
    remedy = checked.get("remedy")
    if remedy:
        first = "; ".join(describe(p) for p in poor_parts(checked["parts"]))
        kept = remedy["kept_float"]
        ops = f"{', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''}"
        done = "kept float" if remedy["kept"] else "tried float (no closer: left int8)"
        lines.append(f"far from float at first: {first}; the {len(kept)} ops feeding it {done} ({ops})")
    return lines


def detection_lines(report: Mapping[str, Any]) -> list[str]:
    """A detector's detections against float's, when they are not already the alarm."""
    checked = report.get("outputs", {})
    judged = [p for p in checked.get("parts", []) if p["part"] == "detections" and not detections.poor(p)]
    return [f"detections: {detections.describe(p)}; on {checked['samples']} held-out samples" for p in judged]
