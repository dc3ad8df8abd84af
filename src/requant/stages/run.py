"""One run of the stages that make an int8 model (annotate -> calibrate -> convert), and what every run
of one quantization shares (:class:`Flow`): the options, the samples, the statistics already
measured, the float model.

A quantization runs them once, or more: ``method="auto"`` calibrates candidates from one annotation
(:mod:`requant.stages.choose`), ``keep_float_below`` and the accuracy budget run again with kernels
kept float (:mod:`requant.stages.budget`). Later runs observe nothing twice (``StatisticsCache``).

Records: ``calibrated`` (every type and the observer that chose it), and the sections of the stages
it runs (:func:`Run.section`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx

from requant.calibration.calibrate import Calibrated, StatisticsCache, calibrate
from requant.calibration.runner import Kept, terminal_progress
from requant.calibration.samples import Samples
from requant.options import Options
from requant.quantizers import Quantizer, QuantizerReport
from requant.quantizers.quantizer import FLOAT_PLACED
from requant.runtime import in_stage
from requant.stages import convert, transform
from requant.stages.annotate import Prepared, prepare
from requant.stages.transform import Evened, Evening
from requant.targets.registry import Target

__all__ = ["Flow", "Run"]


@dataclass
class Run:
    """One pass of annotate -> calibrate -> convert."""

    quantizer_report: QuantizerReport
    float_proto: onnx.ModelProto | None
    float_size: int
    chosen: list[Calibrated]
    converted: convert.Converted
    evened: Evened

    def section(self, options: Options) -> dict[str, Any]:
        """The report's sections on what this run did (annotation, evening, calibration, conversion)."""
        return {
            "quantizers": self.quantizer_report.to_json(),
            **transform.section(self.evened, options.smoothing, options.equalization),
            "calibrated": [c.as_dict() for c in self.chosen],
            **convert.section(self.converted, options.chosen_target, options.bias_correction, self.float_size),
        }


@dataclass
class Flow:
    """What every run of one quantization shares: the user's model (each run loads it anew: evening
    changes a model in place), the options, the calibration samples, the statistics measured so far,
    the calibration method (``auto``'s choice, once made) and whether biases are corrected (``auto``'s
    check may find the correction harmful)."""

    source: Any
    options: Options
    samples: Samples
    cache: StatisticsCache = field(default_factory=StatisticsCache)
    method: str | None = None
    correcting: bool = True
    kept_float: list[str] = field(default_factory=list)  # nodes a stage keeps float in every later run
    placed_float: list[str] = field(default_factory=list)  # groups of int8 ops kept float (as placement does)

    def __post_init__(self) -> None:
        self.method = self.options.method
        self.correcting = self.options.bias_correction

    @property
    def target(self) -> Target:
        return self.options.chosen_target  # type: ignore[no-any-return]

    def evening(self, outputs: Kept | None = None) -> Evening | None:
        """How the float model is evened out, its channel ranges measured once for every run."""
        options = self.options
        return Evening.of(options.smoothing, options.equalization, self.samples, options.progress,
                          self.cache.channels, outputs)  # fmt: skip

    def prepare(self, quantizer: Quantizer, keep_float: bool | None, outputs: Kept | None = None) -> Prepared:
        """Load, even out, annotate and place (:func:`requant.stages.annotate.prepare`)."""
        options = self.options
        return prepare(self.source, quantizer, self.target, options.strict, keep_float, self.evening(outputs),
                       options.load_options, self.samples)  # fmt: skip

    @in_stage("calibration and conversion")
    def run(self, quantizer: Quantizer, method: str | None, first: Run | None = None,
            prepared: Prepared | None = None) -> Run:  # fmt: skip
        """Annotate, calibrate with ``method`` and convert; ``first``: an earlier run of the same model,
        whose float model is reused; ``prepared``: the model already prepared (with its float model)."""
        keep = self.options.keeps_float_model() if first is None else None
        prepared = prepared or self.prepare(quantizer, keep)
        float_proto, float_size = (first.float_proto, first.float_size) if first is not None else prepared.float_model  # type: ignore[misc]
        progress = self.options.progress
        chosen = calibrate(prepared.model, self.samples, method, progress or terminal_progress(), self.cache)
        converted = convert.convert(prepared.model, self.target, self.kernel_data,
                                    progress=progress or terminal_progress("measuring kernels"),
                                    correct=self.correcting)  # fmt: skip
        return Run(prepared.report, float_proto, float_size, chosen, converted, prepared.evened)

    def again(self, first: Run, floats: list[str], placed: list[str] | None = None) -> Run:
        """A run like ``first`` with the nodes ``floats`` kept float, the ops of ``placed`` too (asking
        nothing of their ports, as placement keeps a group), and those an earlier stage kept."""
        quantizer = self.options.quantizer.with_float_nodes([*self.kept_float, *floats])
        groups = [*self.placed_float, *(placed or [])]
        if groups:
            quantizer = quantizer.with_float_nodes(groups, FLOAT_PLACED)
        return self.run(quantizer, self.method, first)

    @property
    def kernel_data(self) -> Samples | None:
        """The samples each int8 kernel is measured on against float, when they are measured."""
        return self.samples if self.options.measures_kernels else None
