"""Stage annotate: the quantizers put their requests on the loaded, evened model; then placement by
the target's cost model keeps float the groups of int8 ops that would cost more than their float
versions (:mod:`requant.quantizers.placement`), annotating again with them kept float.

Reads: the model source (each annotation starts from it: smoothing and equalization change the model
in place), the quantizer, the target, ``strict``. Adds: requests on values (``requant.ir.requests``).
Records: ``quantizers`` (every accept and reject with its reason, the decompositions, the placements,
the preset and why).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.calibration.samples import Samples
from requant.frontends import serialized_size
from requant.quantizers import Quantizer, QuantizerReport
from requant.quantizers.pattern_quantizer import KEPT_FLOAT_KEY
from requant.quantizers.placement import Placement, place, price_kept_float, sample_sizes
from requant.quantizers.quantizer import FLOAT_PLACED
from requant.stages.load import load_model
from requant.stages.transform import Evened, Evening, even_out, undo_per_tensor
from requant.targets.registry import Target

__all__ = ["PLACEMENT_ROUNDS", "Prepared", "annotate", "prepare"]

PLACEMENT_ROUNDS = 3  # annotations after the first: a group kept float can make its neighbours' float cheaper

FloatModel = tuple[onnx.ModelProto | None, int]  # the float model (serialized where a session needs it), its size


@dataclass
class Prepared:
    """An annotated model, the quantizers' report, the float model before evening and annotation (when
    asked for), and what evening did."""

    model: ir.Model
    report: QuantizerReport
    float_model: FloatModel | None
    evened: Evened


def prepare(
    source: Any,
    quantizer: Quantizer,
    target: Target,
    strict: bool,
    keep_float: bool | None,
    evening: Evening | None = None,
    load_options: Mapping[str, Any] | None = None,
    samples: Samples | None = None,
) -> Prepared:
    """:func:`annotate`, then placement by the target's cost model: while groups of int8 ops cost more
    than their float versions, the model is annotated again with them kept float (``FLOAT_PLACED``);
    every group's decision goes to the report. ``samples``: the calibration samples, whose first one's
    shapes size the values a symbolic dimension leaves unsized."""
    options = load_options or {}
    prepared = annotate(source, quantizer, target, strict, keep_float, evening, options)
    if target.costs is None:
        return prepared
    first = samples.head(prepared.model, 1) if samples is not None else []
    sizes = sample_sizes(prepared.model, {k: np.shape(v) for k, v in first[0].items()}) if first else {}
    decided: dict[tuple[str, ...], Placement] = {}
    for _ in range(PLACEMENT_ROUNDS):
        found = place(prepared.model, target.costs, sizes)
        decided.update((tuple(p.nodes), p) for p in found)
        if not any(p.placed == "float" for p in found):
            break
        floats = [name for p in decided.values() if p.placed == "float" for name in p.nodes]
        prepared = annotate(source, quantizer.with_float_nodes(floats, FLOAT_PLACED), target, strict, keep_float,
                            evening, options)  # fmt: skip
    kept = price_kept_float(prepared.model, target.costs, sizes)
    prepared.report.placements = [p.to_json() for p in (*decided.values(), *kept)]
    return prepared


def _kept_by_table(model: ir.Model, target: Target) -> dict[str, str]:
    """The nodes the target's table keeps float whole (``SupportTable.float_kernels``), with why."""
    rule = target.table.float_kernels
    if rule is None:
        return {}
    reasons = {str(n.name): rule(n) for n in model.graph if n.name}
    return {name: why for name, why in reasons.items() if why}


def _float_by_table(model: ir.Model, target: Target) -> dict[str, str]:
    """The nodes the target's table computes in float where they stand (``SupportTable.float_ops``), with why."""
    rule = target.table.float_ops
    return dict(rule(model.graph)) if rule is not None and not target.integer_only else {}


def annotate(
    source: Any,
    quantizer: Quantizer,
    target: Target,
    strict: bool,
    keep_float: bool | None,
    evening: Evening | None,
    load_options: Mapping[str, Any],
) -> Prepared:
    """Load (:mod:`requant.stages.load`), even out (:mod:`requant.stages.transform`) and annotate
    ``source``. With ``keep_float`` not None, also the float model as loaded, before evening, the
    quantizers' annotations and the target's decompositions (the reference for latency and evaluation:
    a decomposed HardSwish runs slower in float), serialized if ``keep_float``, and its size."""
    loaded = load_model(source, target, load_options)
    model = loaded.model
    float_model = None
    if keep_float is not None:
        # the float model serialized only where a float session needs it (held through calibration,
        # it was MiniLM's largest allocation); otherwise just its size
        proto = ir.serde.serialize_model(model) if keep_float else None
        float_model = (proto, proto.ByteSize() if proto is not None else serialized_size(model))
    quantizer, evened = even_out(model, evening, quantizer.for_table(target.table), target)
    kept, placed = _kept_by_table(model, target), _float_by_table(model, target)
    quantizer = quantizer.with_float_nodes(kept) if kept else quantizer
    quantizer = quantizer.with_float_nodes(placed, FLOAT_PLACED) if placed else quantizer
    report = quantizer.quantize(model, strict=strict, presets=target.presets)
    for node in model.graph:
        if node.name in kept or node.name in placed:
            node.metadata_props[KEPT_FLOAT_KEY] = kept.get(node.name) or placed[node.name]
    report.decomposed[:0] = loaded.decomposed
    report.compute = loaded.compute or report.compute
    report.random_seeded = loaded.seeded
    return Prepared(model, report, float_model, undo_per_tensor(evened))


def preset_lines(report: Mapping[str, Any]) -> list[str]:
    choice = report.get("quantizers", {}).get("preset_choice")
    return [f"preset: {choice}"] if choice else []


def compute_lines(report: Mapping[str, Any]) -> list[str]:
    compute = report.get("quantizers", {}).get("compute")
    lines = [f"compute: {compute}"] if compute else []
    seeded = report.get("quantizers", {}).get("random_seeded", [])
    if seeded:
        lines.append(
            f"random ops: {len(seeded)} ({', '.join(seeded[:3])}{', ...' if len(seeded) > 3 else ''}) drew from fixed "
            "seeds while requant calibrated and compared (float's and int8's runs saw the same noise); the written "
            "model draws as yours"
        )
    return lines


def _groups(count: int) -> str:
    return f"{count} group" + ("" if count == 1 else "s")


def placement_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's line on placement: groups kept float by cost, ops kept float by the table."""
    placed = report.get("quantizers", {}).get("placements", [])
    if not placed:
        return []
    groups = [p for p in placed if p.get("by", "cost") == "cost"]
    floats = [p for p in groups if p["placed"] == "float"]
    line = f"placement: {_groups(len(groups))} of int8 ops between kernels, {len(floats)} kept float"
    if floats:
        saved = sum(p["int8_us"] - p["float_us"] for p in floats)
        named = ", ".join("/".join(p["ops"]) for p in floats[:4]) + (", ..." if len(floats) > 4 else "")
        line += f" ({named}: modelled {saved:.1f} us faster)" if saved >= 0.05 else f" ({named}: as fast, no rounding)"
    by_table = [p for p in placed if p.get("by") == "table" and "anyway" not in p["why"]]
    if by_table:
        price = sum(p["float_us"] - p["int8_us"] for p in by_table)
        line += f"; {len(by_table)} ops kept float by the target's table for accuracy cost {price:.1f} us (modelled)"
    return [line]


def warning_lines(report: Mapping[str, Any]) -> list[str]:
    return [f"warning: {w}" for w in report.get("quantizers", {}).get("warnings", [])]
