"""Stage check: the int8 model measured against the float model on the evaluation data.

The first output's top-1 agreement (and accuracy, with labels), cosine and SQNR
(:mod:`requant.report.agreement`), and every quantized tensor compared on the first ``TENSOR_SAMPLES``
samples (:mod:`requant.report.compare`). (Latency: :mod:`requant.stages.speed`; every output on held-out
calibration samples: :mod:`requant.stages.outputs`.)

Reads: the final run, the float model, the evaluation data. Records: ``evaluation``, ``tensors``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from requant.calibration.samples import split_labels
from requant.report.agreement import Reference, agreement
from requant.report.compare import CompareError, compare
from requant.report.latency import session
from requant.runtime import in_stage
from requant.stages.run import Flow, Run

__all__ = ["TENSOR_SAMPLES", "check", "evaluation_lines"]

log = logging.getLogger("requant")

TENSOR_SAMPLES = 16  # the evaluation samples every quantized tensor is compared on, for the report


@in_stage("evaluation (the quantized model against float on the evaluation data)")
def check(flow: Flow, run: Run, evaluation: Any, reference: Reference) -> dict[str, Any]:
    """The report's ``evaluation`` and ``tensors``, with evaluation data."""
    found: dict[str, Any] = {}
    if run.float_proto is None or evaluation is None:
        return found
    converted = run.converted
    found["evaluation"] = agreement(converted.model, reference, session(converted.proto), evaluation)
    # tensor by tensor on the first evaluation samples, for the report's page (requant compare's records)
    inputs, _ = split_labels(evaluation, {str(v.name) for v in converted.model.graph.inputs})
    try:
        tensors = compare(run.float_proto, converted.proto, inputs, samples=TENSOR_SAMPLES)
        found["tensors"] = [t.to_json() for t in tensors]
    except CompareError as error:  # nothing quantized between QDQ pairs (a DynamicQuantizeLSTM alone)
        log.info("no tensor-by-tensor comparison: %s", error)
    return found


def evaluation_lines(report: Mapping[str, Any]) -> list[str]:
    ev = report.get("evaluation")
    if not ev:
        return []
    out = []
    if "float_accuracy" in ev:
        out.append(
            f"accuracy: float {ev['float_accuracy']:.4f}, int8 {ev['int8_accuracy']:.4f} ({int(ev['samples'])} samples)"
        )
    top1 = f"top-1 {ev['top1_agreement']:.4f}, " if ev.get("class_scores", 1.0) else ""  # (a map has no top-1)
    out.append(
        f"agreement with float: {top1}cosine {ev['cosine_similarity']:.5f}, "
        f"SQNR {ev['sqnr_db']:.1f} dB"
        + (f" (in {int(ev['shapes_differ'])} samples the first output's shape is not float's: compared where both "
           "computed)" if ev.get("shapes_differ") else "")
    )  # fmt: skip
    return out
