"""Stage load: the user's model in (ONNX or PyTorch), canonicalized, the target's passes run, and a
float16 or bfloat16 model computed in float32 (ONNX Runtime's CPU int8 kernels take float32).

Reads: the model source, the target, the front door's options (``fixed_inputs``, a PyTorch module's
``example_inputs``). Adds: the model every later stage works on. Records: what the target's passes
rewrote (``quantizers.decomposed``, beside the quantizers' own decompositions) and the float type the
model computes in (``quantizers.compute``), and the random ops it gave a seed while requant works on the model
(``quantizers.random_seeded``: :mod:`requant.ir.random_ops`; the written model draws as the user's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from requant.calibration.data import first_sample, transformed
from requant.calibration.samples import Samples
from requant.frontends import LoadError, load
from requant.frontends.hf_folder import is_causal_folder, is_hf_folder, load_hf_folder
from requant.frontends.onnx_loader import has_external_data, weight_bytes
from requant.frontends.torch_loader import examples_from, forward_inputs
from requant.ir.annotations import iter_values
from requant.ir.random_ops import seeded
from requant.options import Options
from requant.passes import get_passes, run_passes
from requant.passes._rewrite import with_opset
from requant.passes.compute_in_float32 import HALF
from requant.targets.registry import Target

__all__ = ["Loaded", "examples_from_data", "front_door", "load_model", "transformed_data"]

log = logging.getLogger("requant")


@dataclass
class Loaded:
    """The model as every later stage sees it, and what loading did to it."""

    model: ir.Model
    decomposed: list[dict[str, str]] = field(default_factory=list)  # what the target's passes rewrote
    compute: str = ""  # the float type the model computes in, when requant changed it
    seeded: list[str] = field(default_factory=list)  # random ops given a seed (requant.ir.random_ops)


def front_door(model: Any, calibration: Any, options: Options) -> tuple[Any, Any, Options, dict[str, str]]:
    """What comes in before the flow starts, in requant's forms: the data through ``transform`` (NNCF's
    ``transform_fn``); a Hugging Face folder exported and text data tokenized with its tokenizer
    (:mod:`requant.frontends.hf_folder`); a PyTorch module's example inputs from the first calibration
    sample when not given. The model, the data, the options, and the report's entries on what was done."""
    said: dict[str, str] = {}
    calibration, options = transformed_data(calibration, options)
    if is_hf_folder(model) and not (options.flow == "blocks" and is_causal_folder(model)):  # (a decoder: its flow)
        exported = load_hf_folder(model)
        model, said["model_source"] = exported.model, exported.said
        calibration = exported.samples(calibration, "calibration", options.text_field)
        evaluation = exported.samples(options.eval_data, "evaluation", options.text_field)
        options = dataclasses.replace(options, eval_data=evaluation)
    if options.example_inputs is None and hasattr(model, "forward") and hasattr(model, "parameters"):
        calibration = Samples(calibration)  # opened once: a generator's first sample kept for calibration
        examples, dynamic = examples_from_data(model, calibration)
        options, said["example_inputs"] = dataclasses.replace(options, example_inputs=examples,
                                                              dynamic_shapes=dynamic), examples.said  # fmt: skip
    return model, calibration, options, said


def transformed_data(calibration: Any, options: Options) -> tuple[Any, Options]:
    """The calibration data and the options' evaluation data through ``transform`` (NNCF's ``transform_fn``),
    when one is given."""
    if options.transform is None:
        return calibration, options
    calibration = transformed(calibration, options.transform, "calibration")
    evaluation = transformed(options.eval_data, options.transform, "evaluation")
    return calibration, dataclasses.replace(options, eval_data=evaluation)


def examples_from_data(module: Any, samples: Samples) -> tuple[Any, dict[str, Any]]:
    """A PyTorch module given without ``example_inputs``: its example inputs and dynamic shapes (the batch
    axis) from the first calibration sample (a generator's first sample is kept for calibration)."""
    _, required = forward_inputs(module)
    sample = first_sample(samples.source, required)
    examples, dynamic = examples_from(module, sample, "the first calibration sample")
    log.info("%s exported with example inputs from %s", type(module).__name__, examples.said)
    return examples, dynamic


def load_model(source: Any, target: Target, load_options: Mapping[str, Any]) -> Loaded:
    """``source`` loaded (an ``ir.Model`` copied first: the caller's is never changed), canonicalized,
    the target's passes run, and computed in float32 when it computes in a half type."""
    if isinstance(source, ir.Model):
        source = source.clone()
    model = _in_memory(load(source, **load_options))
    model, _ = run_passes(model, get_passes("canonicalize"))
    model, rewritten = _target_passes(model, target)
    for value in model.graph.inputs:
        if value.dtype == ir.DataType.BFLOAT16 and value.name not in model.graph.initializers:
            raise LoadError(
                f"input '{value.name}' is bfloat16: ONNX Runtime's Python API takes no bfloat16 arrays (NumPy has no "
                "such type), so the model cannot be calibrated, nor its quantized version fed; export it with float32 "
                "or float16 inputs (bfloat16 weights and ops inside are fine: requant computes them in float32)"
            )
    half = sorted({str(v.dtype) for v in iter_values(model.graph) if v.dtype in HALF})
    compute = ""
    if half:  # ONNX Runtime's CPU int8 kernels (every target so far) take float32 scales and activations
        model, _ = run_passes(model, get_passes("compute-in-float32"))
        kind = " and ".join(t.lower() for t in half)
        compute = (
            f"float32 (the model computed in {kind}; ONNX Runtime's CPU int8 kernels take float32 scales and "
            f"activations: its inputs and outputs keep their {kind} types, through Casts)"
        )
    return Loaded(model, rewritten, compute, seeded(model))


# ONNX Runtime's sessions of the flow open from bytes (protobuf's limit: 2 GiB), where no folder resolves
# an external-data reference: ONNX Runtime 1.31 refuses them ("External data path for model loaded from
# bytes escapes working directory") or, run from the model's folder, writes optimized models that point at it
_IN_MEMORY_LIMIT = 2 << 30


def _in_memory(model: ir.Model) -> ir.Model:
    """``model`` with weights kept in an external data file (torch's default export writes ``model.onnx.data``)
    read into memory, where all its weights fit in what a session opened from bytes takes; larger ones stay
    mapped."""
    if has_external_data(model) and weight_bytes(model) < _IN_MEMORY_LIMIT:
        ir.external_data.load_to_model(model)
    return model


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
