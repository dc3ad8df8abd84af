"""requant's main job: ``quantize(model, calibration_data)``, and its steps for those who want to look between them.

``prepare`` (load, canonicalize, annotate) -> ``calibrate`` (observers over the data) ->
``convert`` (propagate, write QDQ, correct biases, lint). ``quantize`` runs them all and measures
the result.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.backends import finish_qdq, materialize_qdq
from requant.calibration.bias_correction import DEFAULT_SAMPLES, BiasCorrection, correct_biases, float_parameters
from requant.calibration.calibrate import StatisticsCache, calibrate  # the step itself: observers over the data
from requant.calibration.data import Replayed, check_exists, iter_samples, read_labels
from requant.calibration.observers import CalibrationError
from requant.calibration.propagate import propagate
from requant.calibration.runner import Progress, terminal_progress
from requant.calibration.weight_encoding import WeightEncoding
from requant.errors import ArgumentError, RequantError
from requant.frontends import LoadError, check_outputs, load, save_onnx, serialized_size
from requant.ir.annotations import iter_values
from requant.passes import get_passes, run_passes
from requant.passes.compute_in_float32 import HALF
from requant.quantizers import Quantizer, QuantizerReport
from requant.report.latency import interleaved_latency_ms, session
from requant.report.lint import LintResult, lint
from requant.report.markdown import encoding_summary
from requant.targets.registry import DEFAULT_TARGET, Target, get_target

__all__ = ["QuantizedModel", "calibrate", "convert", "prepare", "quantize"]

log = logging.getLogger("requant")


@dataclass
class QuantizedModel:
    """The quantized model and its report (a JSON-able dict); ``save(path)`` writes the model."""

    model: ir.Model
    report: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str]) -> None:
        save_onnx(self.model, path)


def prepare(
    source: Any,
    quantizer: Quantizer | None = None,
    target: str = DEFAULT_TARGET,
    strict: bool = False,
    **load_options: Any,
) -> tuple[ir.Model, QuantizerReport]:
    """Load, canonicalize and annotate (with ``quantizer``, or the preset ``choose_preset`` picks for
    the model among the target's).

    ``strict``: a node a quantizer was asked to quantize but could not is an error naming it. An
    ``ir.Model`` given as ``source`` is copied first: the caller's model is never changed.
    """
    chosen = get_target(target)
    if isinstance(source, ir.Model):
        source = source.clone()
    model = load(source, **load_options)
    model, _ = run_passes(model, get_passes("canonicalize"))
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
    quantizer = quantizer or Quantizer(chosen.table).set_global_by_model()
    report = quantizer.quantize(model, strict=strict, presets=chosen.presets)
    if half:
        kind = " and ".join(t.lower() for t in half)
        report.compute = (
            f"float32 (the model computed in {kind}; ONNX Runtime's CPU int8 kernels take float32 scales and "
            f"activations: its inputs and outputs keep their {kind} types, through Casts)"
        )
    return model, report


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


def _convert(
    model: ir.Model,
    target: Target,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
) -> _Converted:
    """``convert``, with what the report needs besides."""
    propagation = propagate(model, target.kernels)
    floats = float_parameters(model) if bias_data is not None else {}
    model = materialize_qdq(model)
    kernels = correct_biases(model, floats, bias_data, bias_samples, progress, correct) if bias_data is not None else []
    finish_qdq(model)
    proto = ir.serde.serialize_model(model)
    return _Converted(model, proto, propagation.notes, propagation.encodings, lint(proto), kernels)


@dataclass
class _Run:
    """One pass of prepare -> calibrate -> convert."""

    quantizer_report: QuantizerReport
    float_proto: onnx.ModelProto | None
    float_size: int
    chosen: list[Any]
    converted: _Converted


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
) -> _Run:
    """``float_info``: the float model (or None) and its size from an earlier run of the same model."""
    prepared, quantizer_report = prepare(model, quantizer, target.name, strict, **load_options)
    if float_info is None:
        # the float model serialized only where a float session needs it (held through calibration,
        # it was MiniLM's largest allocation); otherwise just its size
        proto = ir.serde.serialize_model(prepared) if keep_float_proto else None
        float_info = (proto, proto.ByteSize() if proto is not None else serialized_size(prepared))
    float_proto, float_size = float_info
    chosen = calibrate(prepared, data, method, progress or terminal_progress(), cache)
    kernel_data = data if measure_kernels else None
    kernel_progress = progress or terminal_progress("measuring kernels")
    converted = _convert(prepared, target, kernel_data, progress=kernel_progress, correct=correct)
    return _Run(quantizer_report, float_proto, float_size, chosen, converted)


def _agreement(model: ir.Model, f_session: Any, q_session: Any, data: Any) -> dict[str, float]:
    """Top-1 agreement (and accuracy, with labels), cosine similarity and SQNR of the first output."""
    labels = None
    if isinstance(data, (str, os.PathLike)) and Path(data).suffix == ".npz" and Path(data).is_file():
        labels = read_labels(Path(data))  # the samples are read without it, one at a time
    elif isinstance(data, Mapping) and "labels" in data and "labels" not in {v.name for v in model.graph.inputs}:
        labels = np.asarray(data["labels"]).reshape(-1)  # a dict of arrays takes them as an .npz does
        data = {k: v for k, v in data.items() if k != "labels"}
    outs_f, outs_q = [], []
    for sample in iter_samples(model, data, "evaluation"):
        outs_f.append(np.asarray(f_session.run(None, sample)[0], dtype=np.float64))
        outs_q.append(np.asarray(q_session.run(None, sample)[0], dtype=np.float64))
    f, q = np.concatenate(outs_f), np.concatenate(outs_q)
    for what, outputs in (("float", outs_f), ("quantized", outs_q)):
        bad = next((i for i, o in enumerate(outputs, start=1) if not np.isfinite(o).all()), None)
        if bad is not None:  # agreement figures would be NaN: say where instead
            raise CalibrationError(f"evaluation sample {bad}: the {what} model's first output is not finite")
    f2, q2 = f.reshape(len(f), -1), q.reshape(len(q), -1)
    if labels is not None and len(labels) != len(f2):
        raise CalibrationError(
            f"the evaluation data has {len(f2)} samples (first output rows) but {len(labels)} labels: "
            "'labels' needs one class index per sample"
        )
    cosine = float(np.mean(np.sum(f2 * q2, 1) / (np.linalg.norm(f2, axis=1) * np.linalg.norm(q2, axis=1) + 1e-12)))
    noise = float(np.sum((f - q) ** 2))
    metrics = {
        "samples": float(len(f)),
        "top1_agreement": float(np.mean(f2.argmax(1) == q2.argmax(1))),
        "cosine_similarity": cosine,
        "sqnr_db": float(10 * np.log10(np.sum(f**2) / noise)) if noise > 0 else float("inf"),
    }
    if labels is not None:
        metrics["float_accuracy"] = float(np.mean(f2.argmax(1) == labels))
        metrics["int8_accuracy"] = float(np.mean(q2.argmax(1) == labels))
    return metrics


def _check_arguments(**given: Any) -> None:
    """The API's door: an argument of the wrong kind is an :class:`ArgumentError` saying what it accepts
    (not a TypeError or AttributeError from deep inside)."""
    from requant.calibration.observers import known_methods

    kinds: dict[str, tuple[Callable[[Any], bool], str]] = {
        "quantizer": (lambda v: v is None or isinstance(v, Quantizer), "a requant Quantizer, or None for the defaults"),
        "output": (lambda v: v is None or isinstance(v, str | os.PathLike), "a path (str or os.PathLike), or None"),
        "target": (lambda v: isinstance(v, str), "a target name (a str)"),
        "method": (lambda v: v is None or v in known_methods(), f"None or one of {', '.join(known_methods())}"),
        "progress": (lambda v: v is None or callable(v), "None or a callable progress(done, total)"),
        "measure": (lambda v: isinstance(v, bool), "True or False"),
        "strict": (lambda v: isinstance(v, bool), "True or False"),
        "bias_correction": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in given.items():
        ok, accepted = kinds[name]
        if not ok(value):
            raise ArgumentError(f"{name} must be {accepted}; got {value!r} ({type(value).__name__})")


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
    **load_options: Any,
) -> QuantizedModel:
    """Quantize ``model`` (a path, bytes, ``ModelProto``, onnx-ir model or PyTorch module) for ``target``.

    ``method`` overrides the calibration method of activations (``minmax``, ``percentile``,
    ``entropy``, ``mse``...). With ``eval_data`` the report compares the outputs of the float and
    quantized models (top-1 agreement, accuracy when the data has ``labels``, cosine, SQNR).
    ``measure=False`` skips the latency measurement (batch 1, float and int8 runs interleaved for
    at most two seconds, :mod:`requant.report.latency`). ``strict``: a
    node a quantizer was asked to quantize but could not is an error naming it and the reason.
    ``bias_correction``: give each int8 convolution's and Gemm's bias back the mean shift its
    quantization caused, measured on the first 64 calibration samples (fewer for inputs larger than a
    224x224 image; on by default).
    ``keep_float_below`` (dB): each int8 convolution and Gemm is measured against its float version
    on those samples (its local SQNR, in the report); when some are below this, the model is
    quantized again with those kernels kept float (a second pass: slower, more accurate).
    """
    started = time.perf_counter()
    _check_arguments(quantizer=quantizer, output=output, target=target, method=method, progress=progress,
                     measure=measure, strict=strict, bias_correction=bias_correction)  # fmt: skip
    if keep_float_below is not None and (
        isinstance(keep_float_below, bool)
        or not isinstance(keep_float_below, int | float)
        or not math.isfinite(keep_float_below)
    ):
        raise RequantError(f"keep_float_below must be a finite number of dB (e.g. 29), got {keep_float_below!r}")
    check_exists(calibration_data, "calibration")  # before any work
    check_exists(eval_data, "evaluation")
    if output is not None:  # before any work: a refused run writes nothing
        check_outputs({"output": output}, {"the model": model, "the calibration data": calibration_data,
                                           "the evaluation data": eval_data})  # fmt: skip
    chosen_target = get_target(target)
    quantizer = quantizer or Quantizer(chosen_target.table).set_global_by_model()
    if isinstance(calibration_data, Iterator):  # a generator: read once, its first samples kept for the rest
        calibration_data = Replayed(calibration_data, DEFAULT_SAMPLES)
    keep_float_proto = measure or eval_data is not None
    measure_kernels = bias_correction or keep_float_below is not None
    cache = StatisticsCache()  # the second pass (keep_float_below) reuses the first one's statistics
    run = _run(model, quantizer, chosen_target, strict, calibration_data, method, progress, measure_kernels,
               bias_correction, keep_float_proto, load_options, cache)  # fmt: skip
    low = [k for k in run.converted.kernels if keep_float_below is not None and k.sqnr_db < keep_float_below]
    if low:
        log.info("keeping %d kernels float (local SQNR below %s dB); quantizing again", len(low), keep_float_below)
        run = _run(model, quantizer.with_float_nodes(k.node for k in low), chosen_target, strict, calibration_data,
                   method, progress, measure_kernels, bias_correction, keep_float_proto, load_options, cache,
                   (run.float_proto, run.float_size))  # fmt: skip
    converted = run.converted
    quantized, quantized_proto, lint_result = converted.model, converted.proto, converted.lint_result
    report: dict[str, Any] = {
        "target": target,
        "target_description": chosen_target.description,
        "quantizers": run.quantizer_report.to_json(),
        "calibrated": [c.__dict__ for c in run.chosen],
        "propagated": [n.__dict__ for n in converted.notes],
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
    if run.float_proto is not None:
        f_session, q_session = session(run.float_proto), session(quantized_proto)  # once: latency and evaluation
        if measure:
            sample = next(iter(iter_samples(quantized, calibration_data)))
            float_ms, quantized_ms = interleaved_latency_ms([f_session, q_session], sample)
            report["latency_ms_batch1"] = {"float": float_ms, "quantized": quantized_ms, "measured": "interleaved"}
        if eval_data is not None:
            report["evaluation"] = _agreement(quantized, f_session, q_session, eval_data)
    result = QuantizedModel(quantized, report)
    result.report["summary"] = summary(result.report, lint_result)
    if output is not None:
        result.save(output)
    return result


def summary(report: Mapping[str, Any], lint_result: LintResult) -> str:
    """The text printed at the end of ``requant quantize``."""
    size = report["size_bytes"]
    lines = [f"target: {report['target']}"]
    if report["quantizers"].get("preset_choice"):
        lines.append(f"preset: {report['quantizers']['preset_choice']}")
    if report["quantizers"].get("compute"):
        lines.append(f"compute: {report['quantizers']['compute']}")
    if report.get("weight_encoding", {}).get("kernels"):
        lines.append(f"int8 weights: {encoding_summary(report['weight_encoding'])}")
    lines += [
        lint_result.text(),
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
