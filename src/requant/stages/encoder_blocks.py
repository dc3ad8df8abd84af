"""Stage encoder blocks: weight-only blocks (``MatMulNBits``) for a model that is not a causal language model (an
encoder, a vision transformer): ``--preset INT4_BLOCKWISE_WEIGHTS`` on its ONNX file or its Hugging Face folder.

The decoders' rounding (:mod:`requant.stages.blocks`), on the front door's samples (a Hugging Face folder's text
tokenized: :mod:`requant.frontends.hf_folder`): load and canonicalize (each linear layer's weight a constant)
-> each linear layer's input moments ``sum x x^T`` over the calibration samples but the first ``HELD_OUT`` (held
out when there are three times as many) -> the activation-aware scale search -> each layer's rounding chosen
by its output error -> ``MatMulNBits``, the activations float -> the first output against float's on the held-out
samples (cosine far below float's: an alarm, ``--strict`` exits 3) -> with ``eval_data``, on it -> the latency,
float and quantized interleaved (unless ``--no-measure``).

Records: ``encoder_blocks`` (the format, the layers and each one's rounding), ``outputs`` (the held-out check),
``evaluation``, ``size_bytes``, ``latency_ms_batch1``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import onnx_ir as ir

from requant.calibration.runner import collect
from requant.calibration.samples import Samples
from requant.errors import ArgumentError
from requant.frontends.hf_folder import is_causal_folder, text_rows
from requant.llm.nbits import linear_weights, to_matmul_nbits
from requant.report.agreement import Reference, agreement
from requant.report.latency import interleaved_latency_ms, session
from requant.stages.blocks import METHODS, scale_search
from requant.stages.load import load_model

if TYPE_CHECKING:
    from requant.calibration.observers import Observer
    from requant.options import Options
    from requant.pipeline import QuantizedModel

__all__ = ["FAR_COSINE", "HELD_OUT", "InputMoments", "alarm_lines", "is_decoder", "lines", "quantize_encoder_blocks"]

HELD_OUT = 8  # calibration samples held out to check the output (when there are three times as many)
FAR_COSINE = 0.9  # a held-out cosine to float's below this: an alarm (MiniLM at 4 bits / 128: 0.986)


def is_decoder(model: Any) -> bool:
    """Whether ``model`` is what the decoders' flow reads: a folder (onnxruntime-genai's, a causal LM's Hugging
    Face folder), a GGUF file, or an ONNX file with ``input_ids`` in and ``logits`` out."""
    import os
    from pathlib import Path

    if not isinstance(model, str | os.PathLike):
        return False
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file() and not (path / "genai_config.json").is_file():
        return is_causal_folder(path)
    if path.is_dir() or path.suffix == ".gguf":
        return True
    loaded = ir.load(path) if path.is_file() and path.suffix == ".onnx" else None
    if loaded is None:
        return True  # the decoders' flow says what it cannot read
    inputs, outputs = {v.name for v in loaded.graph.inputs}, {v.name for v in loaded.graph.outputs}
    return "input_ids" in inputs and "logits" in outputs


class InputMoments:
    """``sum x x^T`` over a value's last axis (float64), as the decoders' flow gathers it."""

    batchable = False

    def __init__(self) -> None:
        self.total: Any = None

    def update(self, value: np.ndarray) -> None:
        rows = np.asarray(value, np.float64).reshape(-1, value.shape[-1])
        product = rows.T @ rows
        self.total = product if self.total is None else self.total + product


def _round(model: ir.Model, samples: list[Any], options: Options) -> list[dict[str, Any]]:
    """The model's linear layers rewritten in place as ``MatMulNBits`` in the options' block format."""
    fmt = options.block_format
    layers = linear_weights(model.graph)
    if not layers:
        raise ArgumentError("the model has no linear layer with a constant weight: INT4_BLOCKWISE_WEIGHTS has "
                            "nothing to put in blocks (the default presets quantize its activations)")  # fmt: skip
    observers = {str(node.inputs[0].name): InputMoments() for node, _ in layers.values()}  # type: ignore[union-attr]
    collect(model, samples, cast("Mapping[str, Observer]", observers), options.progress)  # (duck-typed observers)
    moments = {name: observers[str(node.inputs[0].name)].total for name, (node, _) in layers.items()}  # type: ignore[union-attr]
    scales = scale_search(model.graph, fmt)
    scales(moments)
    return to_matmul_nbits(model, fmt, moments, METHODS)


def quantize_encoder_blocks(model: Any, calibration_data: Any, options: Options, started: float) -> QuantizedModel:
    """The flow of this module (see its docstring)."""
    from requant.pipeline import QuantizedModel  # (it imports this module's flow)

    if not isinstance(model, ir.Model) and text_rows(calibration_data, options.text_field, "calibration") is not None:
        raise ArgumentError(f"'{model}' is not a causal language model (input_ids in, logits out) nor a Hugging "
                            "Face folder with a tokenizer: text cannot be its calibration data (give its samples: "
                            ".npz)")  # fmt: skip
    loaded = load_model(model, options.chosen_target, options.load_options).model
    float_proto = ir.serde.serialize_model(loaded)
    every = Samples(calibration_data).head(loaded, 1 << 16)
    split = HELD_OUT if len(every) >= 3 * HELD_OUT else 0  # too few: checked on the samples it calibrated on
    held, calibration = every[:split] or every, every[split:]
    records = _round(loaded, calibration, options)
    proto = ir.serde.serialize_model(loaded)
    float_session, quantized = session(float_proto), session(proto)  # each opened once, for every check
    chosen = Counter(r["rounding"]["chosen"] for r in records if "rounding" in r)
    fmt = options.block_format
    report: dict[str, Any] = {"target": options.target, "target_description": options.chosen_target.description}
    report["encoder_blocks"] = {"format": f"{fmt.bits} bits, blocks of {fmt.block_size}, "
                                          f"{'symmetric' if fmt.symmetric else 'asymmetric'}",
                                "layers": len(records), "roundings": dict(sorted(chosen.items())),
                                "calibration_samples": len(calibration),
                                "records": records}  # fmt: skip
    checked = agreement(loaded, Reference(float_proto, session=float_session), quantized, held)
    poor = [str(loaded.graph.outputs[0].name)] if checked["cosine_similarity"] < FAR_COSINE else []
    report["outputs"] = {"held_out": checked, "samples": len(held), "poor": poor}  # poor: --strict exits 3
    if options.eval_data is not None:
        reference = Reference(float_proto, session=float_session)  # (its outputs are the evaluation's, apart)
        report["evaluation"] = agreement(loaded, reference, quantized, Samples(options.eval_data, "evaluation"))
    report["size_bytes"] = {"float": float_proto.ByteSize(), "quantized": proto.ByteSize()}
    report["quantize_seconds"] = time.perf_counter() - started
    if options.measure:
        times = interleaved_latency_ms([float_session, quantized], held[0])
        report["latency_ms_batch1"] = {"float": times[0], "quantized": times[1], "measured": "interleaved"}
    from requant.stages.report import summary

    report["summary"] = summary(report)
    return QuantizedModel(loaded, report)


def alarm_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's line on blocks that took the output far from float's, first."""
    checked = (report.get("outputs") or {}).get("held_out")
    if "encoder_blocks" not in report or not checked or checked["cosine_similarity"] >= FAR_COSINE:
        return []
    return [f"NOT USABLE AS IS: the first output's cosine to float's is {checked['cosine_similarity']:.4f} on "
            f"{report['outputs']['samples']} held-out calibration samples (below {FAR_COSINE})"]  # fmt: skip


def lines(report: Mapping[str, Any]) -> list[str]:
    section = report.get("encoder_blocks")
    if not section:
        return []
    chosen = ", ".join(f"{name} x{n}" for name, n in section["roundings"].items())
    checked = report["outputs"]["held_out"]
    return [
        f"weight-only blocks: {section['layers']} linear layers in {section['format']} (MatMulNBits), the "
        f"activations float; rounding chosen by each layer's output error: {chosen}; calibrated on "
        f"{section['calibration_samples']} samples",
        f"held out: the first output's cosine to float's {checked['cosine_similarity']:.5f}, SQNR "
        f"{checked['sqnr_db']:.1f} dB ({report['outputs']['samples']} samples)",
    ]
