"""Stage plan (``requant quantize --dry-run``): what a run would do, read from the annotated model, with
no data read and nothing written.

The model is loaded and annotated as a run annotates it (the quantizers, the target's table, placement
by its cost model: :func:`requant.stages.annotate.prepare`), without the steps that read data (smoothing
and equalization, which change which ranges calibration measures but not which nodes are quantized).

Reads: the model source, the options. Adds: nothing (the model is dropped). Records: ``plan`` (the
nodes that would be quantized and those that would stay float, by op type, each float one's reason),
beside ``target`` and ``quantizers`` as a run's report has them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from requant.errors import ArgumentError
from requant.frontends.hf_folder import is_hf_folder, load_hf_folder
from requant.frontends.hf_parts import load_parts, parts_of
from requant.options import Options
from requant.stages.annotate import prepare, preset_lines

__all__ = ["FLOWS_PLANNED", "plan", "plan_lines"]

FLOWS_PLANNED = ("qdq", "tosa")  # the ONNX targets' flows


def plan(source: Any, options: Options, given: str | None = None) -> dict[str, Any]:
    """The plan of quantizing ``source`` with ``options``: a report with ``target``, ``quantizers`` and
    ``plan`` (see the module's docstring); ``given``: the preset the user named, if any."""
    if options.flow not in FLOWS_PLANNED:
        raise ArgumentError(f"--dry-run plans the ONNX targets' runs (onnxruntime-cpu, onnxruntime-cpu-vnni, "
                            f"tosa-int8); not the {options.flow} flow of {options.target}")  # fmt: skip
    if parts_of(source):  # a model of parts: each part's plan
        parts = {part.name: plan(part.model, options, given) for part in load_parts(source).parts}
        return {"target": options.target, "parts": parts}
    if is_hf_folder(source):  # exported as a run exports it
        source = load_hf_folder(source).model
    prepared = prepare(source, options.quantizer, options.chosen_target, options.strict, None, None,
                       options.load_options)  # fmt: skip
    ops = {str(n.name): n.op_type for n in prepared.model.graph}
    quantizers = prepared.report.to_json()
    quantized: Counter[str] = Counter()
    floats: dict[str, str] = {}
    for quantizer in quantizers["quantizers"]:
        for decision in quantizer.get("decisions", []):
            for node in decision["nodes"]:
                if decision["status"] == "accepted":
                    quantized[ops.get(node, decision["pattern"])] += 1
                else:
                    floats.setdefault(node, decision.get("reason", decision["status"]))
    for placement in quantizers.get("placements", []):
        if placement["placed"] == "float":
            for node in placement["nodes"]:
                floats.setdefault(node, f"kept float by placement: {placement['why']}")
    section = {
        "nodes": len(ops),
        "quantized": dict(sorted(quantized.items())),
        "float": dict(sorted(Counter(ops.get(n, "?") for n in floats).items())),
        "float_nodes": floats,
        "method": options.method,
        "preset_given": given,
    }
    return {"target": options.target, "quantizers": quantizers, "plan": section}


def _counted(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in counts.items())


def plan_lines(report: Mapping[str, Any], limit: int = 12) -> list[str]:
    """The plan as ``--dry-run`` prints it: the target, the preset, the method, the nodes quantized and
    kept float by op type, and the first ``limit`` float nodes with their reasons; a model of parts' each part's."""
    if "parts" in report:
        lines: list[str] = []
        for name, part in report["parts"].items():
            lines += [f"== {name}", *plan_lines(part, limit)[0 if not lines else 1 :]]
        return lines
    section = report["plan"]
    quantized, floats = section["quantized"], section["float"]
    lines = ["dry run: nothing calibrated, nothing written", f"target: {report['target']}"]
    lines += preset_lines(report) or ([f"preset: {section['preset_given']} (given)"] if section["preset_given"] else [])
    method = section["method"]
    lines.append("method: auto (minmax and mean_minmax, the closer to float on held-out calibration samples kept; "
                 "stem_percentile for a detector)" if method == "auto" else f"method: {method}")  # fmt: skip
    lines.append(f"would quantize: {sum(quantized.values())} of {section['nodes']} nodes ({_counted(quantized)})")
    if floats:
        lines.append(f"would keep float: {sum(floats.values())} nodes ({_counted(floats)})")
    grouped: dict[str, list[str]] = {}  # one line per reason (without the node and value names it gives), its nodes
    for node, why in section["float_nodes"].items():
        grouped.setdefault(re.sub(r"'[^']*'", "'...'", re.sub(r" \(at [^()]*\)$", "", why)), []).append(node)
    for why, nodes in list(grouped.items())[:limit]:
        named = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
        lines.append(f"  {named}: {why}")
    if len(grouped) > limit:
        lines.append(f"  ... and {len(grouped) - limit} more reasons (the report's plan.float_nodes)")
    return lines
