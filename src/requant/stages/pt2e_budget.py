"""Stage budget of the ``executorch-xnnpack`` target: kernels kept float until the ``.pte`` loses at most
``max_drop`` on the evaluation data, as on ONNX targets (:mod:`requant.stages.budget`; the metric and
the record are the same).

The int8 kernels and binary ops (MobileNetV2 with all 53 kernels float still lost 0.13 of its top-1
agreement: its residual sums are int8) are ranked by the signal each loses: the SQNR against float of
its (first) input, less that of its output (after its output's int8 type), in the converted program on
``RANKING_SAMPLES`` calibration samples (equalization's channel factors divided out); the float and
converted modules run side by side (FX interpreters). Two orders of them are tried, as on ONNX targets:
ranked, and first in graph order (one float region from the inputs); the fewest ops that bring the drop
within budget are found by doubling then bisection in each (``report.budget.fewest_of``): each try
annotates them float, quantizes with the method chosen first, lowers and evaluates the ``.pte``. XNNPACK
runs a float kernel too (its float delegate), so a try keeps every op delegated. Measured on MobileNetV2
(128 calibration crops, 256 evaluation crops, max_drop 0.05 of top-1 agreement): 0.145 at first, and
still 0.11-0.16 with up to 32 ops float in either order; met with 53 of the 63 ops float (0.035; 18 re-
quantizations, 416 s): its int8 error is spread over the whole network here.

Reads: the quantization, the samples, the evaluation data, ``max_drop`` and ``metric``. Adds: the
quantization kept. Records: ``accuracy_budget`` (every try).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from requant.pt2e.equalize import unscaled
from requant.pt2e.quantizer import folded_activation, look_at_outputs, role
from requant.report.agreement import Reference, agreement
from requant.report.budget import FAMILIES, BudgetError, choose_metric, describe, drop, fewest_of
from requant.stages.pte_bisect import cut_point, float_name, written_by

if TYPE_CHECKING:
    from requant.calibration.samples import Samples
    from requant.options import Options
    from requant.stages.pt2e import Exported, Quantized

__all__ = ["RANKING_SAMPLES", "lost_db", "within_budget"]

log = logging.getLogger("requant")

RANKING_SAMPLES = 16
MEANS = {"ranked": "the ops that lose the most SQNR from input to output", "first": FAMILIES["first"]}


def _kernels(converted: Any) -> list[tuple[str, str, str]]:
    """The converted program's int8 kernels and binary ops (a residual sum): (name, the node its (first)
    input is read from, its output's cut)."""
    found = []
    for node in converted.graph.nodes:
        x = node.args[0] if role(node) in ("kernel", "binary") and node.args else None
        if x is None or "dequantize" not in str(getattr(x, "target", "")):
            continue
        cut = cut_point(folded_activation(node) or node)
        if cut is not None:
            found.append((node.name, x.name, cut))
    return found


def lost_db(exported: Exported, converted: Any, samples: Sequence[Any]) -> dict[str, float]:
    """Each int8 kernel's SQNR lost from its input to its output (dB), by name."""
    kernels = _kernels(converted)
    module = exported.module
    float_graph = {n.name: n for n in module.graph.nodes}
    written = {c: written_by(converted, c) for _, _, c in kernels}
    wanted = {k: (float_graph[k].args[0].name, float_name(module.graph, written[c]))
              for k, _, c in kernels if k in float_graph}  # fmt: skip
    energy: dict[tuple[str, int], list[float]] = {}
    needed = {name for pair in wanted.values() for name in pair}
    places: dict[str, list[tuple[str, int]]] = {}  # a value is one kernel's output and the next one's input
    for k, x, c in kernels:
        if k in wanted:
            places.setdefault(x, []).append((k, 0))
            places.setdefault(c, []).append((k, 1))
    writers = {name: written_by(converted, name) for name in places}
    floats: dict[str, np.ndarray] = {}

    def keep(n: Any, f: Any) -> None:
        if n.name in needed:
            floats[n.name] = f.detach().numpy().copy()

    def add(n: Any, q: Any) -> None:
        for kernel, side in places.get(n.name, []):
            f = floats[wanted[kernel][side]].astype(np.float64)
            value = unscaled(converted, writers[n.name], q.detach().numpy())
            sums = energy.setdefault((kernel, side), [0.0, 0.0])
            sums[0] += float((f**2).sum())
            sums[1] += float(((f - value) ** 2).sum())

    for sample in samples:
        args = _tensors(tuple(sample[n] for n in exported.names))
        floats.clear()
        look_at_outputs(module, [args], keep)
        look_at_outputs(converted, [args], add)
    return {k: _db(energy.get((k, 0))) - _db(energy.get((k, 1))) for k in wanted}


def _tensors(args: tuple[Any, ...]) -> tuple[Any, ...]:
    from requant.backends.executorch.runtime import contiguous

    return tuple(contiguous(a) for a in args)


def _db(sums: list[float] | None) -> float:
    if not sums or sums[1] <= 0:
        return 99.0  # no noise measured: as good as float
    return float(10 * np.log10(sums[0] / sums[1]))


def within_budget(exported: Exported, run: Quantized, samples: Samples, evaluation: Samples,
                  options: Options) -> tuple[Quantized, dict[str, Any]]:  # fmt: skip
    """The quantization kept (of the tries that meet the budget, the one with the fewest ops float, ranked
    or first in graph order; else the one that lost least), and the ``accuracy_budget`` record."""
    from requant.backends.executorch import PteSession
    from requant.stages.pt2e import quantize_once

    max_drop = options.max_drop
    assert max_drop is not None
    reference = Reference(None, session=exported.float_session)
    first = agreement(exported.signature, reference, PteSession(run.lowered.pte, exported.names), evaluation)
    metric = choose_metric(options.metric, "float_accuracy" in first)
    tries: dict[tuple[str, int], tuple[float, Quantized]] = {("ranked", 0): (drop(first, metric), run)}
    orders: dict[str, list[tuple[str, float]]] = {}
    if tries["ranked", 0][0] > max_drop:
        lost = lost_db(exported, run.converted, samples.head(exported.signature, RANKING_SAMPLES))
        orders = {"ranked": sorted(lost.items(), key=lambda item: -item[1]), "first": list(lost.items())}
        if not lost:
            raise BudgetError("the accuracy budget found no int8 kernel to keep float")

        def within(family: str, k: int) -> bool:
            why = {n: f"the accuracy budget ({family}: {db:.1f} dB lost through it)" for n, db in orders[family][:k]}
            other = quantize_once(exported, samples, options, why, run.choice.get("chosen"))
            other.records["method_choice"] = run.choice
            evaluated = agreement(
                exported.signature, reference, PteSession(other.lowered.pte, exported.names), evaluation
            )
            tries[family, k] = (drop(evaluated, metric), other)
            log.info("accuracy budget: %s %d ops float -> %s %.4f", family, k, metric, tries[family, k][0])
            return tries[family, k][0] <= max_drop

        fewest_of(list(FAMILIES), len(lost), within)
    met = [key for key, (d, _) in tries.items() if d <= max_drop]
    family, kept = (
        min(met, key=lambda key: (key[1], key[0] != "ranked"))
        if met
        else min(tries, key=lambda key: (tries[key][0], key[1]))
    )
    record = {"measures": describe(metric), "metric": metric, "max_drop": max_drop,
              "first_drop": tries["ranked", 0][0], "final_drop": tries[family, kept][0], "met": bool(met),
              "family": family, "family_means": MEANS[family], "priced_by": "the number of ops kept float",
              "candidates": len(orders.get("first", [])) or len(_kernels(run.converted)),
              "kept_float": [{"node": n, "effect_db": -db} for n, db in orders.get(family, [])[:kept]],
              "ranking": "SQNR each op loses from its input to its output (dB), most first",
              "tries": [{"family": f, "kept_float": k, "drop": d} for (f, k), (d, _) in tries.items()]}  # fmt: skip
    return tries[family, kept][1], {"accuracy_budget": record}
