"""Stage choose (``method="auto"``, the default): the calibration method whose model is closest to float.

The model is annotated once and calibrated in one pass over the data for every candidate of
``AUTO_METHODS``, but the first samples, held out (:class:`~requant.calibration.samples.HeldOut`: none
when there are too few); the candidates are compared on those, first as calibrated and, when that is
closer than ``DECISIVE_DB``, again with their biases corrected on a few samples (scoring them
uncorrected alone chose worse on the CRNN of the bench); only the chosen one's biases are corrected
on all (starting from the sums of its sketch where there is one): the model ``method=<chosen>``
gives when calibrated on the samples after the held-out ones. Then bias correction is kept only
where it brings the output closer to float on the held-out samples (:func:`unless_worse`).

A detector (the float model's outputs on the first ``DETECTOR_SAMPLES`` hold boxes and class scores, as
:func:`requant.report.detections.heads` reads them) is not compared: its output's SQNR is not what its users
count. It is calibrated with ``stem_percentile`` on every sample, its stem and its head after its last kernels float
(:mod:`requant.targets.stem`, in the run's quantizer from then on: docs/calibration.md, "A detector").

Reads: the flow (samples, options, statistics). Adds: the run of the chosen method. Records:
``method_choice`` (every candidate's SQNR, how many samples were held out, why; a detector's ``stem_float`` and
``head_float``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import onnx
import onnx_ir as ir

from requant.calibration.calibrate import STEM_METHOD, STEM_PERCENTILE, calibrate
from requant.calibration.data import samples_for
from requant.calibration.runner import terminal_progress
from requant.encoding.weight_encoding import EncodingMemo
from requant.quantizers.quantizer import FLOAT
from requant.report.agreement import Reference, agreement
from requant.report.detections import heads
from requant.report.latency import session
from requant.report.markdown import method_summary
from requant.runtime import in_stage
from requant.stages.annotate import Prepared
from requant.stages.convert import SKETCH_SAMPLES, Converted, Staged, finish, sketch, stage
from requant.stages.run import Flow, Run
from requant.targets.stem import head_ops, stem_ops

__all__ = ["AUTO_METHODS", "CHOICE_SAMPLES", "DECISIVE_DB", "DETECTOR_SAMPLES", "choose_method", "detector", "lines"]

log = logging.getLogger("requant")

# method="auto" compares its candidates with biases corrected only when their uncorrected SQNRs are
# closer than this: held out, a wider gap chose as the corrected comparison did on the bench's models
# (MobileNetV2 2.4 -> 4.9 dB, ddddocr's detector 6.4 -> 10.5), a narrower one could flip (the CRNN:
# minmax by 1.2 dB uncorrected, mean_minmax by 1.7 corrected; EfficientNet-Lite0 0.25 -> 0.85)
DECISIVE_DB = 2.0
CHOICE_SAMPLES = 32  # the calibration samples method="auto" compares its candidates' outputs on
AUTO_METHODS = ("minmax", "mean_minmax")  # what method="auto" tries (mse: 1.6x the time, never chosen on the bench)
STEM_WHY = (f"a detector; maps at a quarter of the input's resolution or finer at {STEM_PERCENTILE} %, the head "
            "after its last kernels at its whole range, the rest at 99.999 %")  # fmt: skip
DETECTOR_SAMPLES = 2  # the first samples the float model runs on to tell a detector by its outputs


class Comparison:
    """The samples ``method="auto"`` compares its candidates on, and the float model's outputs on them
    (computed once, for every candidate): the ``held_out`` first calibration samples the candidates
    were not calibrated on, or as many first ones (fewer for large inputs, as bias correction counts
    them) when the data set was too small to hold any out."""

    def __init__(self, float_proto: onnx.ModelProto, model: ir.Model, flow: Flow, held_out: int) -> None:
        samples = flow.samples
        self.samples = samples.head(model, held_out) if held_out else samples.first(model, CHOICE_SAMPLES)
        known = flow.cache.outputs.arrays  # the float model's first outputs, where a probe kept them
        self.model, self.reference = model, Reference(float_proto, list(known[: len(self.samples)]))

    def scores(self, protos: Mapping[str, onnx.ModelProto]) -> dict[str, float]:
        """Each candidate's output SQNR against float on the samples."""
        return {
            m: agreement(self.model, self.reference, session(p), self.samples)["sqnr_db"] for m, p in protos.items()
        }


@in_stage("method choice (each candidate calibrated, converted and compared with float)")
def choose_method(flow: Flow) -> tuple[Run, dict[str, Any]]:
    """The run of the method closest to float, and the record of the choice; ``flow.method`` is set to
    it, and ``flow.correcting`` to whether its biases stayed corrected."""
    options, target = flow.options, flow.target
    prepared = flow.prepare(options.quantizer, True, flow.cache.outputs)
    assert prepared.float_model is not None
    float_proto, float_size = prepared.float_model
    assert float_proto is not None
    found, outputs = detector(float_proto, flow.samples.head(prepared.model, DETECTOR_SAMPLES))
    if found:  # no comparison: the output's SQNR is not what a detector's users count (docs/calibration.md)
        return _detector_run(flow, prepared, found, outputs)
    copies = [prepared.model.clone() for _ in AUTO_METHODS[1:]] + [prepared.model]  # each calibrated in place
    chosen: dict[str, list[Any]] = {}
    staged: dict[str, Staged] = {}
    memo: EncodingMemo = {}  # the candidates' weights are the same: encoded once
    held = flow.samples.held_out(lambda values: samples_for(values, CHOICE_SAMPLES))  # fewer for large inputs
    progress = options.progress
    for candidate, copy in zip(AUTO_METHODS, copies, strict=True):
        also = AUTO_METHODS[1:] if not chosen else ()  # one pass over the data for all
        chosen[candidate] = calibrate(copy, held, candidate, progress or terminal_progress(), flow.cache, also)
        staged[candidate] = stage(copy, target, options.measures_kernels, memo)
    method, choice, comparison, sketched, sums = _compare(flow, staged, float_proto, prepared.model, held.skipped)
    kept = staged.pop(method)
    staged.clear()  # the other candidate's model
    kernel_data = flow.kernel_data
    check = kernel_data is not None and options.bias_correction and "uncorrected_sqnr_db" in choice
    uncorrected = kept.model.clone() if check else None  # bias correction replaces the clone's tensors, not these
    converted = finish(kept, kernel_data, progress=progress or terminal_progress("measuring kernels"),
                       correct=options.bias_correction, sums=sums)  # fmt: skip
    if check and uncorrected is not None and comparison is not None:
        same = sketched is not None and converted.proto.SerializeToString() == sketched.SerializeToString()
        converted = unless_worse(converted, uncorrected, kept, comparison, choice, same)
    flow.method = method
    flow.correcting = options.bias_correction and choice.get("bias_correction_kept") is not False
    log.info("method auto: %s (output SQNR %s)", method, choice["output_sqnr_db"])
    return Run(prepared.report, float_proto, float_size, chosen[method], converted, prepared.evened), choice


def _detector_run(flow: Flow, prepared: Prepared, found: str, outputs: tuple[str, ...]) -> tuple[Run, dict[str, Any]]:
    """A detector's run: calibrated with ``stem_percentile`` on every sample (ABD-model on 56 of 64: recall 0.86 ->
    0.81), its stem and its head after its last kernels (the head's ``outputs``) float (:mod:`requant.targets.stem`:
    kept float in every later run too), unless the target is integer-only."""
    flow.method = STEM_METHOD
    model, integer = prepared.model, flow.target.integer_only
    stem, head = ([], []) if integer else (stem_ops(model), head_ops(model, outputs))
    choice = {"chosen": STEM_METHOD, "why": f"{found}: {STEM_WHY}", "samples": 0, "held_out": 0, "stem_float": stem,
              "head_float": head}  # fmt: skip
    if not stem and not head:
        return flow.run(flow.options.quantizer, STEM_METHOD, prepared=prepared), choice
    # float whole (outputs too), in this run's quantizer and so in every later run's: placement then prices the
    # activations after the stem as reading float (the stem's output requested int8 had left them int8: ABD-model's
    # recall 0.875 -> 0.810 on the bench's crops)
    quantizer = flow.options.quantizer.with_float_nodes([*stem, *head], FLOAT)
    flow.options = dataclasses.replace(flow.options, quantizer=quantizer)
    return flow.run(quantizer, STEM_METHOD), choice


_Compared = tuple[str, dict[str, Any], "Comparison | None", onnx.ModelProto | None, Any]


def _compare(flow: Flow, staged: dict[str, Staged], float_proto: onnx.ModelProto, model: ir.Model,
             held_out: int) -> _Compared:  # fmt: skip
    """The chosen method, the record, the comparison (None when the candidates are the same model), the
    chosen candidate as compared when it was compared corrected, and its sketch's bias sums."""
    correct = flow.options.bias_correction
    plain = {m: sketch(s, None, correct)[0] for m, s in staged.items()}  # biases as calibrated
    if len({p.SerializeToString() for p in plain.values()}) == 1:  # e.g. no activation quantized
        method, why = AUTO_METHODS[0], "the candidates are the same model"
        return (
            method,
            {"chosen": method, "output_sqnr_db": {}, "samples": 0, "held_out": 0, "why": why},
            None,
            None,
            None,
        )
    comparison = Comparison(float_proto, model, flow, held_out)
    first = comparison.scores(plain)
    best, second = sorted(first.values(), reverse=True)[:2]
    sums, scores, sketched = None, first, None
    kernel_data = flow.kernel_data
    if kernel_data is not None and correct and best - second < DECISIVE_DB:  # too close: correct, compare again
        sketches = {m: sketch(s, kernel_data, correct) for m, s in staged.items()}
        scores = comparison.scores({m: proto for m, (proto, _) in sketches.items()})
    method = max(scores, key=lambda m: (scores[m], -list(scores).index(m)))  # a tie keeps the first
    if scores is not first:
        sketched, sums = sketches[method]  # finishing starts from its sums: often the same model
    choice = {
        "chosen": method,
        "output_sqnr_db": scores,
        "uncorrected_sqnr_db": first,
        "biases_corrected": scores is not first,
        "sketch_samples": SKETCH_SAMPLES,
        "samples": len(comparison.samples),
        "held_out": held_out,
    }
    # not while finishing: the float model's session (its outputs on the samples are kept) and the candidates
    comparison.reference.release()
    return method, choice, comparison, sketched, sums


def unless_worse(
    converted: Converted,
    uncorrected: ir.Model,
    staged: Staged,
    comparison: Comparison,
    choice: dict[str, Any],
    as_compared: bool = False,
) -> Converted:
    """The model with corrected biases, unless its output is further from float on the held-out samples
    than the same model's without (then that one, its kernels still measured, none corrected).

    Bias correction measures each kernel's mean error with the others uncorrected and corrects all at
    once; on ddddocr's detector calibrated on 181 samples that made the output's SQNR 17.3 -> 9.0 dB
    (one early conv's correction; on the samples it was measured on too), where on 45 samples it
    helped. Checking costs one run of the held-out samples, none when ``as_compared`` (the model is
    the one the candidates were compared as: its score is known)."""
    method = choice["chosen"]
    corrected = (
        choice["output_sqnr_db"][method] if as_compared else comparison.scores({method: converted.proto})[method]
    )
    before = choice["uncorrected_sqnr_db"][method]
    choice["corrected_sqnr_db"] = corrected
    choice["bias_correction_kept"] = corrected >= before
    if corrected >= before:
        return converted
    log.warning("bias correction made the output further from float on the held-out samples (SQNR %.1f -> %.1f dB): "
                "not applied", before, corrected)  # fmt: skip
    plain = finish(Staged(uncorrected, staged.notes, staged.encodings, staged.floats, staged.tables))
    plain.kernels = [dataclasses.replace(k, corrected=False) for k in converted.kernels]
    return plain


def detector(float_proto: onnx.ModelProto, samples: list[Any]) -> tuple[str, tuple[str, ...]]:
    """What the float model's outputs on ``samples`` show of a detection head (boxes and class scores, as
    :func:`requant.report.detections.heads` reads them), or ``""``; and the names of the head's outputs."""
    runner = session(float_proto)
    names = [o.name for o in runner.get_outputs()]
    try:
        found = heads(names, [runner.run(None, dict(s)) for s in samples])
    except Exception:  # ONNX Runtime's failure on the float model: calibration runs it next and says what failed
        return "", ()
    if not found:
        return "", ()
    head = found[0]
    named = " and ".join(f"'{name}'" for name in head.names)
    held = f"output {named} holds" if len(head.names) == 1 else f"outputs {named} hold"
    return f"{held} boxes and {head.classes} class score{'s' if head.classes > 1 else ''}", head.names


def lines(report: Mapping[str, Any]) -> list[str]:
    choice = report.get("method_choice")
    return [f"method: {method_summary(choice)}"] if choice else []
