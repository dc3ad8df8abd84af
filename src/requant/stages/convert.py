"""Stage convert: a calibrated model to the target's QDQ model, checked.

Propagation resolves shared, derived and fixed requests and the target's same-scale constraints
(:mod:`requant.propagation`), and encodes each kernel's weights for how the target's kernels add
(:mod:`requant.encoding`); the QDQ model is written (:mod:`requant.backends.qdq`); each int8
convolution's and Gemm's bias gets back the mean shift quantization caused
(:mod:`requant.transforms.bias_correction`); lint reads what ONNX Runtime fused.

Reads: the calibrated model, the target, the samples (bias correction's first ones). Adds: the QDQ
model. Records: ``propagated``, ``rescales``, ``weight_encoding``, ``bias_correction``, ``lint``,
``size_bytes`` (the quantized model's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir

from requant.backends import finish_qdq, materialize_qdq
from requant.backends.embedding_rows import BLOCK, write_embedding_rows
from requant.backends.fused_gelu import write_gelus
from requant.calibration.runner import Progress
from requant.encoding.weight_encoding import EncodingMemo, WeightEncoding
from requant.propagation.propagate import propagate
from requant.report.lint import LintResult, lint
from requant.report.markdown import encoding_summary
from requant.targets.kernels import HOST_MODELS, ONNXRUNTIME_X86_AMX
from requant.targets.registry import Target
from requant.transforms.bias_correction import (
    DEFAULT_SAMPLES,
    BiasCorrection,
    BiasSums,
    correct_biases,
    float_parameters,
)

__all__ = ["SKETCH_SAMPLES", "Converted", "Staged", "convert", "finish", "section", "sketch", "stage"]

SKETCH_SAMPLES = 8  # the samples each candidate of method="auto" has its biases corrected on, to compare


@dataclass
class Staged:
    """A calibrated model with its QDQ written, before bias correction and the final rewrites."""

    model: ir.Model
    notes: list[Any]
    encodings: list[WeightEncoding]
    floats: dict[str, ir.TensorProtocol]  # the kernels' float parameters, for bias correction
    tables: list[dict[str, Any]] = field(default_factory=list)  # embedding tables in rows (embedding_rows)


@dataclass
class Converted:
    model: ir.Model
    proto: onnx.ModelProto  # serialized once: lint and the report share it
    notes: list[Any]
    encodings: list[WeightEncoding]
    lint_result: LintResult
    kernels: list[BiasCorrection]
    # the kernels' float weights and biases as quantized (smoothed, equalized), by value name
    floats: dict[str, ir.TensorProtocol] = field(default_factory=dict)
    tables: list[dict[str, Any]] = field(default_factory=list)  # embedding tables in rows (embedding_rows)


def convert(
    model: ir.Model,
    target: Target,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
) -> Converted:
    """``model`` staged and finished: with ``bias_data`` (calibration samples), the int8 convolutions
    and Gemms measured against their float versions on its first ``bias_samples`` samples and, with
    ``correct``, their int32 biases corrected."""
    return finish(stage(model, target, bias_data is not None), bias_data, bias_samples, progress, correct)


def stage(model: ir.Model, target: Target, keep_floats: bool, memo: EncodingMemo | None = None) -> Staged:
    """Propagation (weights encoded), and the QDQ model written."""
    propagation = propagate(model, target.kernels, memo, target.table.same_scale, target.table.joins)
    tables = [] if target.integer_only else write_embedding_rows(model)
    floats = float_parameters(model) if keep_floats else {}
    written = materialize_qdq(model)
    if not target.integer_only:
        write_gelus(written)
    return Staged(written, propagation.notes, propagation.encodings, floats, tables)


def finish(
    staged: Staged,
    bias_data: Any = None,
    bias_samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    correct: bool = True,
    sums: BiasSums | None = None,
) -> Converted:
    """Bias correction, the QDQ model's final rewrites, and lint. ``sums``: what a sketch of ``staged``
    measured, for bias correction to start from."""
    model = staged.model
    kernels = []
    if bias_data is not None:
        kernels = correct_biases(model, staged.floats, bias_data, bias_samples, progress, correct, sums)
    finish_qdq(model)
    proto = ir.serde.serialize_model(model)
    return Converted(model, proto, staged.notes, staged.encodings, lint(proto), kernels, staged.floats, staged.tables)


def sketch(staged: Staged, bias_data: Any, correct: bool) -> tuple[onnx.ModelProto, BiasSums]:
    """``staged`` finished on a copy with biases corrected on only ``SKETCH_SAMPLES`` samples, serialized
    (``staged`` itself is untouched): a cheaper stand-in for comparing candidates; and what its bias
    correction summed, which finishing ``staged`` starts from."""
    copy = staged.model.clone()
    sums = BiasSums()
    if bias_data is not None:
        correct_biases(copy, staged.floats, bias_data, SKETCH_SAMPLES, lambda done, elapsed: None, correct, sums)
    finish_qdq(copy)
    return ir.serde.serialize_model(copy), sums


def section(converted: Converted, target: Target, bias_correction: bool, float_size: int) -> dict[str, Any]:
    """The report's sections on what conversion did."""
    return {
        "propagated": [n.as_dict() for n in converted.notes],
        # where an op the target binds to one type got two (targets.constraints): a rescale, or a float op
        "rescales": [n.as_dict() for n in converted.notes if n.meets],
        "weight_encoding": {
            "kernel_model": target.kernels.name,
            "exact_on": target.kernels.cpus,
            "kernels": [e.__dict__ for e in converted.encodings],
        },
        "bias_correction": {
            "enabled": bias_correction,
            "kernels": [c.__dict__ for c in converted.kernels],
        },
        "embedding_rows": converted.tables,
        "lint": converted.lint_result.to_json(),
        "size_bytes": {"float": float_size, "quantized": converted.proto.ByteSize()},
    }


def rescale_lines(report: Mapping[str, Any]) -> list[str]:
    met = report.get("rescales", [])
    if not met:
        return []
    rescaled = sum(r["how"] == "rescale" for r in met)
    return [
        f"where constraints meet: {len(met)} (ops the target binds to one type that got two: "
        f"{rescaled} rescaled before the op, {len(met) - rescaled} computed in float by the runtime)"
    ]


def encoding_lines(report: Mapping[str, Any]) -> list[str]:
    if not report.get("weight_encoding", {}).get("kernels"):
        return []
    out = [f"int8 weights: {encoding_summary(report['weight_encoding'])}"]
    encodings = report["weight_encoding"]["kernels"]
    host = HOST_MODELS.get(report.get("this_cpu", ""))
    if host is not None and host.exact and any(e["rescaled"] for e in encodings):
        has = "AMX and VNNI" if host is ONNXRUNTIME_X86_AMX else "VNNI"
        out.append(
            f"this CPU has {has}: for CPUs like it, --target onnxruntime-cpu-vnni keeps full-range int8 weights "
            "(exact there, and more accurate; on CPUs without VNNI they can saturate)"
        )
    return out


def table_lines(report: Mapping[str, Any]) -> list[str]:
    """The embedding tables written as rows of 8-bit blocks (:mod:`requant.backends.embedding_rows`)."""
    tables = report.get("embedding_rows", [])
    named = ", ".join(f"{t['table']} ({t['n']} x {t['k']}, SQNR {t['sqnr_db']:.1f} dB)" for t in tables[:3])
    more = f" and {len(tables) - 3} more" if len(tables) > 3 else ""
    return [f"embedding tables in 8-bit blocks of {BLOCK} along each row, read by GatherBlockQuantized "
            f"(no int8 kernel reads their rows): {named}{more}"] if tables else []  # fmt: skip


def lint_lines(report: Mapping[str, Any]) -> list[str]:
    """What lint found (the QDQ targets'), then the size."""
    if "lint" not in report:
        return _size_lines(report)
    checked = LintResult.from_json(report["lint"]).text()
    if report.get("tosa"):  # lint reads the QDQ twin, not the TOSA program (int32 accumulators: nothing saturates)
        checked = "the QDQ twin (-o model.onnx), as ONNX Runtime would run it:\n" + "\n".join(
            f"  {line}" for line in checked.splitlines()
        )
    return [checked, *_size_lines(report)]


def _size_lines(report: Mapping[str, Any]) -> list[str]:
    size = report.get("size_bytes")
    if not size:
        return []
    return [f"size: {size['float'] / 1024:.1f} KiB -> {size['quantized'] / 1024:.1f} KiB "
            f"({size['quantized'] / size['float']:.2f}x)"]  # fmt: skip


def bias_lines(report: Mapping[str, Any]) -> list[str]:
    out = []
    kernels = report.get("bias_correction", {}).get("kernels")
    if kernels and report["bias_correction"].get("enabled"):
        largest = max(kernels, key=lambda k: k["max_shift"])
        out.append(
            f"bias correction: {len(kernels)} kernels, largest shift {largest['max_shift']:.3g} ({largest['node']})"
        )
    if kernels and report["bias_correction"].get("kept") is False:
        why = report["bias_correction"]["why"]
        out.append(f"bias correction not kept: it moved the output further from float ({why})")
    if kernels and all("sqnr_db" in k for k in kernels):
        worst = min(kernels, key=lambda k: k["sqnr_db"])
        out.append(f"kernel SQNR against float: lowest {worst['sqnr_db']:.1f} dB ({worst['node']})")
    return out
