"""Stages of the ``executorch-xnnpack`` target: export, annotate (requant's PT2E quantizer), calibrate,
choose the method, convert. Lowering and the checks of the ``.pte`` are :mod:`requant.stages.pte`.

The model is a PyTorch module (with ``example_inputs``), a ``torch.export.ExportedProgram``, or the path
of one saved with ``torch.export.save`` (``.pt2``). It is exported once (``torch.export.export``, from
contiguous examples: a ``.pte`` reads its input in its example's memory order,
:mod:`requant.backends.executorch.runtime`); a model with only its inputs (:func:`signature`) lets
requant's :class:`~requant.calibration.samples.Samples` check every sample as for an ONNX model (names,
dtypes, shapes), so one data set serves both paths.

Calibration is one pass: each activation observer keeps the statistics of every candidate method
(``AUTO_METHODS``), so ``method="auto"`` converts the model once per candidate and keeps the one whose
output is closest to float on held-out samples (the first ``CHOICE_SAMPLES`` calibration samples, which
the statistics then do not include, when there are four times as many), each candidate run in its fused
form (:mod:`requant.pt2e.fused`: the same numbers in half the time). Closest: for class scores (a
``[N, classes]`` output), the least KL divergence of their softmax from float's; else the highest
SQNR. Measured on MobileNetV2 (128 crops calibrating, 64 others): ``mean_minmax`` had the best logits
SQNR (17.4 dB against minmax's 13.7) and the worst KL (0.227 against 0.124) and top-1 agreement
(0.73 against 0.80): the logits' SQNR chose the wrong one.

The converted program's biases are then corrected (:mod:`requant.pt2e.bias`: each kernel's weight
rounding error applied to its float input's channel means), and kept so only where the output gets closer
to float on the compared samples.

Reads: the model, the options (quantizer, method, example inputs, bias correction), the samples. Adds:
the exported float program and the converted PT2E module. Records: ``pt2e`` (what the quantizer decided
per node), ``method_choice`` and ``bias_correction``.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from requant.backends.executorch.lower import Lowered
from requant.backends.executorch.runtime import ModuleSession, contiguous
from requant.calibration.runner import terminal_progress
from requant.calibration.samples import Samples
from requant.errors import RequantError
from requant.frontends import LoadError
from requant.frontends.torch_loader import export_error, forward_inputs, quiet_torch
from requant.options import Options
from requant.pt2e.bias import correct_biases, static_kernels
from requant.pt2e.equalize import FACTORS, channel_maxima, depthwise_chains, depthwise_inputs, equalize
from requant.pt2e.fused import fused, simulated
from requant.pt2e.quantizer import RequantQuantizer, look_at_outputs, probe_ranges
from requant.pt2e.rounding import round_weights, watch_inputs
from requant.pt2e.smooth import SMOOTHING_SAMPLES, input_maxima, linear_groups, smooth
from requant.report.agreement import Reference
from requant.stages.transform import OFF, smoothing_section
from requant.transforms.equalization import MAX_SCALE, Equalized

__all__ = [
    "AUTO_METHODS",
    "Exported",
    "Probe",
    "Quantized",
    "calibrate",
    "export_program",
    "quantize_once",
    "signature",
]

# one pass gathers them all (one histogram serves the last three), so trying each costs a conversion and a
# run of the compared samples. mean_minmax is not among them: the worst KL on MobileNetV2 and
# EfficientNet-Lite0 (0.227 and 0.151, against 0.098-0.124 and 0.027-0.067 for these)
AUTO_METHODS = ("minmax", "percentile", "mse", "entropy")
CHOICE_SAMPLES = 32  # held out for the choice when there are at least 4 times as many
BIAS_SAMPLES = 16  # calibration samples whose float input means bias correction reads
PROBE_SAMPLES = 8  # the float model's ranges the quantizer's join rule reads (requant.pt2e.quantizer)


@dataclass(frozen=True)
class Probe:
    """The float model on the first calibration samples: its ranges by node (the join rule's), and the
    channel maxima of its depthwise convs' inputs (equalization's) and of its linear layers' (smoothing's)."""

    ranges: dict[str, tuple[float, float]]
    depthwise: dict[str, Any]
    linear: dict[str, Any]


@dataclass
class Exported:
    """The float program, its input names and the model of its inputs (:func:`signature`); the float
    model run eagerly, and its outputs on the first calibration samples (``reference``: every comparison
    on them reads the same ones)."""

    program: Any
    names: list[str]
    signature: ir.Model
    # what the float model showed on the first calibration samples: one probe serves every quantization of the
    # program (remedies, budget tries)
    probed: Probe | None = None
    _float_outputs: list[list[np.ndarray]] = field(default_factory=list, repr=False)  # float_outputs'

    @property
    def module(self) -> Any:
        """A new module of the program (``prepare_pt2e`` changes the one it is given)."""
        return self.program.module()

    @functools.cached_property
    def float_session(self) -> ModuleSession:
        return ModuleSession(self.module, self.names)

    @functools.cached_property
    def reference(self) -> Reference:
        """The float model's first output on the first calibration samples, computed once each (with every
        output: :meth:`float_outputs`)."""
        return Reference(None, session=self.float_session)

    def float_outputs(self, samples: list[Any]) -> list[list[np.ndarray]]:
        """Every output of the float model on ``samples``, the first ones of the data set: each sample run once
        for this, :attr:`reference` (its first outputs) and the outputs' check."""
        reference = self.reference
        known = self._float_outputs
        known += [self.float_session.run(None, s) for s in samples[len(known) :]]
        if len(known) > len(reference.outputs or []):
            reference.outputs = [o[0] for o in known]
        return known[: len(samples)]


@dataclass
class Quantized:
    """One quantization of the program: the quantizer (its decisions), the converted module, the records
    of what was done to it, and the lowered ``.pte``."""

    quantizer: RequantQuantizer
    converted: Any
    records: dict[str, Any]  # the report's sections: equalization, method_choice, bias_correction
    lowered: Lowered

    @property
    def choice(self) -> dict[str, Any]:
        return dict(self.records.get("method_choice") or {})


def quantize_once(exported: Exported, samples: Samples, options: Options, keep_float: Mapping[str, str] | None = None,
                  only: str | None = None) -> Quantized:  # fmt: skip
    """Annotate, calibrate, choose, convert, correct and lower; ``keep_float``: nodes left float (and why); ``only``:
    the method an earlier choice made (:func:`calibrate`)."""
    from requant.stages.pte import lower_converted

    methods = (only,) if only else AUTO_METHODS if options.method == "auto" else (str(options.method),)
    quantizer = RequantQuantizer(options.quantizer, options.chosen_target.presets, methods, keep_float=keep_float)
    converted, records = calibrate(exported, quantizer, samples, options, only)
    return Quantized(quantizer, converted, records, lower_converted(exported, converted))


def _program(model: Any, options: Options) -> Any:
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        if not path.endswith(".pt2"):
            raise LoadError(f"'{path}': the {options.target} target quantizes PyTorch programs (a module, an "
                            "ExportedProgram, or a .pt2 file saved by torch.export.save), not ONNX models")  # fmt: skip
        try:
            return torch.export.load(path)
        except Exception as exc:
            raise LoadError(f"'{path}' is not a program torch.export.load reads: {type(exc).__name__}: {exc}") from None
    if isinstance(model, torch.export.ExportedProgram):
        return model
    if not isinstance(model, torch.nn.Module):
        raise LoadError(f"the {options.target} target quantizes a torch.nn.Module, an ExportedProgram or a .pt2 "
                        f"file, not {type(model).__name__} (ONNX models: the onnxruntime-cpu or tosa-int8 "
                        "targets)")  # fmt: skip
    if options.example_inputs is None:
        raise LoadError(f"exporting the PyTorch module {type(model).__name__} needs example_inputs=")
    given = options.example_inputs
    if isinstance(given, Mapping):  # by forward's parameter names (taken from a sample): run positionally
        positional, _ = forward_inputs(model)
        if list(given) != positional[: len(given)]:
            gap = f"{', '.join(given)} leave a gap in {', '.join(positional)}"
            raise LoadError(f"the {options.target} target runs {type(model).__name__} with positional inputs: {gap}; "
                            "give example_inputs=")  # fmt: skip
        given = tuple(given.values())
    args = tuple(given) if isinstance(given, (tuple, list)) else (given,)
    quiet = quiet_torch()
    try:
        return torch.export.export(model.eval(), tuple(contiguous(a) for a in args))
    except Exception as exc:  # torch's message in a few lines, as the ONNX targets' front door says it
        raise export_error(f"torch.export.export failed for module {type(model).__name__}", exc, args) from None
    finally:
        quiet.close()


def signature(program: Any) -> tuple[list[str], ir.Model]:
    """The program's user inputs (names in order) and an ONNX model with only those inputs, their dtypes
    and shapes: what requant's sample checks read."""
    specs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = []
    for spec in specs:
        fake = placeholders[spec.arg.name].meta["val"]
        dtype = ir.DataType.from_numpy(np.dtype(str(fake.dtype).removeprefix("torch.")))
        values.append(ir.Value(name=spec.arg.name, type=ir.TensorType(dtype), shape=ir.Shape(list(fake.shape))))
    graph = ir.Graph(values, [], nodes=[], name="signature", opset_imports={"": 17})
    return [str(v.name) for v in values], ir.Model(graph, ir_version=10)


def export_program(model: Any, options: Options) -> Exported:
    program = _program(model, options)
    names, model_of_inputs = signature(program)
    if not names:
        raise LoadError("the program takes no tensor input: there is nothing to calibrate it on")
    return Exported(program, names, model_of_inputs)


def _feed(module: Any, names: list[str], sample: dict[str, Any]) -> None:
    module(*[contiguous(sample[n]) for n in names])


def _probe(exported: Exported, module: Any, first: list[Any], options: Options) -> Probe:
    """What the float ``module`` shows on the ``first`` calibration samples (:class:`Probe`)."""

    def args(head: list[Any]) -> list[tuple[Any, ...]]:
        return [tuple(contiguous(s[n]) for n in exported.names) for s in head]

    depthwise, look_depthwise = channel_maxima(depthwise_inputs(module) if options.equalization else {})
    groups, _ = linear_groups(module) if options.smoothing else ({}, None)
    linear, look_linear = input_maxima(groups)

    def look(node: Any, out: Any) -> None:
        look_depthwise(node, out)
        look_linear(node, out)

    ranges = probe_ranges(module, args(first[:PROBE_SAMPLES]), look)
    if groups:  # the linear inputs' maxima on more samples than the ranges'
        look_at_outputs(module, args(first[PROBE_SAMPLES:SMOOTHING_SAMPLES]), look_linear)
    return Probe(ranges, depthwise, linear)


def _prepared(exported: Exported, quantizer: Any, first: list[Any], options: Options) -> tuple[Any, dict[str, Any]]:
    """The float module probed (:func:`_probe`), smoothed (:mod:`requant.pt2e.smooth`: its ``mul`` nodes kept
    float), annotated, prepared and equalized (:mod:`requant.pt2e.equalize`); the ``smoothing`` and
    ``equalization`` records."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    module = exported.module
    probe = exported.probed = exported.probed or _probe(exported, module, first, options)
    quantizer.ranges = probe.ranges
    smoothed, factors = smooth(module, probe.linear, options.smoothing) if options.smoothing else (OFF, {})
    quantizer.keep_float.update({m: "smoothing scales its input per channel" for m in smoothed.muls})
    records = smoothing_section(smoothed, options.smoothing)
    prepared = prepare_pt2e(module, quantizer)
    prepared.meta.setdefault(FACTORS, {}).update(factors)
    if not options.equalization:
        return prepared, {**records, "equalization": {"enabled": False, "not_applied": "turned off", "chains": []}}
    chains, others = depthwise_chains(prepared)
    done = [r.__dict__ for r in equalize(prepared, chains, probe.depthwise)]
    done += [Equalized("", None, name, "", skipped=why).__dict__ for name, why in others]
    why = None if chains else "no convolution -> activation -> depthwise convolution chain"
    equalized = {"enabled": True, "max_scale": MAX_SCALE, "not_applied": why, "chains": done}
    return prepared, {**records, "equalization": equalized}


def calibrate(
    exported: Exported, quantizer: Any, samples: Samples, options: Options, only: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Equalization, ``prepare_pt2e`` with ``quantizer``, one calibration pass (the first samples held out
    when there are enough; the kernels' input moments gathered in it), the weights rounded against them,
    the method chosen (or the one asked for), ``convert_pt2e``, the biases corrected. Returns the
    converted module and the records (``equalization``, ``weight_rounding``, ``method_choice``,
    ``bias_correction``). ``only``: the method an earlier choice made (the same samples held out, no
    choice made again)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    first = samples.head(exported.signature, 4 * CHOICE_SAMPLES)
    prepared, evened = _prepared(exported, quantizer, first, options)
    held = CHOICE_SAMPLES if len(first) >= 4 * CHOICE_SAMPLES and options.method == "auto" else 0
    watched, unhook = watch_inputs(prepared)
    progress = options.progress or terminal_progress("calibrating")
    seen = 0
    with torch.no_grad():
        for i, sample in enumerate(samples.each(exported.signature)):
            if i >= held:
                _feed(prepared, exported.names, sample)
                seen += 1
                progress(seen, 0.0)
    unhook()
    records: dict[str, Any] = {**evened, "weight_rounding": round_weights(prepared, watched)}
    if options.method != "auto" or only:
        _use(prepared, only or str(options.method))
        reference = copy.deepcopy(prepared) if options.bias_correction else None  # convert consumes it
        converted = convert_pt2e(prepared)
        corrected = _corrected(reference, converted, exported, first[held:], first[:CHOICE_SAMPLES])
        return converted, {**records, "bias_correction": corrected}
    calibrated = [m for m in prepared.modules() if len(getattr(m, "statistics", {})) > 1]
    if not calibrated or any(getattr(m, "is_dynamic", False) for m in prepared.modules()):
        # nothing to choose between, or inputs quantized per call beside calibrated ones: a copy of a
        # prepared program with dynamic specs does not convert in torchao 0.18 ("No chose qparams node")
        why = (
            "no activation is calibrated (dynamic inputs only)"
            if not calibrated
            else "the model has inputs quantized per call (dynamic): its copies cannot be converted to compare"
        )
        return convert_pt2e(prepared), {**records, "method_choice": {"chosen": "minmax", "why": f"not chosen: {why}"}}
    compare = first[:held] if held else first[:CHOICE_SAMPLES]
    converted, choice, f = _choose(prepared, exported, compare, held)
    reference = prepared if options.bias_correction else None  # the candidates converted copies of it
    chosen = (choice["metric"], choice["scores"][choice["chosen"]])  # its score before correction: known
    corrected = _corrected(reference, converted, exported, first[held:], compare, (f, chosen))
    return converted, {**records, "method_choice": choice, "bias_correction": corrected}


def _corrected(
    reference: Any,
    converted: Any,
    exported: Exported,
    fit: list[Any],
    compare: list[Any],
    known: tuple[np.ndarray, tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """Bias correction (:mod:`requant.pt2e.bias`) from ``BIAS_SAMPLES`` of ``fit``, kept where the output
    gets closer to float on ``compare``; its report section (empty when there is nothing to correct)."""
    if reference is None or not static_kernels(converted) or not fit:
        return {}
    args = [tuple(contiguous(s[n]) for n in exported.names) for s in fit[:BIAS_SAMPLES]]
    session = ModuleSession(fused(converted), exported.names)  # shares the biases corrected in place
    if known is None:  # float's outputs on the compared samples, and the converted program's score there
        f = np.concatenate([o[0] for o in exported.float_outputs(compare)])
        metric, before = _score(f, session, compare)
    else:
        f, (metric, before) = known
    moved = correct_biases(reference, converted, args)
    _, after = _score(f, session, compare)
    kept = after < before if metric == "kl" else after > before
    if not kept:
        correct_biases(reference, converted, args, sign=-1.0)
    return {"enabled": True, "kept": kept, "kernels": moved, "samples": len(args), "metric": metric,
            "before": before, "after": after,
            "why": f"{metric} {before:.3g} -> {after:.3g} on {len(compare)} samples"}  # fmt: skip


def _use(prepared: Any, method: str) -> None:
    for module in prepared.modules():
        if method in getattr(module, "statistics", {}):
            module.method = method


def softmax_kl(float_out: np.ndarray, quantized: np.ndarray) -> float:
    """The mean KL divergence of the quantized scores' softmax from float's, over the rows."""
    f = float_out.reshape(len(float_out), -1).astype(np.float64)
    q = quantized.reshape(len(quantized), -1).astype(np.float64)
    pf, pq = np.exp(f - f.max(1, keepdims=True)), np.exp(q - q.max(1, keepdims=True))
    pf, pq = pf / pf.sum(1, keepdims=True), pq / pq.sum(1, keepdims=True)
    return float(np.mean(np.sum(pf * (np.log(pf + 1e-12) - np.log(pq + 1e-12)), axis=1)))


def _score(f: np.ndarray, session: ModuleSession, compare: list[Any]) -> tuple[str, float]:
    """(metric, value) of ``session``'s first output against float's (``f``) on the ``compare`` samples:
    the KL divergence of class scores (lower is closer), else the SQNR (higher)."""
    q = np.concatenate([session.run(None, s)[0] for s in compare])
    if f.ndim == 2 and f.shape[1] > 1:
        return "kl", softmax_kl(f, q)
    noise = float(((f - q) ** 2).sum())
    return "sqnr_db", float(10 * np.log10(float((f**2).sum()) / noise)) if noise > 0 else float("inf")


def _choose(prepared: Any, exported: Exported, compare: list[Any], held: int) -> tuple[Any, dict[str, Any], np.ndarray]:
    """The candidate closest to float on ``compare`` (each run as :func:`~requant.pt2e.fused.simulated`, the
    chosen one then converted), the choice's record, and float's outputs there."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    f = np.concatenate([o[0] for o in exported.float_outputs(compare)])  # once, for every candidate
    scores: dict[str, float] = {}
    metric = "sqnr_db"
    for method in AUTO_METHODS:
        _use(prepared, method)
        candidate = simulated(prepared) or fused(convert_pt2e(copy.deepcopy(prepared)))
        metric, scores[method] = _score(f, ModuleSession(candidate, exported.names), compare)
    if not scores:
        raise RequantError("no calibration method to choose from")
    best = (min if metric == "kl" else max)(scores, key=scores.__getitem__)
    _use(prepared, best)
    converted = convert_pt2e(copy.deepcopy(prepared))  # the prepared program stays bias correction's reference
    which = f"{len(compare)} held-out calibration samples" if held else f"{len(compare)} calibration samples"
    named = "KL divergence of the softmax from float's (least)" if metric == "kl" else "output's SQNR (highest)"
    listed = ", ".join(f"{m} {v:.3g}" if metric == "kl" else f"{m} {v:.1f} dB" for m, v in scores.items())
    choice = {"chosen": best, "held_out": held, "samples": len(compare), "metric": metric, "scores": scores,
              "why": f"the {named} on {which}: {listed}"}  # fmt: skip
    return converted, choice, f
