"""requant's main job: ``quantize(model, calibration_data)``, and its steps for those who want to look between them.

``prepare`` (load, canonicalize, annotate) -> ``calibrate`` (observers over the data) ->
``convert`` (propagate, write QDQ, correct biases, lint). ``quantize`` runs them all and measures
the result.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.backends import finish_qdq, materialize_qdq
from requant.backends.tosa import TosaError, TosaProgram, lower_to_tosa
from requant.backends.tosa_mlir import to_mlir
from requant.backends.tosa_reference import ACCUMULATORS as TOSA_ACCUMULATORS
from requant.backends.tosa_reference import run_tosa
from requant.calibration.bias_correction import (
    DEFAULT_SAMPLES,
    BiasCorrection,
    BiasSums,
    correct_biases,
    float_parameters,
)
from requant.calibration.calibrate import StatisticsCache, calibrate  # the step itself: observers over the data
from requant.calibration.data import (
    HeldOut,
    Replayed,
    check_exists,
    first_samples,
    iter_samples,
    read_labels,
    samples_for,
)
from requant.calibration.equalization import MAX_SCALE, Equalization, equalize_depthwise, unless_per_channel
from requant.calibration.observers import CalibrationError
from requant.calibration.propagate import propagate
from requant.calibration.runner import Kept, Progress, terminal_progress
from requant.calibration.smoothing import DEFAULT_ALPHA, Smoothing, smooth_linears
from requant.calibration.weight_encoding import EncodingMemo, WeightEncoding
from requant.errors import ArgumentError, RequantError
from requant.frontends import LoadError, check_outputs, load, save_onnx, save_text, serialized_size
from requant.ir.annotations import iter_values
from requant.passes import get_passes, run_passes
from requant.passes._rewrite import with_opset
from requant.passes.compute_in_float32 import HALF
from requant.quantizers import Quantizer, QuantizerReport
from requant.quantizers.placement import Placement, place, price_kept_float
from requant.quantizers.quantizer import FLOAT_PLACED
from requant.report.budget import (
    FAMILIES,
    METRICS,
    BudgetStep,
    choose_metric,
    describe,
    drop,
    effect_ranking,
    fewest_of,
    float_cost_us,
    int8_kernels,
)
from requant.report.compare import CompareError, compare
from requant.report.latency import interleaved_latency_ms, session
from requant.report.lint import LintResult, lint
from requant.report.markdown import encoding_summary, method_summary
from requant.runtime import exact_twin, one_blas_thread
from requant.targets.costs import CostModel
from requant.targets.kernels import ONNXRUNTIME_X86_VNNI, host_kernel_model
from requant.targets.registry import DEFAULT_TARGET, Target, get_target

__all__ = ["QuantizedModel", "calibrate", "convert", "prepare", "quantize"]

log = logging.getLogger("requant")


@dataclass
class QuantizedModel:
    """The quantized model (QDQ ONNX) and its report (a JSON-able dict); for the ``tosa-int8`` target,
    also its integer TOSA program (``tosa``; ``mlir()`` its text). ``save(path)`` writes the model:
    MLIR text for a path ending in ``.mlir``, the QDQ model otherwise."""

    model: ir.Model
    report: dict[str, Any] = field(default_factory=dict)
    tosa: TosaProgram | None = None

    def mlir(self) -> str:
        if self.tosa is None:
            raise RequantError("only the tosa-int8 target writes MLIR (quantize with target='tosa-int8')")
        return to_mlir(self.tosa)

    def save(self, path: str | os.PathLike[str]) -> None:
        if str(path).endswith(".mlir"):
            save_text(self.mlir(), path)
        else:
            save_onnx(self.model, path)


def prepare(
    source: Any,
    quantizer: Quantizer | None = None,
    target: str = DEFAULT_TARGET,
    strict: bool = False,
    smoothing_data: Any = None,
    smoothing: float | None = DEFAULT_ALPHA,
    equalization: bool = True,
    **load_options: Any,
) -> tuple[ir.Model, QuantizerReport]:
    """Load, canonicalize, smooth the linear layers' inputs and equalize the depthwise convs' (with
    ``smoothing_data``, calibration samples; :mod:`requant.calibration.smoothing`,
    :mod:`requant.calibration.equalization`) and annotate (with ``quantizer``, or the preset
    ``choose_preset`` picks for the model among the target's).

    ``strict``: a node a quantizer was asked to quantize but could not is an error naming it. An
    ``ir.Model`` given as ``source`` is copied first: the caller's model is never changed.
    """
    smooth = _evening(smoothing, equalization, smoothing_data, None, {}) if smoothing_data is not None else None
    model, report, _, _ = _prepare(source, quantizer, target, strict, None, smooth, **load_options)
    return model, report


@dataclass
class _Smoothing:
    """How to even out channels before quantizing, over ``data``: smooth linear layers with ``alpha``
    (None: not), equalize depthwise convs' inputs (``equalize``); ``ranges``: channel ranges already
    measured; ``outputs``: where equalization's probe keeps the float model's first output."""

    alpha: float | None
    data: Any
    progress: Progress | None
    ranges: dict[str, Any]
    equalize: bool = False
    outputs: Kept | None = None


def _evening(alpha: float | None, equalize: bool, data: Any, progress: Progress | None,
             ranges: dict[str, Any], outputs: Kept | None = None) -> _Smoothing | None:  # fmt: skip
    return _Smoothing(alpha or None, data, progress, ranges, equalize, outputs) if alpha or equalize else None


@dataclass(frozen=True)
class Evened:
    """What smoothing and equalization did to the float model before it was annotated."""

    smoothing: Smoothing
    equalization: Equalization


_Prepared = tuple[ir.Model, QuantizerReport, tuple[onnx.ModelProto | None, int] | None, Evened]
PLACEMENT_ROUNDS = 3  # annotations after the first: a group kept float can make its neighbours' float cheaper


def _prepare(
    source: Any,
    quantizer: Quantizer | None,
    target: str,
    strict: bool,
    keep_float: bool | None,
    smoothing: _Smoothing | None = None,
    **load_options: Any,
) -> _Prepared:
    """``_annotate``, then placement by the target's cost model (:mod:`requant.quantizers.placement`):
    while groups of int8 ops cost more than their float versions, the model is annotated again with
    them kept float (``FLOAT_PLACED``); every group's decision goes to the report."""
    prepared = _annotate(source, quantizer, target, strict, keep_float, smoothing, **load_options)
    chosen = get_target(target)
    costs = chosen.costs
    if costs is None:
        return prepared
    quantizer = (quantizer or Quantizer().set_global_by_model()).for_table(chosen.table)
    decided: dict[tuple[str, ...], Placement] = {}
    for _ in range(PLACEMENT_ROUNDS):
        found = place(prepared[0], costs)
        decided.update((tuple(p.nodes), p) for p in found)
        if not any(p.placed == "float" for p in found):
            break
        floats = [name for p in decided.values() if p.placed == "float" for name in p.nodes]
        prepared = _annotate(
            source, quantizer.with_float_nodes(floats, FLOAT_PLACED), target, strict, keep_float, smoothing,
            **load_options,
        )  # fmt: skip
    kept = price_kept_float(prepared[0], costs)
    prepared[1].placements = [p.to_json() for p in (*decided.values(), *kept)]
    return prepared


def _target_passes(model: ir.Model, target: Target) -> tuple[ir.Model, list[dict[str, str]]]:
    """``model`` after the target's passes (``Target.passes``), its opset raised first where a pass
    needs a newer one for what it finds, and what they rewrote (as the quantizers' decompositions are
    reported)."""
    done = []
    for name in target.passes:
        for rewrite in get_passes(name):
            found = rewrite.finds(model)
            current = model.opset_imports.get("", 0)
            why = f"{target.name}: {rewrite.name}"
            if found and current < rewrite.opset:
                log.info("raising the opset from %d to %d for %s (ONNX's version converter)", current, rewrite.opset,
                         rewrite.name)  # fmt: skip
                model = with_opset(model, rewrite.opset)
                why += f" (the model's opset raised from {current} to {rewrite.opset} for it)"
            model, _ = run_passes(model, [rewrite])
            done += [{"node": f, "into": rewrite.into or rewrite.name, "why": why} for f in found]
    return model, done


def _annotate(
    source: Any,
    quantizer: Quantizer | None,
    target: str,
    strict: bool,
    keep_float: bool | None,
    smoothing: _Smoothing | None = None,
    **load_options: Any,
) -> _Prepared:
    """``prepare``; with ``keep_float`` not None, also the float model as canonicalized, before
    smoothing, the quantizers' annotations and the target's decompositions (the reference for latency
    and evaluation: a decomposed HardSwish runs slower in float), serialized if ``keep_float``, and
    its size; and what smoothing did."""
    chosen = get_target(target)
    if isinstance(source, ir.Model):
        source = source.clone()
    model = load(source, **load_options)
    model, _ = run_passes(model, get_passes("canonicalize"))
    model, rewritten = _target_passes(model, chosen)
    for value in model.graph.inputs:
        if value.dtype == ir.DataType.BFLOAT16 and value.name not in model.graph.initializers:
            raise LoadError(
                f"input '{value.name}' is bfloat16: ONNX Runtime's Python API takes no bfloat16 arrays (NumPy has no "
                "such type), so the model cannot be calibrated, nor its quantized version fed; export it with float32 "
                "or float16 inputs (bfloat16 weights and ops inside are fine: requant computes them in float32)"
            )
    half = sorted({str(v.dtype) for v in iter_values(model.graph) if v.dtype in HALF})
    if half:  # ONNX Runtime's CPU int8 kernels (every target so far) take float32 scales and activations
        model, _ = run_passes(model, get_passes("compute-in-float32"))
    float_info = None
    if keep_float is not None:
        # the float model serialized only where a float session needs it (held through calibration,
        # it was MiniLM's largest allocation); otherwise just its size
        proto = ir.serde.serialize_model(model) if keep_float else None
        float_info = (proto, proto.ByteSize() if proto is not None else serialized_size(model))
    quantizer = (quantizer or Quantizer().set_global_by_model()).for_table(chosen.table)
    smoothed, equalized = Smoothing([], [], "off"), Equalization([], "off")
    if smoothing is not None:
        progress = smoothing.progress or terminal_progress("measuring channels")
        if smoothing.alpha:
            smoothed = smooth_linears(model, smoothing.data, smoothing.alpha, progress, smoothing.ranges)
            if chosen.backend != "tosa":  # integer-only: there a Mul by a positive constant is a per-channel rescale
                quantizer = quantizer.with_float_nodes(smoothed.muls)  # each scales its input per channel: kept float
        if smoothing.equalize:
            equalized = equalize_depthwise(model, smoothing.data, progress, smoothing.ranges, outputs=smoothing.outputs)
    report = quantizer.quantize(model, strict=strict, presets=chosen.presets)
    report.decomposed[:0] = rewritten
    equalized = unless_per_channel(equalized)
    if half:
        kind = " and ".join(t.lower() for t in half)
        report.compute = (
            f"float32 (the model computed in {kind}; ONNX Runtime's CPU int8 kernels take float32 scales and "
            f"activations: its inputs and outputs keep their {kind} types, through Casts)"
        )
    return model, report, float_info, Evened(smoothed, equalized)


def convert(
    model: ir.Model,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
    target: str = DEFAULT_TARGET,
) -> tuple[ir.Model, list[Any], LintResult]:
    """Propagate shared, derived and fixed requests, encode weights for the target's kernels, write
    QDQ, and lint the result in ONNX Runtime.

    With ``bias_data`` (calibration samples), the int8 convolutions and Gemms are measured against
    their float versions on its first ``bias_samples`` samples and, with ``correct``, their int32
    biases corrected (:mod:`requant.calibration.bias_correction`).
    """
    converted = _convert(model, get_target(target), bias_data, bias_samples, progress, correct)
    return converted.model, converted.notes, converted.lint_result


@dataclass
class _Converted:
    model: ir.Model
    proto: onnx.ModelProto  # serialized once: lint and the report share it
    notes: list[Any]
    encodings: list[WeightEncoding]
    lint_result: LintResult
    kernels: list[BiasCorrection]
    # the kernels' float weights and biases as quantized (smoothed, equalized), by value name
    floats: dict[str, ir.TensorProtocol] = field(default_factory=dict)


def _convert(
    model: ir.Model,
    target: Target,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
) -> _Converted:
    """``convert``, with what the report needs besides."""
    return _finish(_stage(model, target, bias_data is not None), bias_data, bias_samples, progress, correct)


@dataclass
class _Staged:
    """A calibrated model with its QDQ written, before bias correction and the final rewrites."""

    model: ir.Model
    notes: list[Any]
    encodings: list[WeightEncoding]
    floats: dict[str, ir.TensorProtocol]  # the kernels' float parameters, for bias correction


def _stage(model: ir.Model, target: Target, keep_floats: bool, memo: EncodingMemo | None = None) -> _Staged:
    propagation = propagate(model, target.kernels, memo, target.table.same_scale)
    floats = float_parameters(model) if keep_floats else {}
    return _Staged(materialize_qdq(model), propagation.notes, propagation.encodings, floats)


def _finish(
    staged: _Staged,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
    sums: BiasSums | None = None,
) -> _Converted:
    """``sums``: what a sketch of ``staged`` measured, for bias correction to start from."""
    model = staged.model
    kernels = []
    if bias_data is not None:
        kernels = correct_biases(model, staged.floats, bias_data, bias_samples, progress, correct, sums)
    finish_qdq(model)
    proto = ir.serde.serialize_model(model)
    return _Converted(model, proto, staged.notes, staged.encodings, lint(proto), kernels, staged.floats)


def _sketch(staged: _Staged, bias_data: Any, correct: bool) -> tuple[onnx.ModelProto, BiasSums]:
    """``staged`` finished on a copy with biases corrected on only ``SKETCH_SAMPLES`` samples, serialized
    (``staged`` itself is untouched): a cheaper stand-in for comparing candidates; and what its bias
    correction summed, which finishing ``staged`` starts from."""
    copy = staged.model.clone()
    sums = BiasSums()
    if bias_data is not None:
        correct_biases(copy, staged.floats, bias_data, SKETCH_SAMPLES, lambda done, elapsed: None, correct, sums)
    finish_qdq(copy)
    return ir.serde.serialize_model(copy), sums


@dataclass
class _Run:
    """One pass of prepare -> calibrate -> convert."""

    quantizer_report: QuantizerReport
    float_proto: onnx.ModelProto | None
    float_size: int
    chosen: list[Any]
    converted: _Converted
    evened: Evened


def _run(
    model: Any,
    quantizer: Quantizer,
    target: Target,
    strict: bool,
    data: Any,
    method: str | None,
    progress: Progress | None,
    measure_kernels: bool,
    correct: bool,
    keep_float_proto: bool,
    load_options: Mapping[str, Any],
    cache: StatisticsCache,
    float_info: tuple[onnx.ModelProto | None, int] | None = None,
    smoothing: float | None = None,
    equalize: bool = False,
) -> _Run:
    """``float_info``: the float model (or None) and its size from an earlier run of the same model;
    ``smoothing``: the alpha linear layers are smoothed with (None: not smoothed); ``equalize``: whether
    depthwise convs' inputs are equalized."""
    keep = keep_float_proto if float_info is None else None
    smooth = _evening(smoothing, equalize, data, progress, cache.channels)
    prepared, quantizer_report, measured, evened = _prepare(
        model, quantizer, target.name, strict, keep, smooth, **load_options
    )
    float_info = float_info or measured
    assert float_info is not None
    float_proto, float_size = float_info
    chosen = calibrate(prepared, data, method, progress or terminal_progress(), cache)
    kernel_data = data if measure_kernels else None
    kernel_progress = progress or terminal_progress("measuring kernels")
    converted = _convert(prepared, target, kernel_data, progress=kernel_progress, correct=correct)
    return _Run(quantizer_report, float_proto, float_size, chosen, converted, evened)


@dataclass
class _Reference:
    """The float model and, once computed (or known from a probe), its first output on each evaluation
    sample: the accuracy budget evaluates every try, and the report the final model, against the same
    outputs. Its session is made when an output is not known yet."""

    proto: onnx.ModelProto | None
    outputs: list[npt.NDArray[Any]] | None = None
    session: Any = None

    def float_session(self) -> Any:
        if self.session is None:
            self.session = session(self.proto)
        return self.session

    def run(self, sample: Mapping[str, Any]) -> npt.NDArray[Any]:
        return np.asarray(self.float_session().run(None, sample)[0])

    def release(self) -> None:
        """Drop the float model and its session (the outputs stay)."""
        self.proto = self.session = None


def _predictions(output: npt.NDArray[Any]) -> npt.NDArray[np.intp]:
    """The top-1 classes of a first output: one per sample, or, for a ``[N, T, classes]`` output (a
    sequence: a CTC text recognizer's, a token classifier's), one per position (the argmax of a
    whole ``[T, classes]`` sample says nothing: PP-OCRv4's recognizer's is one of 40 x 6,625)."""
    array = np.asarray(output)
    rows = array.reshape(-1, array.shape[-1]) if array.ndim == 3 else array.reshape(len(array), -1)
    return rows.argmax(1)  # type: ignore[no-any-return]


def _agreement(model: ir.Model, reference: _Reference, q_session: Any, data: Any) -> dict[str, float]:
    """Top-1 agreement (and accuracy, with labels), cosine similarity and SQNR of the first output,
    a sample at a time (a 736x992 probability map's worth of float64 copies is not kept)."""
    data, labels = _split_labels(data, {str(v.name) for v in model.graph.inputs})
    known = reference.outputs or []
    outs_f: list[npt.NDArray[Any]] = []
    cosines, tops_f, tops_q = [], [], []
    energy = noise = 0.0
    for i, sample in enumerate(iter_samples(model, data, "evaluation"), start=1):
        outs_f.append(reference.run(sample) if i > len(known) else known[i - 1])
        q = np.asarray(q_session.run(None, sample)[0])
        for what, output in (("float", outs_f[-1]), ("quantized", q)):
            if not np.isfinite(output).all():  # agreement figures would be NaN: say where instead
                raise CalibrationError(f"evaluation sample {i}: the {what} model's first output is not finite")
        f2 = outs_f[-1].reshape(len(outs_f[-1]), -1).astype(np.float64)
        q2 = q.reshape(len(q), -1).astype(np.float64)
        norms = np.linalg.norm(f2, axis=1) * np.linalg.norm(q2, axis=1) + 1e-12
        cosines.append(np.einsum("ij,ij->i", f2, q2) / norms)
        tops_f.append(_predictions(outs_f[-1]))
        tops_q.append(_predictions(q))
        energy += float(np.einsum("ij,ij->", f2, f2))
        noise += float(np.einsum("ij,ij->", f2 - q2, f2 - q2))
    reference.outputs = outs_f
    top_f, top_q = np.concatenate(tops_f), np.concatenate(tops_q)
    samples = sum(len(o) for o in outs_f)
    if labels is not None:
        labels = np.asarray(labels).reshape(-1)
        if len(labels) != len(top_f) and len(top_f) == samples:
            raise CalibrationError(
                f"the evaluation data has {len(top_f)} samples (first output rows) but {len(labels)} labels: "
                "'labels' needs one class index per sample"
            )
        if len(labels) != len(top_f):
            raise CalibrationError(
                f"the evaluation data has {len(top_f)} predictions ({samples} samples of a [N, T, classes] first "
                f"output, one at each of its T positions) but {len(labels)} labels: 'labels' needs one class index "
                "per position"
            )
    metrics = {
        "samples": float(samples),
        "top1_agreement": float(np.mean(top_f == top_q)),
        "cosine_similarity": float(np.mean(np.concatenate(cosines))),
        "sqnr_db": float(10 * np.log10(energy / noise)) if noise > 0 else float("inf"),
    }
    if labels is not None:
        metrics["float_accuracy"] = float(np.mean(top_f == labels))
        metrics["int8_accuracy"] = float(np.mean(top_q == labels))
    return metrics


TENSOR_SAMPLES = 16  # the evaluation samples every quantized tensor is compared on, for the report
TOSA_EVAL_SAMPLES = 32  # the evaluation samples the TOSA program runs on in requant's interpreter, against float
RANKING_SAMPLES = 64  # the calibration samples the budget's ranking measures each kernel's effect on
SKETCH_SAMPLES = 8  # the samples each candidate of method="auto" has its biases corrected on, to compare
# method="auto" compares its candidates with biases corrected only when their uncorrected SQNRs are
# closer than this: held out, a wider gap chose as the corrected comparison did on the bench's models
# (MobileNetV2 2.4 -> 4.9 dB, ddddocr's detector 6.4 -> 10.5), a narrower one could flip (the CRNN:
# minmax by 1.2 dB uncorrected, mean_minmax by 1.7 corrected; EfficientNet-Lite0 0.25 -> 0.85)
DECISIVE_DB = 2.0
CHOICE_SAMPLES = 32  # the calibration samples method="auto" compares its candidates' outputs on
AUTO_METHODS = ("minmax", "mean_minmax")  # what method="auto" tries (mse: 1.6x the time, never chosen on the bench)
# method=None with the presets' observers (or a config that names none): MobileNetV2 0.797 -> 0.877 top-1
# agreement, the other bench models as good as their best method, in less time than NNCF (calibration.md)
DEFAULT_METHOD = "auto"


def _run_auto(
    model: Any,
    quantizer: Quantizer,
    target: Target,
    strict: bool,
    data: Any,
    progress: Progress | None,
    measure_kernels: bool,
    correct: bool,
    load_options: Mapping[str, Any],
    cache: StatisticsCache,
    smoothing: float | None,
    equalize: bool = False,
) -> tuple[_Run, str, dict[str, Any]]:
    """``_run`` with each of ``AUTO_METHODS``: the model prepared once and calibrated in one pass over
    the data for all, but the first samples (``HeldOut``: none when there are too few); the candidates
    are compared on those held-out samples, first as calibrated and, when that is closer than
    ``DECISIVE_DB``, again with their biases corrected on a few samples (scoring them uncorrected
    alone chose worse on the CRNN of the bench); only the chosen one's biases are corrected on all
    (starting from the sums of its sketch where there is one): the model ``method=<chosen>`` gives
    when calibrated on the samples after the held-out ones."""
    smooth = _evening(smoothing, equalize, data, progress, cache.channels, cache.outputs)
    prepared, quantizer_report, float_info, evened = _prepare(
        model, quantizer, target.name, strict, True, smooth, **load_options
    )
    assert float_info is not None and float_info[0] is not None
    copies = [prepared.clone() for _ in AUTO_METHODS[1:]] + [prepared]  # each calibrated in place
    chosen: dict[str, list[Any]] = {}
    staged: dict[str, _Staged] = {}
    memo: EncodingMemo = {}  # the candidates' weights are the same: encoded once
    # the candidates are compared on samples they are not calibrated on (fewer for large inputs)
    held = HeldOut(data, lambda values: samples_for(values, CHOICE_SAMPLES))
    for candidate, copy in zip(AUTO_METHODS, copies, strict=True):
        also = AUTO_METHODS[1:] if not chosen else ()  # one pass over the data for all
        chosen[candidate] = calibrate(copy, held, candidate, progress or terminal_progress(), cache, also)
        staged[candidate] = _stage(copy, target, measure_kernels, memo)
    kernel_data = data if measure_kernels else None
    plain = {m: _sketch(s, None, correct)[0] for m, s in staged.items()}  # biases as calibrated
    sketched: onnx.ModelProto | None = None  # the chosen candidate as compared, when compared corrected
    if len({p.SerializeToString() for p in plain.values()}) == 1:  # e.g. no activation quantized
        method, why = AUTO_METHODS[0], "the candidates are the same model"
        choice: dict[str, Any] = {"chosen": method, "output_sqnr_db": {}, "samples": 0, "held_out": 0, "why": why}
        sums = None
    else:
        comparison = _Comparison(float_info[0], prepared, data, held.skipped, cache.outputs.arrays)
        first = comparison.scores(plain)
        best, second = sorted(first.values(), reverse=True)[:2]
        sums, scores = None, first
        if kernel_data is not None and correct and best - second < DECISIVE_DB:  # too close: correct, compare again
            sketches = {m: _sketch(s, kernel_data, correct) for m, s in staged.items()}
            scores = comparison.scores({m: proto for m, (proto, _) in sketches.items()})
        method = max(scores, key=lambda m: (scores[m], -list(scores).index(m)))  # a tie keeps the first
        if scores is not first:
            sketched, sums = sketches[method]  # finishing starts from its sums: often the same model
            del sketches
        choice = {
            "chosen": method,
            "output_sqnr_db": scores,
            "uncorrected_sqnr_db": first,
            "biases_corrected": scores is not first,
            "sketch_samples": SKETCH_SAMPLES,
            "samples": len(comparison.samples),
            "held_out": held.skipped,
        }
        # not while finishing: the float model's session (its outputs on the samples are kept) and the candidates
        comparison.reference.release()
        del plain
    kept = staged.pop(method)
    staged.clear()  # the other candidate's model
    check = kernel_data is not None and correct and "uncorrected_sqnr_db" in choice
    uncorrected = kept.model.clone() if check else None  # bias correction replaces the clone's tensors, not these
    converted = _finish(kept, kernel_data, progress=progress or terminal_progress("measuring kernels"),
                        correct=correct, sums=sums)  # fmt: skip
    if check and uncorrected is not None:
        same = sketched is not None and converted.proto.SerializeToString() == sketched.SerializeToString()
        converted = _unless_worse(converted, uncorrected, kept, comparison, choice, same)
    return _Run(quantizer_report, float_info[0], float_info[1], chosen[method], converted, evened), method, choice


def _unless_worse(
    converted: _Converted,
    uncorrected: ir.Model,
    staged: _Staged,
    comparison: _Comparison,
    choice: dict[str, Any],
    as_compared: bool = False,
) -> _Converted:
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
    plain = _finish(_Staged(uncorrected, staged.notes, staged.encodings, staged.floats))
    plain.kernels = [dataclasses.replace(k, corrected=False) for k in converted.kernels]
    return plain


class _Comparison:
    """The samples ``method="auto"`` compares its candidates on, and the float model's outputs on them
    (computed once, for every candidate): the ``held_out`` first calibration samples the candidates
    were not calibrated on, or as many first ones (fewer for large inputs, as bias correction counts
    them) when the data set was too small to hold any out."""

    def __init__(
        self, float_proto: onnx.ModelProto, model: ir.Model, data: Any, held_out: int, known: list[Any] | None = None
    ) -> None:
        """``known``: the float model's first output on the first samples, where a probe kept it."""
        self.samples = (
            list(itertools.islice(iter_samples(model, data), held_out))
            if held_out
            else first_samples(model, data, CHOICE_SAMPLES)
        )
        outputs = list((known or [])[: len(self.samples)])
        self.model, self.reference = model, _Reference(float_proto, outputs)

    def scores(self, protos: Mapping[str, onnx.ModelProto]) -> dict[str, float]:
        """Each candidate's output SQNR against float on the samples."""
        return {
            m: _agreement(self.model, self.reference, session(p), self.samples)["sqnr_db"] for m, p in protos.items()
        }


def _check_budget(max_drop: Any, metric: Any, eval_data: Any, keep_float_below: Any) -> None:
    if max_drop is None:
        if metric is not None:
            raise ArgumentError("metric is the accuracy budget's: give max_drop too")
        return
    if isinstance(max_drop, bool) or not isinstance(max_drop, int | float) or not 0 <= max_drop <= 1:
        raise ArgumentError(f"max_drop must be a number in [0, 1] (e.g. 0.01 for one point), got {max_drop!r}")
    if eval_data is None:
        raise ArgumentError("max_drop needs eval_data: the drop is measured on the evaluation data")
    if keep_float_below is not None:
        raise ArgumentError("give max_drop or keep_float_below, not both: both choose which kernels stay float")
    if metric is not None and metric not in METRICS:
        raise ArgumentError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if metric == "accuracy" and not _has_labels(eval_data):
        raise ArgumentError("metric 'accuracy' needs labels in the evaluation data (a 'labels' array)")


def _split_labels(data: Any, inputs: set[str]) -> tuple[Any, npt.NDArray[Any] | None]:
    """Evaluation data without its ``labels``, and the labels (None when it has none): an ``.npz``'s
    array of that name, or a dict's entry when the model has no input of that name."""
    if isinstance(data, (str, os.PathLike)) and Path(data).suffix == ".npz" and Path(data).is_file():
        return data, read_labels(Path(data))  # the samples are read without it, one at a time
    if isinstance(data, Mapping) and "labels" in data and "labels" not in inputs:
        return {k: v for k, v in data.items() if k != "labels"}, np.asarray(data["labels"]).reshape(-1)
    return data, None


def _has_labels(data: Any) -> bool:
    return _split_labels(data, set())[1] is not None


def _within_budget(
    run: _Run,
    max_drop: float,
    metric: str | None,
    eval_data: Any,
    calibration_data: Any,
    again: Callable[[_Run, list[str]], _Run],
    reference: _Reference,
    costs: CostModel | None = None,
) -> tuple[_Run, dict[str, Any], list[_Run]]:
    """The run whose kernels kept float (the most effective ones, or the first ones in graph order:
    :mod:`requant.report.budget`) bring the drop within ``max_drop`` at the least modelled latency
    (``costs``; without one, the fewest kernels), the budget's record (every try) and every try's run,
    in the order of the record's tries."""
    assert run.float_proto is not None  # kept: there is evaluation data

    def evaluate(candidate: _Run) -> dict[str, float]:
        return _agreement(candidate.converted.model, reference, session(candidate.converted.proto), eval_data)

    first = evaluate(run)
    chosen = choose_metric(metric, "float_accuracy" in first)
    steps = [BudgetStep(0, drop(first, chosen))]
    # each kernel's local SQNR where bias correction measured it (convolutions, Gemms); the others
    # (a transformer's linear layers, LSTMs) are candidates too
    local = {k.node: k.sqnr_db for k in run.converted.kernels}
    measured: dict[str, float | None] = {name: local.get(name) for name in int8_kernels(run.converted.model)}
    measured.update((name, sqnr) for name, sqnr in local.items() if name not in measured)
    effects: dict[str, float] = {}
    samples: list[Any] = []  # the ranking's; the first gives the sizes of symbolic dimensions to the prices
    if steps[0].drop > max_drop and measured:
        samples = list(itertools.islice(iter_samples(run.converted.model, calibration_data), RANKING_SAMPLES))
        weights = {name: ir.serde.serialize_tensor(t) for name, t in run.converted.floats.items()}
        effects = dict(
            effect_ranking(run.converted.proto, run.float_proto, sorted(measured), samples, session, weights)
        )
    position = {node.name: i for i, node in enumerate(run.converted.model.graph)}

    def in_graph(name: str) -> tuple[int, str]:
        return position.get(name, len(position)), name

    def by_effect(name: str) -> tuple[float, float, tuple[int, str]]:  # unmeasured last, in graph order
        sqnr = measured[name]
        return -effects.get(name, -math.inf), math.inf if sqnr is None else sqnr, in_graph(name)

    orders = {"ranked": sorted(measured, key=by_effect), "first": sorted(measured, key=in_graph)}
    runs = [run]
    by_nodes: dict[frozenset[str], BudgetStep] = {}  # a set both families name is tried once

    def within(family: str, k: int) -> bool:
        nodes = orders[family][:k]
        known = by_nodes.get(frozenset(nodes))
        if known is None:
            log.info("accuracy budget: trying %d kernels float (%s)", k, family)
            runs.append(again(run, nodes))
            known = BudgetStep(k, drop(evaluate(runs[-1]), chosen), nodes, family, round(cost(family, k), 1))
            steps.append(known)
            by_nodes[frozenset(nodes)] = known
        return known.drop <= max_drop

    dims = _symbolic_sizes(run.converted.model, samples[0]) if samples else {}
    priced: dict[tuple[str, int], float] = {}

    def cost(family: str, k: int) -> float:  # modelled microseconds the kernels float add to a run
        if (family, k) not in priced:
            priced[family, k] = float_cost_us(run.converted.model, orders[family][:k], costs, dims) if costs else k
        return priced[family, k]

    found = None if steps[0].drop <= max_drop else fewest_of(list(orders), len(measured), within, cost)
    met = found is not None or steps[0].drop <= max_drop
    if found is not None:
        final = by_nodes[frozenset(orders[found[0]][: found[1]])]
    elif met:
        final = steps[0]
    else:  # not even with every measured kernel float: the try that lost least
        final = min(steps, key=lambda s: (s.drop, s.kept_float))
        log.warning("the accuracy budget %s is not met: the smallest %s is %.4f with %d kernels float",
                    max_drop, describe(chosen), final.drop, final.kept_float)  # fmt: skip
    record = {
        "metric": chosen,
        "measures": describe(chosen),
        "max_drop": max_drop,
        "met": met,
        "first_drop": steps[0].drop,
        "final_drop": final.drop,
        "family": final.family if final.kept_float else None,
        "families": FAMILIES,
        "priced_by": costs.name if costs else "the number of kernels kept float",
        "modelled_us": final.modelled_us,
        "ranked_by": f"the rise of the output's SQNR when the kernel alone is float ({RANKING_SAMPLES} calibration "
        "samples), largest first",
        "kept_float": [
            {"node": n, "effect_db": _measured(effects.get(n)), "sqnr_db": measured[n]} for n in final.nodes
        ],
        "tries": [s.__dict__ for s in steps],
        "candidates": len(measured),
    }
    return runs[next(i for i, s in enumerate(steps) if s is final)], record, runs


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


def _check_arguments(**given: Any) -> None:
    """The API's door: an argument of the wrong kind is an :class:`ArgumentError` saying what it accepts
    (not a TypeError or AttributeError from deep inside)."""
    from requant.calibration.observers import known_methods

    kinds: dict[str, tuple[Callable[[Any], bool], str]] = {
        "quantizer": (lambda v: v is None or isinstance(v, Quantizer), "a requant Quantizer, or None for the defaults"),
        "output": (lambda v: v is None or isinstance(v, str | os.PathLike), "a path (str or os.PathLike), or None"),
        "target": (lambda v: isinstance(v, str), "a target name (a str)"),
        "method": (
            lambda v: v is None or v == "auto" or v in known_methods(),
            f"None, 'auto' or one of {', '.join(known_methods())}",
        ),
        "progress": (lambda v: v is None or callable(v), "None or a callable progress(done, total)"),
        "measure": (lambda v: isinstance(v, bool), "True or False"),
        "strict": (lambda v: isinstance(v, bool), "True or False"),
        "bias_correction": (lambda v: isinstance(v, bool), "True or False"),
        "equalization": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in given.items():
        ok, accepted = kinds[name]
        if not ok(value):
            raise ArgumentError(f"{name} must be {accepted}; got {value!r} ({type(value).__name__})")


@one_blas_thread
def quantize(
    model: Any,
    calibration_data: Any,
    target: str = DEFAULT_TARGET,
    quantizer: Quantizer | None = None,
    method: str | None = None,
    output: str | os.PathLike[str] | None = None,
    eval_data: Any = None,
    progress: Progress | None = None,
    measure: bool = True,
    strict: bool = False,
    bias_correction: bool = True,
    keep_float_below: float | None = None,
    max_drop: float | None = None,
    metric: str | None = None,
    smoothing: float | None = DEFAULT_ALPHA,
    equalization: bool = True,
    rounding: str | None = None,
    accumulator_bits: int | None = None,
    **load_options: Any,
) -> QuantizedModel:
    """Quantize ``model`` (a path, bytes, ``ModelProto``, onnx-ir model or PyTorch module) for ``target``.

    ``method`` overrides the calibration method of activations (``"auto"``: each of ``AUTO_METHODS``,
    keeping the one whose output is closest to float on 32 calibration samples; ``minmax``, ``percentile``,
    ``entropy``, ``mse``...). By default (None) it is ``"auto"``, unless ``quantizer``'s configs name
    observers of their own (anything but plain ``minmax``), which are then kept. With ``eval_data``
    the report compares the outputs of the float and quantized models (top-1 agreement, accuracy when
    the data has ``labels``, cosine, SQNR).
    ``measure=False`` skips the latency measurement (batch 1, float and int8 runs interleaved for
    at most two seconds, :mod:`requant.report.latency`). ``strict``: a
    node a quantizer was asked to quantize but could not is an error naming it and the reason.
    ``bias_correction``: give each int8 convolution's and Gemm's bias back the mean shift its
    quantization caused, measured on the first 64 calibration samples (fewer for inputs larger than a
    224x224 image; on by default).
    ``keep_float_below`` (dB): each int8 convolution and Gemm is measured against its float version
    on those samples (its local SQNR, in the report; a pointwise convolution's on the first 16
    224x224 images' worth of them); when some are below this, the model is
    quantized again with those kernels kept float (a second pass: slower, more accurate).
    ``max_drop``: an accuracy budget on ``eval_data`` (``metric``: ``accuracy`` with labels, ``top1``
    agreement or ``cosine``; by default accuracy when the data has labels, else top-1): if the int8
    model loses more, kernels are kept float (those with the largest measured effect on the output, or
    the first ones in graph order), quantizing and evaluating again, until the drop is within it; of
    the sets that meet it, the one the target's cost model prices least (:mod:`requant.report.budget`;
    each try in the report). Not with ``keep_float_below``.
    ``smoothing``: the alpha (in (0, 1]) with which each linear layer's input channels are evened out
    against its weight's rows before quantizing (SmoothQuant, :mod:`requant.calibration.smoothing`);
    None or 0 leaves them as they are.
    ``equalization``: even out the channels of each depthwise convolution's input against the
    convolution before it (:mod:`requant.calibration.equalization`; convolutional models).
    ``rounding`` and ``accumulator_bits`` (``tosa-int8`` only): how the TOSA program's rescales round
    (``single_round``, the default, or ``double_round``), and an accumulator width to simulate in
    requant's interpreter: the report says, per kernel, how often one that narrow would overflow.
    """
    started = time.perf_counter()
    _check_arguments(quantizer=quantizer, output=output, target=target, method=method, progress=progress,
                     measure=measure, strict=strict, bias_correction=bias_correction,
                     equalization=equalization)  # fmt: skip
    if keep_float_below is not None and (
        isinstance(keep_float_below, bool)
        or not isinstance(keep_float_below, int | float)
        or not math.isfinite(keep_float_below)
    ):
        raise RequantError(f"keep_float_below must be a finite number of dB (e.g. 29), got {keep_float_below!r}")
    _check_budget(max_drop, metric, eval_data, keep_float_below)
    if smoothing is not None and (
        isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing <= 1
    ):
        raise ArgumentError(f"smoothing must be an alpha in [0, 1] (0 or None: off; default {DEFAULT_ALPHA}), "
                            f"got {smoothing!r}")  # fmt: skip
    check_exists(calibration_data, "calibration")  # before any work
    check_exists(eval_data, "evaluation")
    if output is not None:  # before any work: a refused run writes nothing
        check_outputs({"output": output}, {"the model": model, "the calibration data": calibration_data,
                                           "the evaluation data": eval_data})  # fmt: skip
    chosen_target = get_target(target)
    if output is not None and str(output).endswith(".mlir") and chosen_target.backend != "tosa":
        raise ArgumentError(f"'{output}': only the tosa-int8 target writes MLIR; {target} writes ONNX (.onnx)")
    if (rounding is not None or accumulator_bits is not None) and chosen_target.backend != "tosa":
        raise ArgumentError(f"rounding and accumulator_bits are the tosa-int8 target's options, not {target}'s")
    if rounding is not None and rounding not in ("single_round", "double_round"):
        raise ArgumentError(f"rounding must be 'single_round' or 'double_round', got {rounding!r}")
    if accumulator_bits is not None and (
        isinstance(accumulator_bits, bool) or not isinstance(accumulator_bits, int) or not 8 <= accumulator_bits <= 32
    ):
        raise ArgumentError(f"accumulator_bits must be a whole number of bits in [8, 32], got {accumulator_bits!r}")
    quantizer = (quantizer or Quantizer().set_global_by_model()).for_table(chosen_target.table)
    if method is None and not quantizer.names_observers():  # observers a config names are kept
        method = DEFAULT_METHOD
    if isinstance(calibration_data, Iterator):  # a generator: read once, its first samples kept for the rest
        calibration_data = Replayed(calibration_data, DEFAULT_SAMPLES)
    keep_float_proto = measure or eval_data is not None or method == "auto"
    measure_kernels = bias_correction or keep_float_below is not None or max_drop is not None
    cache = StatisticsCache()  # later passes (keep_float_below, max_drop) reuse the first one's statistics

    correcting = bias_correction  # what `again` does: auto's check may have found the correction harmful

    def quantize_with(how: Quantizer, by: str | None, first: _Run | None) -> _Run:
        known = (first.float_proto, first.float_size) if first is not None else None  # the float model, once
        return _run(model, how, chosen_target, strict, calibration_data, by, progress, measure_kernels,
                    correcting, keep_float_proto, load_options, cache, known, smoothing, equalization)  # fmt: skip

    def again(first: _Run, floats: list[str]) -> _Run:
        return quantize_with(quantizer.with_float_nodes(floats), method, first)

    method_choice: dict[str, Any] | None = None
    if method == "auto":
        run, method, method_choice = _run_auto(model, quantizer, chosen_target, strict, calibration_data,
                                               progress, measure_kernels, bias_correction, load_options, cache,
                                               smoothing, equalization)  # fmt: skip
        log.info("method auto: %s (output SQNR %s)", method, method_choice["output_sqnr_db"])  # `again` uses it
        correcting = bias_correction and method_choice.get("bias_correction_kept") is not False
    else:
        run = quantize_with(quantizer, method, None)
    low = [k for k in run.converted.kernels if keep_float_below is not None and k.sqnr_db < keep_float_below]
    if low:
        log.info("keeping %d kernels float (local SQNR below %s dB); quantizing again", len(low), keep_float_below)
        run = again(run, [k.node for k in low])
    budget: dict[str, Any] | None = None
    tried: list[_Run] = []  # the budget's tries, in its record's order
    reference: _Reference | None = None
    if max_drop is not None:
        if isinstance(eval_data, Iterator):  # a generator: every try reads it again, so all of it is kept
            eval_data = Replayed(eval_data, sys.maxsize)
        reference = _Reference(run.float_proto)
        run, budget, tried = _within_budget(run, max_drop, metric, eval_data, calibration_data, again, reference,
                                            chosen_target.costs)  # fmt: skip
    converted = run.converted
    quantized, quantized_proto, lint_result = converted.model, converted.proto, converted.lint_result
    report: dict[str, Any] = {
        "target": target,
        "target_description": chosen_target.description,
        "quantizers": run.quantizer_report.to_json(),
        "smoothing": {
            "alpha": smoothing or None,
            "not_applied": run.evened.smoothing.not_applied,
            "inputs": [r.__dict__ for r in run.evened.smoothing.inputs],
        },
        "equalization": {
            "enabled": equalization,
            "max_scale": MAX_SCALE,
            "not_applied": run.evened.equalization.not_applied,
            "chains": [r.__dict__ for r in run.evened.equalization.chains],
        },
        "calibrated": [c.as_dict() for c in run.chosen],
        "propagated": [n.as_dict() for n in converted.notes],
        # where an op the target binds to one type got two (targets.constraints): a rescale, or a float op
        "rescales": [n.as_dict() for n in converted.notes if n.meets],
        "weight_encoding": {
            "kernel_model": chosen_target.kernels.name,
            "exact_on": chosen_target.kernels.cpus,
            "kernels": [e.__dict__ for e in converted.encodings],
        },
        "bias_correction": {
            "enabled": bias_correction,
            "kernels": [c.__dict__ for c in converted.kernels],
        },
        "kept_float_below": {
            "threshold_db": keep_float_below,
            "kernels": [{"node": k.node, "sqnr_db": k.sqnr_db} for k in low],
        },
        "lint": lint_result.to_json(),
        "size_bytes": {"float": run.float_size, "quantized": quantized_proto.ByteSize()},
        "quantize_seconds": time.perf_counter() - started,
    }
    if load_options.get("fixed_inputs"):
        report["fixed_inputs"] = {name: np.asarray(v).tolist() for name, v in load_options["fixed_inputs"].items()}
    if run.float_proto is not None and (measure or eval_data is not None):  # (auto keeps it for its comparison)
        reference = reference or _Reference(run.float_proto)  # the budget's, with its outputs
        f_session, q_session = reference.float_session(), session(quantized_proto)  # once: latency and evaluation
        if measure:
            sample = next(iter(iter_samples(quantized, calibration_data)))
            timed = [f_session, q_session]
            # what each try of the budget costs: every model it made, the first int8 one included, beside
            others = [i for i, candidate in enumerate(tried) if candidate is not run]
            timed += [session(tried[i].converted.proto) for i in others]
            times = interleaved_latency_ms(timed, sample)
            report["latency_ms_batch1"] = {"float": times[0], "quantized": times[1], "measured": "interleaved"}
            if budget is not None:
                measured = dict(zip(others, times[2:], strict=True))
                for i, step in enumerate(budget["tries"]):
                    step["latency_ms"] = measured.get(i, times[1])
                budget["latency_ms_before"] = budget["tries"][0]["latency_ms"]
        if eval_data is not None:
            report["evaluation"] = _agreement(quantized, reference, q_session, eval_data)
            # tensor by tensor on the first evaluation samples, for the report's page (requant compare's records)
            inputs, _ = _split_labels(eval_data, {str(v.name) for v in quantized.graph.inputs})
            try:
                tensors = compare(run.float_proto, quantized_proto, inputs, samples=TENSOR_SAMPLES)
                report["tensors"] = [t.to_json() for t in tensors]
            except CompareError as error:  # nothing quantized between QDQ pairs (a DynamicQuantizeLSTM alone)
                log.info("no tensor-by-tensor comparison: %s", error)
    if budget is not None:
        report["accuracy_budget"] = budget
    if method_choice is not None:
        report["method_choice"] = method_choice
    # what the machine quantizing computes (the model does not depend on it; the advice does)
    report["this_cpu"] = host_kernel_model().name
    program = None
    if chosen_target.backend == "tosa":
        if output is not None and not str(output).endswith(".mlir"):
            log.info("target %s: writing the QDQ twin to %s (a path ending in .mlir gets the TOSA program)",
                     target, output)  # fmt: skip
        try:
            # dimensions the model leaves dynamic after the batch: the first calibration sample's
            first = next(iter(iter_samples(quantized, calibration_data)))
            program = lower_to_tosa(quantized, rounding or "single_round", {k: np.shape(v) for k, v in first.items()})
        except TosaError as error:  # say why the node stayed float, from the quantizers' decisions
            why = [d.reason for r in run.quantizer_report.records for d in r.decisions
                   if error.node in d.nodes and d.status == "rejected" and d.reason]  # fmt: skip
            if why:
                raise TosaError(f"{error}: {why[0]}", error.node) from None
            raise
        report["tosa"] = _tosa_record(program, quantized_proto, quantized, calibration_data, accumulator_bits)
        if eval_data is not None and reference is not None:
            report["tosa"]["against_float"] = _tosa_against_float(program, quantized, reference, eval_data)
    result = QuantizedModel(quantized, report, program)
    result.report["summary"] = summary(result.report, lint_result)
    if output is not None:
        result.save(output)
    return result


TOSA_CHECK_SAMPLES = 8  # calibration samples the TOSA program is run on against its QDQ twin
# fewer for large inputs, down to 2: requant's interpreter takes ~4 s a 736x992 photo (PP-OCRv4's
# detector: 8 of them were 38 of its 53 s), and 2 such photos are 1.5 million output values compared
TOSA_CHECK_VALUES = 8 * 3 * 224 * 224


def _tosa_record(
    program: TosaProgram, proto: onnx.ModelProto, model: ir.Model, data: Any, accumulator_bits: int | None
) -> dict[str, Any]:
    """What lowering wrote (ops by kind, every rescale and why), and the program's outputs (requant's
    TOSA interpreter) against the QDQ twin's in ONNX Runtime on the first calibration samples, in
    output steps: the two round differently (fixed-point rescales against float ones). The twin's
    full-range int8 weights run as ``exact_twin`` stores them (ONNX Runtime's uint8 x int8 kernels
    saturate them on CPUs without VNNI: 11 steps on the digits CNN, where TOSA's int32 sums do
    not; the same figure on every CPU). With
    ``accumulator_bits``: per kernel, the share of its results a narrower accumulator cannot hold,
    and what saturating them does to the outputs."""
    kinds: dict[str, int] = {}
    for op in program.ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    rescales = [  # one scale, or the range of a per-channel rescale's
        {"op": op.output, "why": op.attrs["why"], "channels": len(op.attrs["scale"]),
         "scale": [min(op.attrs["scale"]), max(op.attrs["scale"])]}
        for op in program.ops if op.kind == "rescale"
    ]  # fmt: skip
    q_session = session(exact_twin(proto))
    overflows: dict[str, list[int]] = {}
    largest, samples, narrowed = 0.0, 0, 0.0
    apart = compared = 0  # output values more than 2 steps apart, of all compared
    same: list[float] = []  # per integer output and sample: the share of indices equal to ONNX Runtime's
    size = sum(math.prod(e.shape) for e in program.inputs)
    count = max(2, min(TOSA_CHECK_SAMPLES, math.ceil(TOSA_CHECK_VALUES / max(size, 1))))
    for sample in itertools.islice(iter_samples(model, data), count):
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
    accumulator = None
    if accumulator_bits is not None:
        accumulator = {
            "bits": accumulator_bits,
            "largest_output_change_steps": narrowed,
            "kernels": [{"node": n, "overflowed": c[0], "results": c[1], "share": c[0] / max(c[1], 1)}
                        for n, c in overflows.items()],
        }  # fmt: skip
    return {
        "rounding": program.rounding,
        "ops": dict(sorted(kinds.items())),
        "rescales": rescales,
        "accumulator": accumulator,
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


class _TosaRun:
    """A TOSA program behind ONNX Runtime's ``run(None, feeds)``: inputs quantized as the host does,
    the program run in requant's interpreter, its outputs dequantized."""

    def __init__(self, program: TosaProgram) -> None:
        self.program = program

    def run(self, _: Any, feeds: Mapping[str, Any]) -> list[npt.NDArray[Any]]:
        ints = {e.name: e.quantize(feeds[e.name]) for e in self.program.inputs}
        return [e.dequantize(o) for e, o in zip(self.program.outputs, run_tosa(self.program, ints), strict=True)]


def _tosa_against_float(
    program: TosaProgram, quantized: ir.Model, reference: _Reference, eval_data: Any
) -> dict[str, Any]:
    """The integer program against the float model on the first ``TOSA_EVAL_SAMPLES`` evaluation
    samples of the program's shapes (requant's interpreter: seconds a sample on large inputs), as
    ``evaluation`` measures the QDQ model: top-1 agreement, cosine, SQNR; or why not."""
    data, _ = _split_labels(eval_data, {str(v.name) for v in quantized.graph.inputs})
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
    known = reference if not skipped else _Reference(reference.proto)
    measured = _agreement(quantized, known, _TosaRun(program), samples)
    return {**measured, "interpreter": "requant's (the same integers as IREE's)"}


def _budget_line(budget: Mapping[str, Any], latency: Mapping[str, float] | None) -> str:
    kept = budget["kept_float"]
    line = f"accuracy budget: {budget['measures']} at most {budget['max_drop']:g}; {budget['first_drop']:.4f} at first"
    if kept:
        names = ", ".join(f"{k['node']} ({k['effect_db']:+.1f} dB)" if k["effect_db"] is not None else k["node"]
                          for k in kept[:3]) + (", ..." if len(kept) > 3 else "")  # fmt: skip
        which = "the first" if budget.get("family") == "first" else "the most effective"
        line += f", {budget['final_drop']:.4f} with {which} {len(kept)} of {budget['candidates']} kernels kept float"
        line += f": {names}"
        if budget.get("modelled_us") and not str(budget.get("priced_by", "")).startswith("the number"):
            line += f" (modelled +{budget['modelled_us']:.0f} us a run, the least of the tries that met it)"
    line += f"; {len(budget['tries']) - 1} re-quantizations"
    if not budget["met"]:
        line += " (NOT MET: the try that lost least is kept)"
    if latency and "latency_ms_before" in budget:
        line += f"; latency {budget['latency_ms_before'] / latency['float']:.2f}x -> "
        line += f"{latency['quantized'] / latency['float']:.2f}x of float"
        if round(latency["quantized"] / latency["float"], 2) >= 1.0:
            line += " (no faster than the float model, which meets any budget)"
    return line


def summary(report: Mapping[str, Any], lint_result: LintResult) -> str:
    """The text printed at the end of ``requant quantize``."""
    size = report["size_bytes"]
    lines = [f"target: {report['target']}"]
    if report.get("fixed_inputs"):
        given = ", ".join(f"{k} = {v}" for k, v in report["fixed_inputs"].items())
        lines.append(f"fixed inputs: {given} (constants now: the quantized model does not take them)")
    if report["quantizers"].get("preset_choice"):
        lines.append(f"preset: {report['quantizers']['preset_choice']}")
    if report.get("method_choice"):
        lines.append(f"method: {method_summary(report['method_choice'])}")
    if report["quantizers"].get("compute"):
        lines.append(f"compute: {report['quantizers']['compute']}")
    smoothed = [r for r in report.get("smoothing", {}).get("inputs", []) if r["applied"]]
    if smoothed:
        folded = sum(1 for r in smoothed if r["applied"].startswith("folded"))
        widest = max(smoothed, key=lambda r: r["spread_before"])
        lines.append(
            f"smoothing (alpha {report['smoothing']['alpha']:g}): {len(smoothed)} linear-layer inputs "
            f"({folded} folded into their normalization, {len(smoothed) - folded} by a float Mul); widest "
            f"'{widest['input']}': largest channel {widest['spread_before']:.1f}x the median -> "
            f"{widest['spread_after']:.1f}x"
        )
    evened = [r for r in report.get("equalization", {}).get("chains", []) if not r["skipped"]]
    if evened:
        widest = max(evened, key=lambda r: r["spread_before"])
        lines.append(
            f"equalization: {len(evened)} depthwise convs' inputs, {sum(r['scaled'] for r in evened)} channels scaled "
            f"up (at most {max(r['largest_factor'] for r in evened):.1f}x); widest '{widest['input']}': largest "
            f"channel {widest['spread_before']:.1f}x the median -> {widest['spread_after']:.1f}x"
        )
    placed = report["quantizers"].get("placements", [])
    if placed:
        groups = [p for p in placed if p.get("by", "cost") == "cost"]
        floats = [p for p in groups if p["placed"] == "float"]
        line = f"placement: {len(groups)} groups of int8 ops between kernels, {len(floats)} kept float"
        if floats:
            saved = sum(p["int8_us"] - p["float_us"] for p in floats)
            named = ", ".join("/".join(p["ops"]) for p in floats[:4]) + (", ..." if len(floats) > 4 else "")
            line += f" ({named}: modelled {saved:.1f} us faster)"
        by_table = [p for p in placed if p.get("by") == "table" and "anyway" not in p["why"]]
        if by_table:
            price = sum(p["float_us"] - p["int8_us"] for p in by_table)
            line += (
                f"; {len(by_table)} ops kept float by the target's table for accuracy cost {price:.1f} us (modelled)"
            )
        lines.append(line)
    lines += [f"warning: {w}" for w in report["quantizers"].get("warnings", [])]
    met = report.get("rescales", [])
    if met:
        rescaled = sum(r["how"] == "rescale" for r in met)
        lines.append(
            f"where constraints meet: {len(met)} (ops the target binds to one type that got two: "
            f"{rescaled} rescaled before the op, {len(met) - rescaled} computed in float by the runtime)"
        )
    tosa = report.get("tosa")
    if tosa:
        kernels = {k: v for k, v in tosa["ops"].items() if k in TOSA_ACCUMULATORS}
        check = tosa["against_qdq"]
        lines.append(
            f"TOSA: {sum(tosa['ops'].values())} ops ({', '.join(f'{k} x{v}' for k, v in kernels.items())}) for "
            + ", ".join(f"{e['name']} {'x'.join(str(d) for d in e['shape'])}" for e in tosa["inputs"])
            + ", "
            f"{len(tosa['rescales'])} rescales ({tosa['rounding']}); against the QDQ model in ONNX Runtime: at most "
            f"{check['largest_difference_steps']:.3g} output steps apart ({check['share_over_2_steps']:.2%} of the "
            f"values more than 2) on {check['samples']} samples"
            + (f", {check['same_indices']:.1%} of the indices the same" if "same_indices" in check else "")
        )
        against = tosa.get("against_float")
        if against and against.get("top1_agreement") is not None:
            lines.append(
                f"TOSA against float on {against['samples']:.0f} evaluation samples: top-1 agreement "
                f"{against['top1_agreement']:.4f}, cosine {against['cosine_similarity']:.5f}, "
                f"SQNR {against['sqnr_db']:.1f} dB"
            )
        elif against:
            lines.append(f"TOSA against float: not measured ({against['why']})")
        if tosa["accumulator"] is not None:
            acc = tosa["accumulator"]
            over = [k for k in acc["kernels"] if k["overflowed"]]
            lines.append(
                f"TOSA with {acc['bits']}-bit accumulators: {len(over)} of {len(acc['kernels'])} kernels overflow "
                f"on these samples; outputs move by up to {acc['largest_output_change_steps']:.0f} steps"
            )
    if report.get("weight_encoding", {}).get("kernels"):
        lines.append(f"int8 weights: {encoding_summary(report['weight_encoding'])}")
        encodings = report["weight_encoding"]["kernels"]
        if report.get("this_cpu") == ONNXRUNTIME_X86_VNNI.name and any(e["rescaled"] for e in encodings):
            lines.append(
                "this CPU has VNNI: for CPUs like it, --target onnxruntime-cpu-vnni keeps full-range int8 weights "
                "(exact there, and more accurate; on CPUs without VNNI they can saturate)"
            )
    checked = lint_result.text()
    if report.get("tosa"):  # lint reads the QDQ twin, not the TOSA program (int32 accumulators: nothing saturates)
        checked = "the QDQ twin (-o model.onnx), as ONNX Runtime would run it:\n" + "\n".join(
            f"  {line}" for line in checked.splitlines()
        )
    lines += [
        checked,
        f"size: {size['float'] / 1024:.1f} KiB -> {size['quantized'] / 1024:.1f} KiB "
        f"({size['quantized'] / size['float']:.2f}x)",
    ]
    latency = report.get("latency_ms_batch1")
    if latency:
        lines.append(
            f"latency, batch 1: {latency['float']:.3f} ms -> {latency['quantized']:.3f} ms "
            f"({latency['quantized'] / latency['float']:.2f}x)"
        )
    ev = report.get("evaluation")
    if ev:
        if "float_accuracy" in ev:
            lines.append(
                f"accuracy: float {ev['float_accuracy']:.4f}, int8 {ev['int8_accuracy']:.4f} "
                f"({int(ev['samples'])} samples)"
            )
        lines.append(
            f"agreement with float: top-1 {ev['top1_agreement']:.4f}, cosine {ev['cosine_similarity']:.5f}, "
            f"SQNR {ev['sqnr_db']:.1f} dB"
        )
    if report.get("accuracy_budget"):
        lines.append(_budget_line(report["accuracy_budget"], latency))
    kernels = report.get("bias_correction", {}).get("kernels")
    if kernels and report["bias_correction"].get("enabled"):
        largest = max(kernels, key=lambda k: k["max_shift"])
        lines.append(
            f"bias correction: {len(kernels)} kernels, largest shift {largest['max_shift']:.3g} ({largest['node']})"
        )
    if kernels:
        worst = min(kernels, key=lambda k: k["sqnr_db"])
        lines.append(f"kernel SQNR against float: lowest {worst['sqnr_db']:.1f} dB ({worst['node']})")
    kept = report.get("kept_float_below", {})
    if kept.get("kernels"):
        names = ", ".join(f"{k['node']} {k['sqnr_db']:.1f} dB" for k in kept["kernels"])
        lines.append(f"kept float (SQNR below {kept['threshold_db']:g} dB): {len(kept['kernels'])} kernels: {names}")
    lines.append(f"quantized in {report['quantize_seconds']:.1f} s")
    return "\n".join(lines)
