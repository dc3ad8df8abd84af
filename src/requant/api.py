"""requant's main job, :func:`quantize` (:mod:`requant.pipeline`), and its steps for those who want to look
between them: ``prepare`` (load, canonicalize, even out, annotate) -> ``calibrate`` (observers over the
data) -> ``convert`` (propagate, encode weights, write QDQ, correct biases, lint).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from requant.calibration.calibrate import calibrate  # the step itself: observers over the data
from requant.calibration.runner import Progress
from requant.pipeline import QuantizedModel, quantize
from requant.quantizers import Quantizer, QuantizerReport
from requant.report.lint import LintResult
from requant.stages.annotate import annotate
from requant.stages.convert import convert as _convert
from requant.stages.transform import Evening
from requant.targets.registry import DEFAULT_TARGET, get_target
from requant.transforms.bias_correction import DEFAULT_SAMPLES
from requant.transforms.smoothing import DEFAULT_ALPHA

__all__ = ["QuantizedModel", "calibrate", "convert", "prepare", "quantize"]


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
    ``smoothing_data``, calibration samples; :mod:`requant.transforms.smoothing`,
    :mod:`requant.transforms.equalization`) and annotate (with ``quantizer``, or the preset
    ``choose_preset`` picks for the model among the target's).

    ``strict``: a node a quantizer was asked to quantize but could not is an error naming it. An
    ``ir.Model`` given as ``source`` is copied first: the caller's model is never changed.
    """
    chosen = get_target(target)
    evening = Evening.of(smoothing, equalization, smoothing_data, None, {}) if smoothing_data is not None else None
    quantizer = (quantizer or Quantizer().set_global_by_model()).for_table(chosen.table)
    prepared = annotate(source, quantizer, chosen, strict, None, evening, load_options)
    return prepared.model, prepared.report


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
    biases corrected (:mod:`requant.transforms.bias_correction`).
    """
    converted = _convert(model, get_target(target), bias_data, bias_samples, progress, correct)
    return converted.model, converted.notes, converted.lint_result
