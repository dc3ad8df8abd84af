"""Stage budget: kernels kept float, so that the int8 model is close enough to float.

``keep_float_below`` (dB): the int8 convolutions and Gemms whose local SQNR against float (measured by
bias correction) is below it are kept float, in a second run. ``max_drop``: an accuracy budget on the
evaluation data: if the int8 model loses more, kernels are kept float (those with the largest measured
effect on the output, or the first ones in graph order), quantizing and evaluating again, until the
drop is within it; of the sets that meet it, the one the target's cost model prices least
(:mod:`requant.report.budget`).

Reads: the run, the evaluation data, the calibration samples (the ranking's). Adds: the run kept.
Records: ``kept_float_below`` and ``accuracy_budget`` (every try).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.calibration.samples import iter_samples, split_labels
from requant.report import detections
from requant.report.agreement import Reference, agreement
from requant.report.budget import (
    FAMILIES,
    BudgetStep,
    choose_metric,
    describe,
    drop,
    effect_ranking,
    fewest_of,
    float_cost_us,
    int8_kernels,
)
from requant.report.latency import session
from requant.runtime import in_stage
from requant.stages.run import Flow, Run

__all__ = ["RANKING_SAMPLES", "budget_line", "keep_float_below", "within_budget"]

log = logging.getLogger("requant")

RANKING_SAMPLES = 64  # the calibration samples the budget's ranking measures each kernel's effect on


@in_stage("keep-float-below (kernels far from float kept float)")
def keep_float_below(flow: Flow, run: Run) -> tuple[Run, dict[str, Any]]:
    """``run``, or a run with the kernels below ``keep_float_below`` dB kept float; the record."""
    threshold = flow.options.keep_float_below
    low = [k for k in run.converted.kernels if threshold is not None and k.sqnr_db < threshold]
    if low:
        log.info("keeping %d kernels float (local SQNR below %s dB); quantizing again", len(low), threshold)
        run = flow.again(run, [k.node for k in low])
        flow.kept_float += [k.node for k in low]  # and in every later run
    record = {"threshold_db": threshold, "kernels": [{"node": k.node, "sqnr_db": k.sqnr_db} for k in low]}
    return run, {"kept_float_below": record}


@dataclass
class _Search:
    """The budget's search over sets of kernels kept float: each set tried once, in the order tried."""

    flow: Flow
    first: Run
    evaluation: Any
    reference: Reference
    metric: str = ""
    measured: dict[str, float | None] = field(default_factory=dict)  # each kernel's local SQNR, where known
    effects: dict[str, float] = field(default_factory=dict)
    orders: dict[str, list[str]] = field(default_factory=dict)
    steps: list[BudgetStep] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    by_nodes: dict[frozenset[str], BudgetStep] = field(default_factory=dict)  # a set both families name: once
    priced: dict[tuple[str, int], float] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    heads: list[detections.Head] = field(default_factory=list)  # a detector's, on the evaluation samples
    samples: list[Any] = field(default_factory=list)  # the evaluation samples, read once (a detector's)
    floats: list[list[Any]] = field(default_factory=list)  # float's every output on them (a detector's)

    def evaluate(self, candidate: Run) -> dict[str, Any]:
        converted = candidate.converted
        if self.metric == "detections":  # float's detections against int8's, decoded (every output read)
            q_session = session(converted.proto)
            return detections.judge(self.heads[0], self.floats, [q_session.run(None, s) for s in self.samples])
        return agreement(converted.model, self.reference, session(converted.proto), self.evaluation)

    def _data(self) -> tuple[Any, Any]:
        """The evaluation data without its labels, and the labels (None without)."""
        return split_labels(self.evaluation, {str(v.name) for v in self.first.converted.model.graph.inputs})

    def labelled(self) -> bool:
        """Labels: a ``labels`` array, or integer targets a data loader gives with each sample (``(x, y)``)."""
        data, labels = self._data()
        if labels is not None:
            return True
        first = next(iter_samples(self.first.converted.model, data, "evaluation"))
        target = getattr(first, "target", None)
        return target is not None and np.asarray(target).dtype.kind in "iu"

    def detector(self) -> bool:
        """Whether the float model's outputs on the evaluation samples hold a detection head (the others run
        only where its first output on the first sample has many more anchors than rows, as a YOLO's)."""
        samples = iter_samples(self.first.converted.model, self._data()[0], "evaluation")
        float_session = self.reference.float_session()
        first = next(samples)
        outputs = float_session.run(None, first)
        if detections.anchored(np.shape(outputs[0])) is None:
            return False
        self.samples = [first, *samples]
        self.floats = [outputs, *(float_session.run(None, sample) for sample in self.samples[1:])]
        self.heads = detections.heads([o.name for o in float_session.get_outputs()], self.floats)
        return bool(self.heads)

    def rank(self, max_drop: float) -> None:
        """Each kernel's local SQNR where bias correction measured it (convolutions, Gemms; the others,
        a transformer's linear layers, LSTMs, are candidates too), its effect on the output when the
        first try is over budget, and the two orders the families take them in."""
        converted = self.first.converted
        local = {k.node: k.sqnr_db for k in converted.kernels}
        self.measured = {name: local.get(name) for name in int8_kernels(converted.model)}
        self.measured.update((name, sqnr) for name, sqnr in local.items() if name not in self.measured)
        if self.steps[0].drop > max_drop and self.measured:
            # the first sample gives the sizes of symbolic dimensions to the prices
            samples = self.flow.samples.head(converted.model, RANKING_SAMPLES)
            weights = {name: ir.serde.serialize_tensor(t) for name, t in converted.floats.items()}
            assert self.first.float_proto is not None  # kept: there is evaluation data
            ranking = effect_ranking(converted.proto, self.first.float_proto, sorted(self.measured), samples,
                                     session, weights)  # fmt: skip
            self.effects = dict(ranking)
            self.dims = _symbolic_sizes(converted.model, samples[0]) if samples else {}
        position = {node.name: i for i, node in enumerate(converted.model.graph)}

        def in_graph(name: str) -> tuple[int, str]:
            return position.get(name, len(position)), name

        def by_effect(name: str) -> tuple[float, float, tuple[int, str]]:  # unmeasured last, in graph order
            sqnr = self.measured[name]
            return -self.effects.get(name, -math.inf), math.inf if sqnr is None else sqnr, in_graph(name)

        self.orders = {"ranked": sorted(self.measured, key=by_effect), "first": sorted(self.measured, key=in_graph)}

    def within(self, family: str, k: int, max_drop: float) -> bool:
        nodes = self.orders[family][:k]
        known = self.by_nodes.get(frozenset(nodes))
        if known is None:
            log.info("accuracy budget: trying %d kernels float (%s)", k, family)
            self.runs.append(self.flow.again(self.first, nodes))
            lost = drop(self.evaluate(self.runs[-1]), self.metric)
            known = BudgetStep(k, lost, nodes, family, round(self.cost(family, k), 1))
            self.steps.append(known)
            self.by_nodes[frozenset(nodes)] = known
        return known.drop <= max_drop

    def cost(self, family: str, k: int) -> float:
        """The modelled microseconds the first ``k`` kernels of ``family`` float add to a run."""
        costs = self.flow.target.costs
        if (family, k) not in self.priced:
            nodes = self.orders[family][:k]
            self.priced[family, k] = float_cost_us(self.first.converted.model, nodes, costs, self.dims) if costs else k
        return self.priced[family, k]


@in_stage("accuracy budget (kernels kept float until the drop is within it)")
def within_budget(flow: Flow, run: Run, evaluation: Any, reference: Reference) -> tuple[Run, dict[str, Any], list[Run]]:
    """The run whose kernels kept float bring the drop within ``max_drop`` at the least modelled latency
    (without a cost model, the fewest kernels), the budget's record (every try) and every try's run,
    in the order of the record's tries."""
    max_drop = flow.options.max_drop
    assert max_drop is not None and run.float_proto is not None  # kept: there is evaluation data
    search = _Search(flow, run, evaluation, reference, runs=[run])
    asked, labelled = flow.options.metric, search.labelled()
    detector = (asked == "detections" or (asked is None and not labelled)) and search.detector()
    search.metric = choose_metric(asked, labelled, detector)
    first = search.evaluate(run)
    search.steps.append(BudgetStep(0, drop(first, search.metric)))
    search.rank(max_drop)
    steps = search.steps
    found = None
    if steps[0].drop > max_drop:
        found = fewest_of(list(search.orders), len(search.measured),
                          lambda family, k: search.within(family, k, max_drop), search.cost)  # fmt: skip
    met = found is not None or steps[0].drop <= max_drop
    if found is not None:
        final = search.by_nodes[frozenset(search.orders[found[0]][: found[1]])]
    elif met:
        final = steps[0]
    else:  # not even with every measured kernel float: the try that lost least
        final = min(steps, key=lambda s: (s.drop, s.kept_float))
        log.warning("the accuracy budget %s is not met: the smallest %s is %.4f with %d kernels float",
                    max_drop, describe(search.metric), final.drop, final.kept_float)  # fmt: skip
    record = _record(search, max_drop, met, final)
    flow.kept_float += final.nodes  # and in every later run
    return search.runs[next(i for i, s in enumerate(steps) if s is final)], record, search.runs


def _record(search: _Search, max_drop: float, met: bool, final: BudgetStep) -> dict[str, Any]:
    costs = search.flow.target.costs
    return {
        "metric": search.metric,
        "measures": describe(search.metric),
        "max_drop": max_drop,
        "met": met,
        "first_drop": search.steps[0].drop,
        "final_drop": final.drop,
        "family": final.family if final.kept_float else None,
        "families": FAMILIES,
        "priced_by": costs.name if costs else "the number of kernels kept float",
        "modelled_us": final.modelled_us,
        "ranked_by": f"the rise of the output's SQNR when the kernel alone is float ({RANKING_SAMPLES} calibration "
        "samples), largest first",
        "kept_float": [
            {"node": n, "effect_db": _measured(search.effects.get(n)), "sqnr_db": search.measured[n]}
            for n in final.nodes
        ],
        "tries": [s.__dict__ for s in search.steps],
        "candidates": len(search.measured),
    }


def _symbolic_sizes(model: ir.Model, sample: Mapping[str, Any]) -> dict[str, int]:
    """The sizes ``sample`` gives the symbolic dimensions of ``model``'s inputs (a sequence's length)."""
    sizes: dict[str, int] = {}
    for value in model.graph.inputs:
        array = sample.get(str(value.name))
        if array is None or value.shape is None or np.ndim(array) != len(value.shape):
            continue
        for d, size in zip(value.shape, np.shape(array), strict=True):
            if not isinstance(d, int) and d.value is not None:
                sizes.setdefault(str(d), int(size))
    return sizes


def _measured(effect: float | None) -> float | None:
    """An effect the ranking measured, or None (a kernel it could not make float alone: -inf)."""
    return effect if effect is not None and math.isfinite(effect) else None


def budget_line(budget: Mapping[str, Any], latency: Mapping[str, float] | None) -> str:
    kept = budget["kept_float"]
    line = f"accuracy budget: {budget['measures']} at most {budget['max_drop']:g}; {budget['first_drop']:.4f} at first"
    if kept:
        names = ", ".join(f"{k['node']} ({k['effect_db']:+.1f} dB)" if k["effect_db"] is not None else k["node"]
                          for k in kept[:3]) + (", ..." if len(kept) > 3 else "")  # fmt: skip
        which = "the first" if budget.get("family") == "first" else "the most effective"
        line += f", {budget['final_drop']:.4f} with {which} {len(kept)} of {budget['candidates']} kernels kept float"
        line += f": {names}"
        if budget.get("modelled_us") and not str(budget.get("priced_by", "")).startswith("the number"):
            least = "the least of the tries that met it" if budget["met"] else "not met"
            line += f" (modelled +{budget['modelled_us']:.0f} us a run, {least})"
    line += f"; {len(budget['tries']) - 1} re-quantizations"
    if not budget["met"]:
        line += " (NOT MET: the try that lost least is kept)"
    if latency and "latency_ms_before" in budget:
        line += f"; latency {budget['latency_ms_before'] / latency['float']:.2f}x -> "
        line += f"{latency['quantized'] / latency['float']:.2f}x of float"
        if round(latency["quantized"] / latency["float"], 2) >= 1.0:
            line += " (no faster than the float model, which meets any budget)"
    return line


def lines(report: Mapping[str, Any]) -> list[str]:
    budget = report.get("accuracy_budget")
    return [budget_line(budget, report.get("latency_ms_batch1"))] if budget else []


def kept_lines(report: Mapping[str, Any]) -> list[str]:
    kept = report.get("kept_float_below", {})
    if not kept.get("kernels"):
        return []
    names = ", ".join(f"{k['node']} {k['sqnr_db']:.1f} dB" for k in kept["kernels"])
    return [f"kept float (SQNR below {kept['threshold_db']:g} dB): {len(kept['kernels'])} kernels: {names}"]
