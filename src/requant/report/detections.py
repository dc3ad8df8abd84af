"""A detector's outputs judged as its users count them: detections after decoding and NMS, float's against int8's.

A YOLO head (Ultralytics' YOLOv8 and YOLO11: detection, segmentation, oriented boxes) writes one
``[B, 4 + C (+ extra), N]`` output: for each of N anchors a box (centre x, centre y, width, height, in
the input's pixels), C class probabilities in [0, 1], then mask coefficients (segmentation) or an
angle (oriented boxes). Some exports split it into a ``[B, 4, N]`` boxes output and a ``[B, C, N]``
scores output, and some write it transposed, ``[B, N, 4 + C]``. Counting the cells whose score crosses
0.25 says nothing a user sees: thousands of cells near one object cross together, NMS keeps one of
them, and a cell just under the threshold beside one just over it is the same detection.

:func:`heads` recognizes such outputs from their float values (the 4 box rows, then the longest run of
rows that stay in [0, 1] on every sample: the classes). :func:`judge` decodes each sample as
Ultralytics' ``predict`` does (a detection is an anchor whose best class scores at least
``CONFIDENCE``; class-aware NMS at IoU ``NMS_IOU``; at most ``MAX_DETECTIONS``), in float and in int8,
and matches them (same class, IoU at least ``MATCH_IOU``, greedily from float's most confident):
*recall* is the share of float's detections the int8 model finds, *precision* the share of the int8
model's that float has, *shift* the mean distance of a matched box's corners from float's (pixels),
*iou* the matched boxes' mean IoU. Oriented boxes are matched as their axis-aligned ``xywh``; their angle (the one
row after the classes of a head whose values there stay within Ultralytics' ``(sigmoid - 1/4) pi``) is judged on
the matched boxes: *angle_deg*, the mean of their angles' distance from float's (modulo 180 degrees), not over
every anchor (an anchor nobody sees has an angle too: tau-fibrils-yolo's read 7.6 dB on photo crops).

A head is poor when float makes at least ``MIN_DETECTIONS`` detections on the samples and recall or
precision is below ``POOR_SHARE``, or the matched boxes' mean IoU is below ``POOR_IOU`` (corners moved
a tenth of the box's size: a box a user sees in the wrong place), or the matched oriented boxes turned by more
than ``POOR_ANGLE_DEG`` on average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ANGLES", "CONFIDENCE", "MATCH_IOU", "MIN_DETECTIONS", "POOR_ANGLE_DEG", "POOR_IOU", "POOR_SHARE", "Head",
    "anchored", "describe", "heads",
    "judge", "poor",
]  # fmt: skip

Array = npt.NDArray[Any]

CONFIDENCE = 0.25  # Ultralytics' predict default
NMS_IOU = 0.7  # Ultralytics' predict default
MAX_DETECTIONS = 300  # Ultralytics' predict default
MATCH_IOU = 0.5  # a float detection found again: same class, at least this IoU
MIN_DETECTIONS = 10  # fewer float detections on the samples: their shares say too little
POOR_SHARE = 0.8  # recall or precision below this: a user misses or gets one detection in five
POOR_IOU = 0.8  # matched boxes' mean IoU below this: boxes visibly elsewhere
POOR_ANGLE_DEG = 10.0  # matched oriented boxes turned by more than this on average: visibly turned
ANGLES = (-np.pi / 4, 3 * np.pi / 4)  # an Ultralytics OBB head's angle row: (sigmoid - 1/4) pi


@dataclass(frozen=True)
class Head:
    """A detection head: ``boxes`` is the output (index) holding the 4 box rows, ``scores`` the one holding
    the classes, ``first`` the classes' first row there and ``classes`` their count; ``transposed``
    when the outputs are ``[B, N, rows]``."""

    boxes: int
    scores: int
    first: int
    classes: int
    transposed: bool
    names: tuple[str, ...]
    angle: int | None = None  # an oriented box's angle row in the boxes' output, if any


def _rows(array: Any, transposed: bool) -> Array:
    """A ``[B, rows, N]`` view of a rank-3 output (``[B, N, rows]`` when transposed)."""
    a = np.asarray(array)
    return a.transpose(0, 2, 1) if transposed else a


def _score_run(rows: Array, start: int) -> int:
    """How many rows from ``start`` stay within [0, 1] (each row over all samples and anchors)."""
    low, high = rows.min(axis=(0, 2)), rows.max(axis=(0, 2))
    count = 0
    while start + count < len(low) and low[start + count] >= 0 and high[start + count] <= 1:
        count += 1
    return count


def _boxes(rows: Array) -> bool:
    """Whether the first 4 rows are boxes in pixels: widths and heights never negative, and not all within
    [0, 1] (a recognizer's per-position probabilities, ``[1, 40, 18710]``, are not a head of 36 classes)."""
    return bool((rows[:, 2:4] >= 0).all() and rows[:, :4].max() > 1)


def anchored(shape: tuple[int, ...]) -> bool | None:
    """For a ``[B, K, N]`` shape with many more anchors than rows: whether it is transposed (``[B, N, K]``);
    None for a shape no head has."""
    if len(shape) != 3 or min(shape[1:]) < 1:
        return None
    rows, anchors = sorted(shape[1:])
    if anchors < 8 * rows or anchors < 64:
        return None
    return shape[1] > shape[2]


def heads(names: Sequence[str], floats: Sequence[Sequence[Any]]) -> list[Head]:
    """The detection heads among the outputs, from float's outputs on the samples (``floats[s][o]``); a head
    has one shape on every sample."""
    if not floats:
        return []
    found: list[Head] = []
    shapes = [{np.shape(s[o]) for s in floats} for o in range(len(names))]
    layouts = {o: anchored(next(iter(sizes))) if len(sizes) == 1 else None for o, sizes in enumerate(shapes)}
    stacked = {o: np.concatenate([_rows(s[o], t) for s in floats]) for o, t in layouts.items() if t is not None}
    for o, rows in stacked.items():
        t = bool(layouts[o])
        if rows.shape[1] >= 5 and _boxes(rows) and (count := _score_run(rows, 4)):
            found.append(Head(o, o, 4, count, t, (names[o],), _angle(rows, 4 + count)))
    boxes = [o for o, rows in stacked.items() if rows.shape[1] == 4 and _boxes(rows)]
    for b in boxes:
        for o, rows in stacked.items():
            same = rows.shape[2] == stacked[b].shape[2] and layouts[o] == layouts[b]
            if o != b and same and (count := _score_run(rows, 0)) == rows.shape[1]:
                found.append(Head(b, o, 0, count, bool(layouts[b]), (names[b], names[o])))
                break
    return found


def _angle(rows: Array, row: int) -> int | None:
    """``row`` when it is the last row and its values stay within :data:`ANGLES` (an oriented box's angle)."""
    if rows.shape[1] != row + 1:
        return None
    values = rows[:, row]
    return row if bool(values.min() >= ANGLES[0] - 1e-3 and values.max() <= ANGLES[1] + 1e-3) else None


def _xyxy(xywh: Array) -> Array:
    x, y, w, h = xywh
    return np.stack([x - w / 2, y - h / 2, x + w / 2, y + h / 2], axis=1)


def _iou(box: Array, others: Array) -> Array:
    """IoU of one ``xyxy`` box with each of ``others``."""
    lo, hi = np.maximum(box[:2], others[:, :2]), np.minimum(box[2:], others[:, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    area = np.prod(box[2:] - box[:2]) + np.prod(others[:, 2:] - others[:, :2], axis=1)
    return inter / np.maximum(area - inter, 1e-9)  # type: ignore[no-any-return]


def detect(boxes: Array, scores: Array) -> tuple[Array, Array, Array, Array]:
    """One sample's detections (``xyxy`` boxes, classes, confidences, anchors), most confident first: ``boxes``
    ``[4, N]``, ``scores`` ``[C, N]``, decoded as Ultralytics' ``predict`` does."""
    classes, confidence = scores.argmax(0), scores.max(0)
    chosen = np.flatnonzero(confidence >= CONFIDENCE)
    chosen = chosen[np.argsort(-confidence[chosen], kind="stable")]
    corners = _xyxy(boxes[:, chosen].astype(np.float64))
    kept: list[int] = []
    for i in range(len(chosen)):
        if len(kept) >= MAX_DETECTIONS:
            break
        rivals = [k for k in kept if classes[chosen[k]] == classes[chosen[i]]]
        if not rivals or _iou(corners[i], corners[rivals]).max() <= NMS_IOU:
            kept.append(i)
    return corners[kept], classes[chosen[kept]], confidence[chosen[kept]], chosen[kept]


def _match(f: tuple[Array, ...], q: tuple[Array, ...]) -> list[tuple[int, int, float]]:
    """Float's detections found again in int8's: (float's index, int8's index, IoU)."""
    free = np.ones(len(q[0]), bool)
    pairs = []
    for i in range(len(f[0])):
        candidates = np.flatnonzero(free & (q[1] == f[1][i]))
        if not len(candidates):
            continue
        ious = _iou(f[0][i], q[0][candidates])
        best = int(ious.argmax())
        if ious[best] >= MATCH_IOU:
            free[candidates[best]] = False
            pairs.append((i, int(candidates[best]), float(ious[best])))
    return pairs


def _split(head: Head, sample: Sequence[Any], row: int) -> tuple[Array, Array]:
    """Batch row ``row`` of a sample's outputs: its ``[4, N]`` boxes and ``[C, N]`` class scores."""
    boxes = _rows(sample[head.boxes], head.transposed)[row, :4]
    scores = _rows(sample[head.scores], head.transposed)[row, head.first : head.first + head.classes]
    return boxes, scores


def judge(head: Head, floats: Sequence[Sequence[Any]], ints: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The head's detections, float's against int8's, over the samples (every batch row of each)."""
    found = made = matched = 0
    shifts: list[float] = []
    ious: list[float] = []
    turns: list[float] = []
    for f_sample, q_sample in zip(floats, ints, strict=True):
        for row in range(np.shape(f_sample[head.boxes])[0]):
            f, q = detect(*_split(head, f_sample, row)), detect(*_split(head, q_sample, row))
            pairs = _match(f, q)
            found, made, matched = found + len(f[0]), made + len(q[0]), matched + len(pairs)
            shifts += [float(np.abs(f[0][i] - q[0][j]).mean()) for i, j, _ in pairs]
            ious += [iou for _, _, iou in pairs]
            if head.angle is not None:
                turns += _turns(head, f_sample, q_sample, row, f, q, pairs)
    angle = {"angle_deg": round(float(np.mean(turns)), 2) if turns else 0.0} if head.angle is not None else {}
    return {
        "output": " + ".join(head.names), "outputs": list(head.names), "part": "detections", "classes": head.classes,
        "float_detections": found, "int8_detections": made,
        "recall": round(matched / found, 4) if found else 1.0,
        "precision": round(matched / made, 4) if made else 1.0,
        "shift_px": round(float(np.mean(shifts)), 3) if shifts else 0.0,
        "iou": round(float(np.mean(ious)), 4) if ious else 1.0, **angle,
    }  # fmt: skip


def _turns(head: Head, f_sample: Sequence[Any], q_sample: Sequence[Any], row: int, f: tuple[Array, ...],
           q: tuple[Array, ...], pairs: list[tuple[int, int, float]]) -> list[float]:  # fmt: skip
    """The matched oriented boxes' angle distances from float's, in degrees (modulo 180)."""
    angles = [_rows(s[head.boxes], head.transposed)[row, head.angle] for s in (f_sample, q_sample)]
    turned = []
    for i, j, _ in pairs:
        d = abs(float(angles[0][f[3][i]]) - float(angles[1][q[3][j]])) % np.pi
        turned.append(float(np.degrees(min(d, np.pi - d))))
    return turned


def poor(part: Mapping[str, Any]) -> bool:
    """Whether a head's detections are far from float's (see the module's docstring)."""
    if part["float_detections"] < MIN_DETECTIONS:
        return False
    turned = part.get("angle_deg", 0.0) > POOR_ANGLE_DEG
    return bool(min(part["recall"], part["precision"]) < POOR_SHARE or part["iou"] < POOR_IOU or turned)


def describe(part: Mapping[str, Any]) -> str:
    """A head's figures in words."""
    found, what = part["float_detections"], f"output '{part['output']}' (a detector's, decoded with NMS)"
    if not found:
        return f"{what}: no detections in float on the samples checked (scores >= {CONFIDENCE:g})"
    return (f"{what}: {part['recall']:.0%} of float's {found} detections found (same class, IoU >= {MATCH_IOU:g}), "
            f"{part['precision']:.0%} of int8's {part['int8_detections']} are float's; boxes {part['shift_px']:.2f} px "
            f"from float's (mean corner shift; IoU {part['iou']:.3f})"
            + (f", turned {part['angle_deg']:.1f} degrees" if "angle_deg" in part else ""))  # fmt: skip
