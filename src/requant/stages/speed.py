"""Stage speed: the int8 model's latency against float's, and a remedy where it is no faster.

Latency at batch 1: the float and int8 models (and every model the accuracy budget tried) run
interleaved in one process (:mod:`requant.report.latency`). Where the int8 model is no faster than
float, the groups of int8 ops between kernels that placement priced worst (the least modelled saving,
``WORST_GROUPS`` at most) are kept float in another run, the three models are measured again in the
same interleaved rounds, and the candidate is kept when it is at least ``FASTER_BY`` faster than the
int8 model. Still no faster than float: the summary's first lines say so (a quantized model slower than
float never reads as a success).

This is the one step whose result depends on measured time (the others use modelled costs): with
``measure=False`` it is skipped, and the same inputs give the same bytes.

Reads: the run, the float model, the first calibration sample, the budget's tries. Adds: the faster
run. Records: ``latency_ms_batch1`` (each budget try's in its record) and ``speed`` (what was tried).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from requant.report.agreement import Reference
from requant.report.latency import interleaved_latency_ms, interleaved_rounds, medians, session, slower_share
from requant.runtime import in_stage
from requant.stages.run import Flow, Run

__all__ = ["FASTER_BY", "SLOWER_IN", "WORST_GROUPS", "alarm_lines", "latency_lines", "measure_speed", "quantized_model"]

log = logging.getLogger("requant")

WORST_GROUPS = 4  # the int8 groups kept float when the model is no faster than float, worst priced first
FASTER_BY = 0.95  # a candidate is kept when it takes at most this share of the int8 model's time
# the alarm fires when the int8 model took longer than float in at least this share of the alternating rounds: a
# tie (LAC's one float GRU: 0.231 against 0.232 ms, "1.00x") was 42-52 % in three runs, and no alarm
SLOWER_IN = 0.75


def _worst_groups(run: Run) -> list[dict[str, Any]]:
    """The groups placement priced and placed int8, the least modelled saving first."""
    groups = [p for p in run.quantizer_report.placements
              if p.get("by", "cost") == "cost" and p["placed"] == "int8" and p["int8_us"] is not None]  # fmt: skip
    return sorted(groups, key=lambda p: p["float_us"] - p["int8_us"])[:WORST_GROUPS]


@in_stage("latency (the quantized model timed against float)")
def measure_speed(
    flow: Flow, run: Run, reference: Reference, budget: dict[str, Any] | None, tried: list[Run]
) -> tuple[Run, dict[str, Any]]:
    """The run kept (a faster one where the int8 model was no faster than float), and the records."""
    if not flow.options.measure or run.float_proto is None:
        return run, {}
    sample = flow.samples.head(run.converted.model, 1)[0]
    f_session, q_session = reference.float_session(), session(run.converted.proto)
    # what each try of the budget costs: every model it made, the first int8 one included, beside
    others = [i for i, candidate in enumerate(tried) if candidate is not run]
    rounds = interleaved_rounds([f_session, q_session, *(session(tried[i].converted.proto) for i in others)], sample)
    times = medians(rounds)
    found: dict[str, Any] = {"latency_ms_batch1": {"float": times[0], "quantized": times[1], "measured": "interleaved",
                                                   "int8_slower_in": slower_share(rounds[0], rounds[1])}}  # fmt: skip
    if budget is not None:
        measured = dict(zip(others, times[2:], strict=True))
        for i, step in enumerate(budget["tries"]):
            step["latency_ms"] = measured.get(i, times[1])
        budget["latency_ms_before"] = budget["tries"][0]["latency_ms"]
    record: dict[str, Any] = {"int8_over_float": times[1] / times[0], "tried": None}
    if times[1] < times[0]:
        return run, {**found, "speed": record}
    integer = flow.target.integer_only
    groups = [] if integer else _worst_groups(run)
    if not groups:
        record["why"] = (f"{flow.target.name} is integer-only: nothing can be kept float" if integer
                         else "no group of int8 ops between kernels was priced to keep float (the kernels "
                         "themselves are int8)")  # fmt: skip
        return run, {**found, "speed": record}
    nodes = [n for g in groups for n in g["nodes"]]
    log.warning("the int8 model is no faster than float (%.2fx): keeping its %d worst-priced groups float",
                times[1] / times[0], len(groups))  # fmt: skip
    candidate = flow.again(run, [], placed=nodes)
    again = interleaved_latency_ms([f_session, q_session, session(candidate.converted.proto)], sample)
    kept = again[2] <= FASTER_BY * again[1]
    record["tried"] = {"kept_float": nodes, "ops": [g["ops"] for g in groups], "float_ms": again[0],
                       "int8_ms": again[1], "candidate_ms": again[2], "kept": kept}  # fmt: skip
    if kept:
        run = candidate
        flow.placed_float += nodes
        found["latency_ms_batch1"] = {"float": again[0], "quantized": again[2], "measured": "interleaved"}
    return run, {**found, "speed": record}


def latency_lines(report: Mapping[str, Any]) -> list[str]:
    latency = report.get("latency_ms_batch1")
    if not latency:
        return []
    lines = [
        f"latency, batch 1: {latency['float']:.3f} ms -> {latency['quantized']:.3f} ms "
        f"({latency['quantized'] / latency['float']:.2f}x)"
    ]
    if _tie(latency):
        share = latency["int8_slower_in"]
        lines[0] += f": as fast as float within the measurement (int8 slower in {share:.0%} of the alternating rounds)"
    tried = (report.get("speed") or {}).get("tried")
    if tried and tried["kept"]:
        lines.append(
            f"speed: the int8 model was no faster than float ({tried['int8_ms'] / tried['float_ms']:.2f}x): its "
            f"{len(tried['ops'])} worst-priced groups of int8 ops kept float "
            f"({', '.join('/'.join(ops) for ops in tried['ops'])})"
        )
    return lines


def quantized_model(report: Mapping[str, Any]) -> str:
    """What the summary calls the quantized model: "int8 model", or "4-bit model" for an encoder's weight blocks."""
    blocks = report.get("encoder_blocks")
    return f"{str(blocks['format']).split()[0]}-bit model" if blocks else "int8 model"


def _tie(latency: Mapping[str, Any]) -> bool:
    """The int8 model no faster than float by the medians, but not slower in most alternating rounds."""
    share = latency.get("int8_slower_in")
    return latency["quantized"] >= latency["float"] and share is not None and share < SLOWER_IN


def alarm_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's line on an int8 model no faster than float, first."""
    from requant.targets.registry import TARGETS

    latency, speed = report.get("latency_ms_batch1"), report.get("speed")
    target = TARGETS.get(report.get("target", ""))
    if not latency or latency["quantized"] < latency["float"] or _tie(latency) or (target and target.integer_only):
        return []  # (an integer-only target's latency is its QDQ twin's in ONNX Runtime, not its program's)
    line = (f"SLOWER THAN FLOAT: the {quantized_model(report)} takes {latency['quantized'] / latency['float']:.2f}x "
            "the float model's time (batch 1, interleaved)")  # fmt: skip
    tried = speed.get("tried") if speed else None
    if tried:
        ratio = tried["candidate_ms"] / tried["float_ms"]
        line += f"; keeping {len(tried['kept_float'])} ops float was tried: {ratio:.2f}x"
        line += " (kept)" if tried["kept"] else " (no faster: not kept)"
    elif speed:
        line += f"; {speed['why']}"
    return [line]
