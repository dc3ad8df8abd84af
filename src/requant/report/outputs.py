"""Every output of a quantized model against the float model's, part by part.

An output can join values of different kinds: a YOLO-style detector's ``[1, 4 + C, N]`` is a Concat of
box coordinates in pixels and class probabilities in [0, 1]. Its SQNR is the pixels' (their energy is
thousands of times the scores'), so an int8 model whose scores all flip reads 48 dB. An output a
Concat joins is split into the Concat's inputs; each part is *scores* when its float values all lie in
[0, 1] on the samples, else *values*; each gets its SQNR, and a score part the share of its decisions
(a score at or above ``DECISION``) that the int8 model changes.

A part is *poor* when its SQNR is below ``POOR_DB`` or, for scores with at least ``MIN_DECISIONS``
decisions, more than ``POOR_FLIPS`` of them change. The floors are set below what requant's outputs
of the bench's models measure (MobileNetV2's logits 22 dB, PP-OCRv4's detector's probability map 12.4
dB with text IoU 0.93, its recognizer's 14.5 dB reading text as well as float; a classifier's softmax
changing 9 % of its top decisions is still a working model) and above what a broken one measures (a
detector head whose scores share the pixels' type: 99 % of decisions changed).

A detector's head (:mod:`requant.report.detections` recognizes YOLO's layouts) is judged by what its users
count instead: its detections decoded with NMS, float's against int8's. Its box and score parts keep their
figures (``judged_by: detections``) but the cells crossing a threshold are not the alarm: on Ultralytics'
YOLOv8n that counted 40 % of cells changed where every detection after NMS was kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.report import detections
from requant.report.agreement import overlap

__all__ = ["DECISION", "MIN_DECISIONS", "POOR_DB", "POOR_FLIPS", "compare_outputs", "poor_parts", "sqnr"]

Array = npt.NDArray[Any]

POOR_DB = 10.0  # a part's SQNR below this: its noise is a third of its signal's amplitude
DECISION = 0.25  # a score at or above this is a decision (a YOLO detector's default confidence)
POOR_FLIPS = 0.2  # more than this share of a score part's decisions changed: poor
MIN_DECISIONS = 20  # fewer decisions in float on the samples: their share says too little


def sqnr(f: Array, q: Array) -> float:
    """The SQNR of ``q`` against ``f`` (dB; inf when they are equal)."""
    f64, q64 = f.astype(np.float64), q.astype(np.float64)
    noise = float(np.sum((f64 - q64) ** 2))
    return float(10 * np.log10(float(np.sum(f64**2)) / noise)) if noise > 0 else float("inf")


Split = tuple[int, list[tuple[str, int]]]  # an output a Concat joins along this axis, from (input, size)


def _cuts(shape: tuple[int, ...], split: Split | None) -> list[tuple[str, tuple[Any, ...]]]:
    """The parts of an output of ``shape`` as (the joined input's name, an index): itself when no Concat
    joins it, else the Concat's inputs along its axis."""
    if split is None:
        return [("", ())]
    axis, inputs = split
    axis %= len(shape)
    cuts, start = [], 0
    for name, size in inputs:
        index: list[Any] = [slice(None)] * len(shape)
        index[axis] = slice(start, start + size)
        cuts.append((name, tuple(index)))
        start += size
    return cuts


def compare_outputs(
    names: Sequence[str], floats: Sequence[Sequence[Array]], ints: Sequence[Sequence[Array]],
    splits: Mapping[str, Split],
) -> list[dict[str, Any]]:  # fmt: skip
    """Each output's parts against float: ``floats[s][o]`` and ``ints[s][o]`` are sample ``s``'s output
    ``o``; ``splits``: the outputs a Concat joins, and from what."""
    found = []
    for o, name in enumerate(names):
        pairs = [overlap(f[o], q[o]) for f, q in zip(floats, ints, strict=True)]  # the extent both computed
        reshaped = sum(np.shape(f[o]) != np.shape(q[o]) for f, q in zip(floats, ints, strict=True))
        for joined, index in _cuts(np.shape(floats[0][o]), splits.get(name)):
            pf = np.concatenate([f[index].reshape(-1) for f, _ in pairs])
            pq = np.concatenate([q[index].reshape(-1) for _, q in pairs])
            kind = "scores" if pf.size and np.isfinite(pf).all() and pf.min() >= 0 and pf.max() <= 1 else "values"
            part: dict[str, Any] = {"output": name, "part": kind, "sqnr_db": round(sqnr(pf, pq), 2)}
            if joined:
                part["joins"] = joined
            if reshaped:
                part["shapes_differ"] = reshaped
            if kind == "scores":
                df, dq = pf >= DECISION, pq >= DECISION
                decided = int(df.sum())
                part["decisions"] = decided
                part["kept"] = round(float((df & dq).sum() / max(decided, 1)), 4)
                part["flipped"] = round(float((df ^ dq).sum() / max(decided, 1)), 4)
            found.append(part)
    return found


def poor_parts(parts: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The parts far from float (see the module's docstring); a detection head's boxes and scores are judged
    by its decoded detections alone (:mod:`requant.report.detections`)."""
    return [p for p in parts if _poor(p)]


def _poor(part: Mapping[str, Any]) -> bool:
    if part["part"] == "detections":
        return detections.poor(part)
    if part.get("judged_by"):
        return False
    flips = part["part"] == "scores" and part["decisions"] >= MIN_DECISIONS and part["flipped"] > POOR_FLIPS
    return bool(part["sqnr_db"] < POOR_DB or flips)


def describe(part: Mapping[str, Any]) -> str:
    """One part's figures in words."""
    if part["part"] == "detections":
        return detections.describe(part)
    what = f"output '{part['output']}'" + (f" ('{part['joins']}', {part['part']})" if "joins" in part else "")
    if part.get("shapes_differ"):
        what += f" (its shape differs from float's in {part['shapes_differ']} samples: compared where both computed)"
    if part["part"] == "scores" and part.get("decisions"):
        return (f"{what}: {part['flipped']:.0%} of its {part['decisions']} decisions (scores >= {DECISION:g}) change, "
                f"{part['kept']:.0%} kept; SQNR {part['sqnr_db']:.1f} dB")  # fmt: skip
    return f"{what}: SQNR {part['sqnr_db']:.1f} dB"
