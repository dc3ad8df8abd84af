"""Stage transform: the float model evened out for int8 before it is annotated.

SmoothQuant moves a linear layer's outlier input channels into its weights
(:mod:`requant.transforms.smoothing`); equalization scales a depthwise convolution's small input
channels up against the convolution before it (:mod:`requant.transforms.equalization`). Both change
the float model in place, measuring channel ranges on the calibration samples (kept in the run's
statistics cache, so a second run measures nothing again). Bias correction, the other transform,
needs the QDQ model: it runs in :mod:`requant.stages.convert`.

Reads: the loaded model, the samples, ``smoothing`` and ``equalization``. Adds: the evened model, and
smoothing's float ``Mul`` nodes to the quantizer's float nodes where the target runs them in float.
Records: ``smoothing`` and ``equalization``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from requant.calibration.runner import Kept, Progress, terminal_progress
from requant.quantizers import Quantizer
from requant.targets.registry import Target
from requant.transforms.equalization import MAX_SCALE, Equalization, equalize_depthwise, unless_per_channel
from requant.transforms.smoothing import Smoothing, smooth_linears

__all__ = ["OFF", "Evened", "Evening", "even_out", "lines", "section", "smoothing_section", "undo_per_tensor"]


@dataclass
class Evening:
    """How to even out channels before quantizing, over ``data``: smooth linear layers with ``alpha``
    (None: not), equalize depthwise convs' inputs (``equalize``); ``ranges``: channel ranges already
    measured; ``outputs``: where equalization's probe keeps the float model's first output."""

    alpha: float | None
    data: Any
    progress: Progress | None
    ranges: dict[str, Any]
    equalize: bool = False
    outputs: Kept | None = None

    @staticmethod
    def of(alpha: float | None, equalize: bool, data: Any, progress: Progress | None, ranges: dict[str, Any],
           outputs: Kept | None = None) -> Evening | None:  # fmt: skip
        """The evening asked for, or None when neither is."""
        return Evening(alpha or None, data, progress, ranges, equalize, outputs) if alpha or equalize else None


@dataclass(frozen=True)
class Evened:
    """What smoothing and equalization did to the float model before it was annotated."""

    smoothing: Smoothing
    equalization: Equalization


OFF = Smoothing([], [], "off")
NOTHING = Evened(OFF, Equalization([], "off"))


def even_out(
    model: ir.Model, evening: Evening | None, quantizer: Quantizer, target: Target
) -> tuple[Quantizer, Evened]:
    """``model`` evened out in place; the quantizer with smoothing's ``Mul`` nodes kept float where the
    target runs them in float (an integer-only target rescales per channel there instead)."""
    if evening is None:
        return quantizer, NOTHING
    smoothed, equalized = NOTHING.smoothing, NOTHING.equalization
    progress = evening.progress or terminal_progress("measuring channels")
    if evening.alpha:
        smoothed = smooth_linears(model, evening.data, evening.alpha, progress, evening.ranges)
        if not target.integer_only:  # integer-only: there a Mul by a positive constant is a per-channel rescale
            quantizer = quantizer.with_float_nodes(smoothed.muls)  # each scales its input per channel: kept float
    if evening.equalize:
        equalized = equalize_depthwise(model, evening.data, progress, evening.ranges, outputs=evening.outputs)
    return quantizer, Evened(smoothed, equalized)


def undo_per_tensor(evened: Evened) -> Evened:
    """``evened`` once the model is annotated: equalization undone where a weight is quantized per tensor
    (it cannot absorb a factor per channel; :func:`~requant.transforms.equalization.unless_per_channel`)."""
    return Evened(evened.smoothing, unless_per_channel(evened.equalization))


def smoothing_section(smoothing: Smoothing, alpha: float | None) -> dict[str, Any]:
    """The report's ``smoothing`` (both paths: :mod:`requant.pt2e.smooth` records the same)."""
    inputs = [r.__dict__ for r in smoothing.inputs]
    return {"smoothing": {"alpha": alpha or None, "not_applied": smoothing.not_applied, "inputs": inputs}}


def section(evened: Evened, alpha: float | None, equalization: bool) -> dict[str, Any]:
    """The report's ``smoothing`` and ``equalization``."""
    equalized = evened.equalization
    return {
        **smoothing_section(evened.smoothing, alpha),
        "equalization": {
            "enabled": equalization,
            "max_scale": MAX_SCALE,
            "not_applied": equalized.not_applied,
            "chains": [r.__dict__ for r in equalized.chains],
        },
    }


def lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's lines on smoothing and equalization."""
    out = []
    smoothed = [r for r in report.get("smoothing", {}).get("inputs", []) if r["applied"]]
    if smoothed:
        folded = sum(1 for r in smoothed if r["applied"].startswith("folded"))
        widest = max(smoothed, key=lambda r: r["spread_before"])
        out.append(
            f"smoothing (alpha {report['smoothing']['alpha']:g}): {len(smoothed)} linear-layer inputs "
            f"({folded} folded into their normalization, {len(smoothed) - folded} by a float Mul); widest "
            f"'{widest['input']}': largest channel {widest['spread_before']:.1f}x the median -> "
            f"{widest['spread_after']:.1f}x"
        )
    evened = [r for r in report.get("equalization", {}).get("chains", []) if not r["skipped"]]
    if evened:
        widest = max(evened, key=lambda r: r["spread_before"])
        out.append(
            f"equalization: {len(evened)} depthwise convs' inputs, {sum(r['scaled'] for r in evened)} channels scaled "
            f"up (at most {max(r['largest_factor'] for r in evened):.1f}x); widest '{widest['input']}': largest "
            f"channel {widest['spread_before']:.1f}x the median -> {widest['spread_after']:.1f}x"
        )
    return out
