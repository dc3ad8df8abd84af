"""Stage check: the int8 model measured against the float model.

Latency at batch 1, the float and int8 models (and every model the accuracy budget tried) run
interleaved in one process (:mod:`requant.report.latency`); with evaluation data, the first output's
top-1 agreement (and accuracy, with labels), cosine and SQNR (:mod:`requant.report.agreement`), and
every quantized tensor compared on the first ``TENSOR_SAMPLES`` samples (:mod:`requant.report.compare`).

Reads: the final run, the float model, the samples (latency's first), the evaluation data, the
budget's tries. Records: ``latency_ms_batch1``, ``evaluation``, ``tensors`` (and each budget try's
latency, in its record).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from requant.calibration.samples import split_labels
from requant.report.agreement import Reference, agreement
from requant.report.compare import CompareError, compare
from requant.report.latency import interleaved_latency_ms, session
from requant.stages.run import Flow, Run

__all__ = ["TENSOR_SAMPLES", "check", "evaluation_lines", "latency_lines"]

log = logging.getLogger("requant")

TENSOR_SAMPLES = 16  # the evaluation samples every quantized tensor is compared on, for the report


def check(
    flow: Flow,
    run: Run,
    evaluation: Any,
    reference: Reference | None,
    budget: dict[str, Any] | None,
    tried: list[Run],
) -> tuple[dict[str, Any], Reference | None]:
    """The report's ``latency_ms_batch1``, ``evaluation`` and ``tensors`` (what is asked for), and the
    reference the evaluation measured against (its float outputs kept, for later checks)."""
    options = flow.options
    found: dict[str, Any] = {}
    if run.float_proto is None or not (options.measure or evaluation is not None):
        return found, reference
    converted = run.converted
    reference = reference or Reference(run.float_proto)  # the budget's, with its outputs
    f_session, q_session = reference.float_session(), session(converted.proto)  # once: latency and evaluation
    if options.measure:
        sample = flow.samples.head(converted.model, 1)[0]
        timed = [f_session, q_session]
        # what each try of the budget costs: every model it made, the first int8 one included, beside
        others = [i for i, candidate in enumerate(tried) if candidate is not run]
        timed += [session(tried[i].converted.proto) for i in others]
        times = interleaved_latency_ms(timed, sample)
        found["latency_ms_batch1"] = {"float": times[0], "quantized": times[1], "measured": "interleaved"}
        if budget is not None:
            measured = dict(zip(others, times[2:], strict=True))
            for i, step in enumerate(budget["tries"]):
                step["latency_ms"] = measured.get(i, times[1])
            budget["latency_ms_before"] = budget["tries"][0]["latency_ms"]
    if evaluation is not None:
        found["evaluation"] = agreement(converted.model, reference, q_session, evaluation)
        # tensor by tensor on the first evaluation samples, for the report's page (requant compare's records)
        inputs, _ = split_labels(evaluation, {str(v.name) for v in converted.model.graph.inputs})
        try:
            tensors = compare(run.float_proto, converted.proto, inputs, samples=TENSOR_SAMPLES)
            found["tensors"] = [t.to_json() for t in tensors]
        except CompareError as error:  # nothing quantized between QDQ pairs (a DynamicQuantizeLSTM alone)
            log.info("no tensor-by-tensor comparison: %s", error)
    return found, reference


def latency_lines(report: Mapping[str, Any]) -> list[str]:
    latency = report.get("latency_ms_batch1")
    if not latency:
        return []
    return [
        f"latency, batch 1: {latency['float']:.3f} ms -> {latency['quantized']:.3f} ms "
        f"({latency['quantized'] / latency['float']:.2f}x)"
    ]


def evaluation_lines(report: Mapping[str, Any]) -> list[str]:
    ev = report.get("evaluation")
    if not ev:
        return []
    out = []
    if "float_accuracy" in ev:
        out.append(
            f"accuracy: float {ev['float_accuracy']:.4f}, int8 {ev['int8_accuracy']:.4f} ({int(ev['samples'])} samples)"
        )
    out.append(
        f"agreement with float: top-1 {ev['top1_agreement']:.4f}, cosine {ev['cosine_similarity']:.5f}, "
        f"SQNR {ev['sqnr_db']:.1f} dB"
    )
    return out
