"""requant's main job, ``quantize(model, calibration_data, **options)``: the stages, in order, on one screen.

Each stage is a module of :mod:`requant.stages` (what it reads, adds and records is in its docstring);
options are checked once, before any work (:mod:`requant.options`); the calibration data is opened once
(:class:`~requant.calibration.samples.Samples`); the report is the sections the stages record, and
its summary is read from them (:mod:`requant.stages.report`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.backends.tosa import TosaProgram
from requant.backends.tosa.mlir import to_mlir
from requant.calibration.samples import KEEP_SAMPLES, Samples
from requant.errors import ArgumentError, RequantError
from requant.frontends.hf_parts import load_parts, parts_of
from requant.ir.random_ops import unseeded
from requant.options import OPTIONS, Options, preflight
from requant.report.agreement import Reference
from requant.runtime import one_blas_thread
from requant.stages import joins
from requant.stages.blocks import quantize_blocks
from requant.stages.budget import keep_float_below, within_budget
from requant.stages.check import check
from requant.stages.choose import choose_method
from requant.stages.load import front_door, transformed_data
from requant.stages.lower import lower
from requant.stages.outputs import check_outputs
from requant.stages.report import parts_summary, summary
from requant.stages.run import Flow, Run
from requant.stages.speed import measure_speed
from requant.targets.kernels import host_kernel_model

__all__ = ["QuantizedModel", "quantize"]

log = logging.getLogger("requant")


@dataclass
class QuantizedModel:
    """The quantized model (QDQ ONNX) and its report (a JSON-able dict); for the ``tosa-int8`` target,
    also its integer TOSA program (``tosa``; ``mlir()`` its text); for ``executorch-xnnpack``, the
    ``.pte`` program's bytes (``pte``) and no ONNX model. ``save(path)`` writes the model: MLIR text for
    a path ending in ``.mlir``, the ``.pte`` for that target, the QDQ model otherwise."""

    model: ir.Model | None
    report: dict[str, Any] = field(default_factory=dict)
    tosa: TosaProgram | None = None
    pte: bytes | None = None  # the executorch-xnnpack target's program (``model`` is None there)
    staged: Any = None  # a language model's: the folder it is written to (requant.stages.blocks.Staged)
    parts: dict[str, QuantizedModel] | None = None  # a model of parts' (Whisper, CLIP): each part's, by name

    def mlir(self) -> str:
        if self.tosa is None:
            raise RequantError("only the tosa-int8 target writes MLIR (quantize with target='tosa-int8')")
        return to_mlir(self.tosa)

    def save(self, path: str | os.PathLike[str]) -> None:
        from requant import frontends  # (read when called: the tests replace its savers to make them fail)

        if self.staged is not None:  # a language model: its folder, or its .onnx with its data
            self.staged.save(path)
        elif self.parts is not None:  # a model of parts: a folder, a file each (Optimum's names)
            os.makedirs(path, exist_ok=True)
            for name, part in self.parts.items():
                part.save(os.path.join(path, f"{name}.onnx"))
        elif str(path).endswith(".mlir"):
            frontends.save_text(self.mlir(), path)
        elif self.pte is not None:
            frontends.save_bytes(self.pte, path)
        elif self.model is not None:
            frontends.save_onnx(self.model, path)


@one_blas_thread
def quantize(model: Any, calibration_data: Any, options: Options | None = None, **given: Any) -> QuantizedModel:
    """Quantize ``model`` (a path, bytes, ``ModelProto``, onnx-ir model or PyTorch module) for a target,
    calibrated on ``calibration_data``; ``options`` (an :class:`~requant.options.Options`), or the options
    by name (every one is listed below, and in docs/cli.md)."""
    started = time.perf_counter()
    options = options or Options.create(**given)
    preflight(options, model, calibration_data)  # before any work: a refused run writes nothing
    if parts_of(model):
        parted = quantize_parts(model, calibration_data, options)
        if options.output is not None:
            parted.save(options.output)
        return parted
    model, calibration_data, options, said = front_door(model, calibration_data, options)
    result: QuantizedModel = FLOWS[options.flow](model, calibration_data, options, started)
    if said:  # how the model came in: the report's first entries, and the summary's lines on them
        result.report = {**said, **result.report}
        result.report["summary"] = summary(result.report)
    if options.output is not None:
        result.save(options.output)
    return result


quantize.__doc__ = (
    (quantize.__doc__ or "")
    + "\n\n"
    + "\n".join(f"    ``{o.name}`` (default {o.default!r}): {o.help}" for o in OPTIONS)
)


def quantize_parts(folder: Any, calibration_data: Any, options: Options) -> QuantizedModel:
    """A Hugging Face folder of a model of parts (:mod:`requant.frontends.hf_parts`: Whisper's encoder and decoder,
    CLIP's text and vision towers): each part exported, its data read from the data given, and quantized by the
    options' flow as a model of its own; the report holds each part's (``parts``), and its summary theirs."""
    if options.flow not in PARTS_FLOWS:
        raise ArgumentError(f"'{folder}' holds a model of parts: it is quantized for ONNX Runtime (the onnxruntime-cpu "
                            f"targets, or --preset INT4_BLOCKWISE_WEIGHTS), not {options.target}")  # fmt: skip
    calibration_data, options = transformed_data(calibration_data, options)
    parts: dict[str, QuantizedModel] = {}
    parted = load_parts(folder)
    for part in parted.parts:
        evaluation = part.samples(options.eval_data, "evaluation", parted.names, options.text_field)
        given = dataclasses.replace(options, output=None, eval_data=evaluation)
        calibration = part.samples(calibration_data, "calibration", parted.names, options.text_field)
        log.info("quantizing %s's %s", folder, part.name)
        result = FLOWS[options.flow](part.model, calibration, given, time.perf_counter())
        result.report = {"model_source": part.said, **result.report}
        result.report["summary"] = summary(result.report)
        parts[part.name] = result
    report: dict[str, Any] = {"target": options.target, "parts": {n: p.report for n, p in parts.items()}}
    data, what = (options.eval_data, "evaluation") if options.eval_data is not None else (calibration_data,
                                                                                          "calibration")  # fmt: skip
    models = {name: part.model for name, part in parts.items() if part.model is not None}
    report["together"] = parted.check(models, data, what) if len(models) == len(parts) else {}
    report["summary"] = parts_summary(report)
    return QuantizedModel(None, report, parts=parts)


def quantize_onnx(model: Any, calibration_data: Any, options: Options, started: float) -> QuantizedModel:
    """The ONNX targets' stages (``qdq``, ``tosa``): annotate -> calibrate (choose the method) -> convert ->
    keep float where far or slow -> check -> lower."""
    flow = Flow(model, options, Samples(calibration_data))
    keep = sys.maxsize if options.max_drop is not None else KEEP_SAMPLES  # every budget try reads it all again
    evaluation = Samples(options.eval_data, "evaluation", keep) if options.eval_data is not None else None
    report: dict[str, Any] = {"target": options.target, "target_description": options.chosen_target.description}
    if options.method == "auto":  # annotate -> calibrate (each candidate) -> convert, the closest kept
        run, report["method_choice"] = choose_method(flow)
    else:  # annotate -> calibrate -> convert
        run = flow.run(options.quantizer, options.method)
    run, kept = keep_float_below(flow, run)
    reference = Reference(run.float_proto)  # its outputs on the evaluation samples, computed once for all
    budget: dict[str, Any] | None = None
    tried: list[Run] = []
    if options.max_drop is not None:
        run, budget, tried = within_budget(flow, run, evaluation, reference)
    held_out = report.get("method_choice", {}).get("held_out", 0)
    run, checked = check_outputs(flow, run, held_out)  # every output against float; a remedy where one is far
    seconds = time.perf_counter() - started
    run, timed = measure_speed(flow, run, reference, budget, tried)  # against float; a remedy where no faster
    report.update(run.section(options), **joins.section(run), **kept, **checked, **timed, quantize_seconds=seconds)
    if options.fixed_inputs:
        report["fixed_inputs"] = {name: np.asarray(v).tolist() for name, v in options.fixed_inputs.items()}
    report.update(check(flow, run, evaluation, reference))
    if budget is not None:
        report["accuracy_budget"] = budget
    report["this_cpu"] = host_kernel_model().name  # what the machine computes (the advice depends on it)
    program, lowered = lower(flow, run, evaluation, reference)
    report.update(lowered)
    report["summary"] = summary(report)
    return QuantizedModel(unseeded(run.converted.model), report, program)  # draws as the user's model did


def quantize_pt2e(model: Any, calibration_data: Any, options: Options, started: float) -> QuantizedModel:
    """The ``executorch-xnnpack`` target's stages: export -> annotate (requant's PT2E quantizer) ->
    calibrate -> choose the method -> convert -> lower to a ``.pte`` -> check it against its program,
    float and time (:mod:`requant.stages.pt2e`, :mod:`requant.stages.pte`)."""
    from requant.stages import pt2e, pt2e_budget, pte, pte_outputs

    exported = pt2e.export_program(model, options)
    samples = Samples(calibration_data)
    run = pt2e.quantize_once(exported, samples, options)
    run, checked = pte_outputs.check_outputs(exported, run, samples, options)  # every output; a remedy where far
    evaluation = Samples(options.eval_data, "evaluation") if options.eval_data is not None else None
    if options.max_drop is not None and evaluation is not None:  # Options checked that eval_data comes with it
        run, budget = pt2e_budget.within_budget(exported, run, samples, evaluation, options)
        checked.update(budget)
    seconds = time.perf_counter() - started
    report: dict[str, Any] = {"target": options.target, "target_description": options.chosen_target.description}
    if run.quantizer.quantizer.chooses_by_model:
        report["quantizers"] = {"preset_choice": f"{run.quantizer.preset} ({run.quantizer.preset_why})"}
    report.update({name: record for name, record in run.records.items() if record})
    report["pt2e"] = {"quantizer": "requant.pt2e.RequantQuantizer", "nodes": run.quantizer.records}
    report.update(checked, **pte.check_pte(exported, run.converted, run.lowered, samples, evaluation, options))
    report["quantize_seconds"] = seconds
    report["summary"] = summary(report)
    return QuantizedModel(None, report, pte=run.lowered.pte)


# each flow's stages, by Options.flow (the target's backend, or "blocks" for a weight-only block preset)
def quantize_weight_blocks(model: Any, calibration_data: Any, options: Options, started: float) -> QuantizedModel:
    """A weight-only block preset's flow: a decoder's (:mod:`requant.stages.blocks`), or any other model's
    linear layers (:mod:`requant.stages.encoder_blocks`)."""
    from requant.stages.encoder_blocks import is_decoder, quantize_encoder_blocks

    if is_decoder(model):
        return quantize_blocks(model, calibration_data, options, started)
    return quantize_encoder_blocks(model, calibration_data, options, started)


PARTS_FLOWS = ("qdq", "blocks")  # the flows a model of parts goes through, each part on its own
FLOWS = {"qdq": quantize_onnx, "tosa": quantize_onnx, "executorch": quantize_pt2e, "blocks": quantize_weight_blocks}
