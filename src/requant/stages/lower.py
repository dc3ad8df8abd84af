"""Stage lower: the target's backend past the QDQ model. For ``tosa-int8``, the integer TOSA program
(:mod:`requant.backends.tosa`), run in requant's interpreter against its QDQ twin in ONNX Runtime on
the first calibration samples (in output steps), against the float model on the evaluation samples,
and with narrower accumulators when asked (``accumulator_bits``).

Reads: the final run, the samples, the evaluation data and the float outputs already computed.
Adds: the program. Records: ``tosa``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.backends.tosa import TosaError, TosaProgram, lower_to_tosa
from requant.backends.tosa.interpreter import ACCUMULATORS, run_tosa
from requant.calibration.samples import Samples, iter_samples, split_labels
from requant.report.agreement import Reference, agreement
from requant.report.latency import session
from requant.runtime import exact_twin, in_stage
from requant.stages.run import Flow, Run

__all__ = ["TOSA_CHECK_SAMPLES", "TOSA_EVAL_SAMPLES", "lines", "lower"]

log = logging.getLogger("requant")

TOSA_EVAL_SAMPLES = 32  # the evaluation samples the TOSA program runs on in requant's interpreter, against float
TOSA_CHECK_SAMPLES = 8  # calibration samples the TOSA program is run on against its QDQ twin
# fewer for large inputs, down to 2: requant's interpreter takes ~4 s a 736x992 photo (PP-OCRv4's
# detector: 8 of them were 38 of its 53 s), and 2 such photos are 1.5 million output values compared
TOSA_CHECK_VALUES = 8 * 3 * 224 * 224


@in_stage("lowering")
def lower(
    flow: Flow, run: Run, evaluation: Any, reference: Reference | None
) -> tuple[TosaProgram | None, dict[str, Any]]:
    """The program the target's backend writes past the QDQ model (None for a QDQ target), and its record."""
    options = flow.options
    if flow.target.backend != "tosa":
        return None, {}
    quantized = run.converted.model
    if options.output is not None and not str(options.output).endswith(".mlir"):
        log.info("target %s: writing the QDQ twin to %s (a path ending in .mlir gets the TOSA program)",
                 options.target, options.output)  # fmt: skip
    try:
        # dimensions the model leaves dynamic after the batch: the first calibration sample's
        first = flow.samples.head(quantized, 1)[0]
        program = lower_to_tosa(
            quantized, options.rounding or "single_round", {k: np.shape(v) for k, v in first.items()}
        )
    except TosaError as error:  # say why the node stayed float, from the quantizers' decisions
        why = [d.reason for r in run.quantizer_report.records for d in r.decisions
               if error.node in d.nodes and d.status == "rejected" and d.reason]  # fmt: skip
        if why:
            raise TosaError(f"{error}: {why[0]}", error.node) from None
        raise
    record = _tosa_record(program, run.converted.proto, quantized, flow.samples, options.accumulator_bits)
    if evaluation is not None and reference is not None:
        record["against_float"] = _against_float(program, quantized, reference, evaluation)
    return program, {"tosa": record}


def _ops(program: TosaProgram) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """The program's ops by kind, and every rescale (one scale, or the range of a per-channel one's)."""
    kinds: dict[str, int] = {}
    for op in program.ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    rescales = [
        {"op": op.output, "why": op.attrs["why"], "channels": len(op.attrs["scale"]),
         "scale": [min(op.attrs["scale"]), max(op.attrs["scale"])]}
        for op in program.ops if op.kind == "rescale"
    ]  # fmt: skip
    return dict(sorted(kinds.items())), rescales


def _tosa_record(
    program: TosaProgram, proto: onnx.ModelProto, model: ir.Model, data: Samples, accumulator_bits: int | None
) -> dict[str, Any]:
    """What lowering wrote (ops by kind, every rescale and why), and the program's outputs (requant's
    TOSA interpreter) against the QDQ twin's in ONNX Runtime on the first calibration samples, in
    output steps: the two round differently (fixed-point rescales against float ones). The twin's
    full-range int8 weights run as ``exact_twin`` stores them (ONNX Runtime's uint8 x int8 kernels
    saturate them on CPUs without VNNI: 11 steps on the digits CNN, where TOSA's int32 sums do
    not; the same figure on every CPU). With ``accumulator_bits``: per kernel, the share of its
    results a narrower accumulator cannot hold, and what saturating them does to the outputs."""
    kinds, rescales = _ops(program)
    q_session = session(exact_twin(proto))
    overflows: dict[str, list[int]] = {}
    largest, samples, narrowed = 0.0, 0, 0.0
    apart = compared = 0  # output values more than 2 steps apart, of all compared
    same: list[float] = []  # per integer output and sample: the share of indices equal to ONNX Runtime's
    size = sum(math.prod(e.shape) for e in program.inputs)
    count = max(2, min(TOSA_CHECK_SAMPLES, math.ceil(TOSA_CHECK_VALUES / max(size, 1))))
    for sample in data.head(model, count):
        if any(np.shape(sample[e.name]) != e.shape for e in program.inputs):
            continue  # the program is lowered for batch 1, and for the first sample's size
        ints = {e.name: e.quantize(sample[e.name]) for e in program.inputs}
        got = run_tosa(program, ints)
        expected = q_session.run(None, sample)
        for edge, value, reference in zip(program.outputs, got, expected, strict=False):
            if edge.dtype != "i8":  # indices (an ArgMax's): the same or not
                same.append(float(np.mean(value == reference)))
                continue
            steps = np.abs(edge.dequantize(value).astype(np.float64) - reference) / edge.scale
            largest = max(largest, float(steps.max(initial=0.0)))
            apart, compared = apart + int(np.count_nonzero(steps > 2.0 + 1e-6)), compared + steps.size
        if accumulator_bits is not None:
            narrow = run_tosa(program, ints, accumulator_bits=accumulator_bits, overflows=overflows)
            for value, wide in zip(narrow, got, strict=True):
                narrowed = max(narrowed, float(np.abs(value.astype(np.int64) - wide).max(initial=0)))
        samples += 1
    return {
        "rounding": program.rounding,
        "ops": kinds,
        "rescales": rescales,
        "accumulator": _accumulator(accumulator_bits, narrowed, overflows),
        "inputs": [e.__dict__ for e in program.inputs],
        "outputs": [e.__dict__ for e in program.outputs],
        "against_qdq": {
            "samples": samples,
            "largest_difference_steps": round(largest, 6),
            # a saturating output (a Sigmoid's) turns a step of difference before it into many: how rare
            "share_over_2_steps": apart / max(compared, 1),
            **({"same_indices": float(np.mean(same))} if same else {}),
        },
    }


def _accumulator(bits: int | None, narrowed: float, overflows: Mapping[str, list[int]]) -> dict[str, Any] | None:
    if bits is None:
        return None
    return {
        "bits": bits,
        "largest_output_change_steps": narrowed,
        "kernels": [{"node": n, "overflowed": c[0], "results": c[1], "share": c[0] / max(c[1], 1)}
                    for n, c in overflows.items()],
    }  # fmt: skip


class _TosaRun:
    """A TOSA program behind ONNX Runtime's ``run(None, feeds)``: inputs quantized as the host does,
    the program run in requant's interpreter, its outputs dequantized."""

    def __init__(self, program: TosaProgram) -> None:
        self.program = program

    def run(self, _: Any, feeds: Mapping[str, Any]) -> list[npt.NDArray[Any]]:
        ints = {e.name: e.quantize(feeds[e.name]) for e in self.program.inputs}
        return [e.dequantize(o) for e, o in zip(self.program.outputs, run_tosa(self.program, ints), strict=True)]


def _against_float(program: TosaProgram, quantized: ir.Model, reference: Reference, evaluation: Any) -> dict[str, Any]:
    """The integer program against the float model on the first ``TOSA_EVAL_SAMPLES`` evaluation
    samples of the program's shapes (requant's interpreter: seconds a sample on large inputs), as
    ``evaluation`` measures the QDQ model: top-1 agreement, cosine, SQNR; or why not."""
    data, _ = split_labels(evaluation, {str(v.name) for v in quantized.graph.inputs})
    shapes = {e.name: e.shape for e in program.inputs}
    samples: list[Mapping[str, Any]] = []
    skipped = False
    for sample in iter_samples(quantized, data, "evaluation"):
        if len(samples) == TOSA_EVAL_SAMPLES:
            break
        if all(tuple(np.shape(sample[name])) == shape for name, shape in shapes.items()):
            samples.append(sample)
        else:
            skipped = True
    if not samples:
        return {"samples": 0.0, "why": f"no evaluation sample has the program's input shapes {shapes}"}
    # the float outputs the report's evaluation kept are of the first samples: theirs while none is skipped
    known = reference if not skipped else Reference(reference.proto)
    measured = agreement(quantized, known, _TosaRun(program), samples)
    return {**measured, "interpreter": "requant's (the same integers as IREE's)"}


def lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's lines on the TOSA program: what it holds, against its QDQ twin and float."""
    tosa = report.get("tosa")
    if not tosa:
        return []
    kernels = {k: v for k, v in tosa["ops"].items() if k in ACCUMULATORS}
    check = tosa["against_qdq"]
    out = [
        f"TOSA: {sum(tosa['ops'].values())} ops ({', '.join(f'{k} x{v}' for k, v in kernels.items())}) for "
        + ", ".join(f"{e['name']} {'x'.join(str(d) for d in e['shape'])}" for e in tosa["inputs"])
        + ", "
        f"{len(tosa['rescales'])} rescales ({tosa['rounding']}); against the QDQ model in ONNX Runtime: at most "
        f"{check['largest_difference_steps']:.3g} output steps apart ({check['share_over_2_steps']:.2%} of the "
        f"values more than 2) on {check['samples']} samples"
        + (f", {check['same_indices']:.1%} of the indices the same" if "same_indices" in check else "")
    ]
    against = tosa.get("against_float")
    if against and against.get("top1_agreement") is not None:
        out.append(
            f"TOSA against float on {against['samples']:.0f} evaluation samples: top-1 agreement "
            f"{against['top1_agreement']:.4f}, cosine {against['cosine_similarity']:.5f}, "
            f"SQNR {against['sqnr_db']:.1f} dB"
        )
    elif against:
        out.append(f"TOSA against float: not measured ({against['why']})")
    if tosa["accumulator"] is not None:
        acc = tosa["accumulator"]
        over = [k for k in acc["kernels"] if k["overflowed"]]
        out.append(
            f"TOSA with {acc['bits']}-bit accumulators: {len(over)} of {len(acc['kernels'])} kernels overflow "
            f"on these samples; outputs move by up to {acc['largest_output_change_steps']:.0f} steps"
        )
    return out
