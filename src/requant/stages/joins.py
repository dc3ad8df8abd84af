"""Stage joins: where ranges that cannot share one int8 type are joined into one tensor.

A detector's head concatenates box coordinates in pixels (0 to 320) with class probabilities (0 to 1)
into one output: one int8 type for both gives the probabilities less than one step (0 or 1), and the
int8 model detects nothing while its output's SQNR, which the pixels dominate, looks fine. Once the
types are known, each join of the target's table (a Concat) is checked: an input that spans fewer than
``MIN_STEPS`` steps of the join's output type loses what it says. Where the target computes the join in
float (ONNX Runtime: each input keeps its own type, the ops before it stay int8), the run is made again
with those joins float; where it cannot (integer-only TOSA), the report says so.

Reads: the run's QDQ model (each join's input and output types, from its conversions), the target's
table. Adds: a run with the joins float. Records: ``joins`` (each join found, its inputs' steps, what
was done and why).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from requant.ir.provenance import quantizes
from requant.ir.queries import constant
from requant.stages.run import Flow, Run
from requant.targets.constraints import MIN_STEPS, RUNTIME_FLOAT

__all__ = ["join_lines", "keep_joins_float"]

log = logging.getLogger("requant")


def _conversion(value: ir.Value | None, op: str) -> tuple[ir.Node, float, int] | None:
    """The DequantizeLinear a value comes from (``op`` "DequantizeLinear"), or the one QuantizeLinear
    that reads it ("QuantizeLinear"), with its per-tensor scale and the steps of its storage type."""
    if value is None:
        return None
    nodes = [value.producer()] if op == "DequantizeLinear" else [u.node for u in value.uses()]
    found = [n for n in nodes if n is not None and n.op_type == op]
    if len(found) != 1:
        return None
    scale = constant(found[0].inputs[1]) if len(found[0].inputs) > 1 else None
    zp = constant(found[0].inputs[2]) if len(found[0].inputs) > 2 else None
    if scale is None or scale.size != 1:
        return None
    steps = (1 << (8 * zp.dtype.itemsize)) - 1 if zp is not None else 255  # a uint8 or int8 type: 255
    return found[0], float(scale.reshape(())), steps


def _source(dq: ir.Node) -> str:
    """The float value a DequantizeLinear gives back (what its QuantizeLinear quantized)."""
    x = dq.inputs[0]
    q = x.producer() if x is not None else None
    return quantizes(q) if q is not None and q.op_type == "QuantizeLinear" else str(x.name if x is not None else "")


def find_joins(model: ir.Model, joins: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each join of the QDQ ``model`` with an input spanning fewer than ``MIN_STEPS`` of its output's steps."""
    found = []
    for node in model.graph:
        rule = joins.get(node.op_type)
        out = _conversion(node.outputs[0], "QuantizeLinear") if rule is not None and node.outputs else None
        if rule is None or out is None:
            continue
        inputs: list[dict[str, Any]] = []
        for value in node.inputs:
            given = _conversion(value, "DequantizeLinear")
            if given is not None:
                _, scale, steps = given
                inputs.append({"value": _source(given[0]), "steps": round(steps * scale / out[1], 2)})
        if any(i["steps"] < MIN_STEPS for i in inputs):
            found.append({"node": str(node.name), "op": node.op_type, "inputs": inputs, "how": rule.meet,
                          "why": rule.why})  # fmt: skip
    return found


def keep_joins_float(flow: Flow, run: Run) -> tuple[Run, dict[str, Any]]:
    """``run``, or a run with its joins of ranges that cannot share a type kept float; the record."""
    found = find_joins(run.converted.model, flow.target.table.joins)
    floats = [j["node"] for j in found if j["how"] == RUNTIME_FLOAT]
    if floats:
        log.info("keeping %d joins float (inputs of ranges that cannot share one int8 type); quantizing again",
                 len(floats))  # fmt: skip
        run = flow.again(run, floats)
        flow.kept_float += floats  # and in every later run (keep_float_below's, the budget's)
    for join in found:
        if join["how"] != RUNTIME_FLOAT:
            log.warning(
                "%s '%s' joins inputs that cannot share one int8 type: %s", join["op"], join["node"], join["why"]
            )
    return run, {"joins": {"min_steps": MIN_STEPS, "found": found}} if found else {}


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
    line += (
        "; kept float, each input its own type" if len(kept) == len(found) else "; the target cannot keep them float"
    )
    return [line]
