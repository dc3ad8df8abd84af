"""A detector's outputs judged as its users count them (issue 52): YOLO heads recognized from float's values,
detections decoded with NMS, float's matched in int8's; the alarm follows the detections, not the cells."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from requant.report.detections import CONFIDENCE, heads, judge, poor
from requant.report.outputs import compare_outputs, poor_parts
from requant.targets.bins import in_bin_expectation, kept_float


def _head(objects: list[tuple[float, float, float, float, int]], classes: int = 3, anchors: int = 400,
          seed: int = 0, crowd: int = 6) -> np.ndarray:  # fmt: skip
    """A ``[1, 4 + classes, anchors]`` head: each object ``(x, y, w, h, class)`` held by ``crowd`` anchors (the
    best scoring 0.9, its neighbours 0.26 with boxes up to 2.5 px off: NMS folds them into the best one),
    every other anchor a small box scoring at most 0.1."""
    rng = np.random.default_rng(seed)
    out = np.zeros((1, 4 + classes, anchors), np.float32)
    out[0, :4] = rng.uniform(20, 40, (4, anchors))
    out[0, 4:] = rng.uniform(0, 0.1, (classes, anchors))
    for k, (x, y, w, h, c) in enumerate(objects):
        for j in range(crowd):
            a = k * crowd + j
            out[0, :4, a] = [x + j / 2, y - j / 2, w, h]
            out[0, 4 + c, a] = 0.9 if j == 0 else 0.26
    return out


OBJECTS = [(100.0 + 60 * i, 80.0 + 37 * (i % 3), 40.0, 60.0, i % 3) for i in range(6)]


def test_heads_are_found_joined_split_transposed_and_with_mask_coefficients() -> None:
    joined = _head(OBJECTS)
    masks = np.concatenate([joined, np.random.default_rng(1).normal(size=(1, 32, 400)).astype(np.float32)], 1)
    proto = np.zeros((1, 32, 40, 40), np.float32)
    (h,) = heads(["y"], [[joined]])
    assert (h.boxes, h.scores, h.first, h.classes, h.transposed) == (0, 0, 4, 3, False)
    (h,) = heads(["y", "protos"], [[masks, proto]])  # segmentation: the coefficients are no classes
    assert h.classes == 3 and h.names == ("y",)
    (h,) = heads(["t"], [[joined.transpose(0, 2, 1)]])
    assert h.transposed and h.classes == 3
    (h,) = heads(["boxes", "scores"], [[joined[:, :4], joined[:, 4:]]])
    assert (h.boxes, h.scores, h.first, h.classes) == (0, 1, 0, 3) and h.names == ("boxes", "scores")
    logits, probabilities = np.zeros((1, 1000), np.float32), np.full((1, 10, 10), 0.5, np.float32)
    assert heads(["logits", "map", "protos"], [[logits, probabilities, proto]]) == []
    # a text recognizer's per-position probabilities ([1, 40 positions, 500 characters], a softmax each): every
    # row within [0, 1], as a head's scores are, but no boxes in pixels (PP-OCR's was taken for 36 classes)
    positions = np.random.default_rng(2).normal(size=(1, 40, 500))
    softmax = (np.exp(positions) / np.exp(positions).sum(-1, keepdims=True)).astype(np.float32)
    assert heads(["ctc"], [[softmax]]) == [] and heads(["ctc", "y"], [[softmax, joined]])[0].names == ("y",)


def test_judge_counts_detections_after_nms_and_the_boxes_shift() -> None:
    f = _head(OBJECTS)
    (h,) = heads(["y"], [[f]])
    same = judge(h, [[f]], [[f.copy()]])
    assert same["float_detections"] == 6 and same["recall"] == same["precision"] == 1.0 and same["shift_px"] == 0
    moved = f.copy()
    moved[0, 0] += 2.0  # every centre 2 px to the right: two of each box's four corners move 2 px
    shifted = judge(h, [[f]], [[moved]])
    assert shifted["recall"] == 1.0 and shifted["shift_px"] == pytest.approx(1.0)
    lost = f.copy()
    lost[0, 4:, :6] = 0.0  # the first object's anchors all under the confidence
    other = f.copy()
    other[0, 4:6, 6:12] = f[0, 4:6, 6:12][::-1]  # the second object read as another class
    worse = judge(h, [[f]], [[lost]])
    assert worse["recall"] == pytest.approx(5 / 6, abs=1e-4) and worse["precision"] == 1.0
    assert judge(h, [[f]], [[other]])["recall"] == pytest.approx(5 / 6, abs=1e-4)


def test_cells_crossing_the_threshold_are_no_alarm_when_the_detections_are_kept() -> None:
    """Every crowd anchor at 0.26 drops to 0.24 in int8: 5 of 6 decisions per object change (the cells' rule
    called that poor), but NMS kept only the best anchor of each crowd in float: the user sees the same
    detections, and no alarm fires. Losing every detection does fire it."""
    samples = [_head(OBJECTS, seed=s) for s in range(4)]
    ints = [s.copy() for s in samples]
    for q in ints:
        q[0, 4:][np.isclose(q[0, 4:], 0.26)] = CONFIDENCE - 0.01
    names, floats, quantized = ["y"], [[s] for s in samples], [[q] for q in ints]
    split = {"y": (1, [("boxes", 4), ("scores", 3)])}
    parts = compare_outputs(names, floats, quantized, split)
    scores = next(p for p in parts if p.get("joins") == "scores")
    assert scores["flipped"] > 0.8 and poor_parts([scores])  # the cells' rule alone: an alarm
    (h,) = heads(names, floats)
    judged = judge(h, floats, quantized)
    assert judged["float_detections"] == 24 and judged["recall"] == judged["precision"] == 1.0
    assert not poor(judged)
    for p in parts:
        p["judged_by"] = "detections"
    assert poor_parts([*parts, judged]) == []
    gone = [[np.where(np.arange(7)[None, :, None] >= 4, 0.0, q)] for q in ints]
    lost = judge(h, floats, gone)
    assert lost["recall"] == 0.0 and poor_parts([*parts, lost]) == [lost]


def _decode(ramp: np.ndarray) -> ir.Model:
    """YOLOv8's DFL as Ultralytics exports it: the box logits' Conv (64 channels: 4 sides x 16 bins), Reshape to
    [1, 4, 16, N], Transpose to [1, 16, 4, N], Softmax over the bins, a 1x1 Conv weighted by ``ramp``; beside it
    a classifier's Softmax read by a plain Conv."""
    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array(rng.normal(size=(64, 8, 1, 1)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([1, 4, 16, 100], np.int64), "shape"),
            numpy_helper.from_array(ramp.astype(np.float32).reshape(1, 16, 1, 1), "ramp"),
            numpy_helper.from_array(rng.normal(size=(16, 8, 1, 1)).astype(np.float32), "wc")]  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "w"], ["logits"], name="box_conv"),
             helper.make_node("Reshape", ["logits", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3], name="transpose"),
             helper.make_node("Softmax", ["t"], ["p"], axis=1, name="softmax"),
             helper.make_node("Conv", ["p", "ramp"], ["d"], name="dfl_conv"),
             helper.make_node("Conv", ["x", "wc"], ["c"], name="class_conv"),
             helper.make_node("Softmax", ["c"], ["q"], axis=1, name="class_softmax")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("q", TensorProto.FLOAT, None)], init)  # fmt: skip
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_box_decode_by_bins_is_found_and_a_classifiers_softmax_is_not() -> None:
    model = _decode(np.arange(16))
    found = {str(n.name): in_bin_expectation(n) for n in model.graph}
    assert [name for name, hit in found.items() if hit] == ["box_conv", "softmax", "dfl_conv"]
    assert {str(n.name): kept_float(n) for n in model.graph}["box_conv"] is None  # its input is read by another
    other = _decode(np.arange(16)[::-1])  # not an expectation by the bins' index
    assert not any(in_bin_expectation(n) for n in other.graph)


def test_an_oriented_boxs_angle_is_judged_on_the_matched_boxes_not_over_every_anchor() -> None:
    """An OBB head (Ultralytics': one angle row after the classes, ``(sigmoid - 1/4) pi``): the angle of anchors
    nobody sees may be anything in int8 without an alarm; the matched boxes' angles are compared modulo 180
    degrees, and turned by more than ``POOR_ANGLE_DEG`` on average they make the head poor."""
    from requant.report.detections import POOR_ANGLE_DEG, describe

    rng = np.random.default_rng(3)
    boxes = _head(OBJECTS)
    angles = rng.uniform(-np.pi / 4, 3 * np.pi / 4, (1, 1, 400)).astype(np.float32)
    f = np.concatenate([boxes, angles], 1)
    (h,) = heads(["y"], [[f]])
    assert h.angle == 7 and h.classes == 3  # rows 4-6 the classes, row 7 the angle
    background = f.copy()
    background[0, 7, 36:] = rng.uniform(-np.pi / 4, 3 * np.pi / 4, 364)  # the anchors holding no object
    kept = judge(h, [[f]], [[background]])
    assert kept["recall"] == kept["precision"] == 1.0 and kept["angle_deg"] == 0.0 and not poor(kept)
    turned = f.copy()
    turned[0, 7] += np.radians(15)  # every box turned 15 degrees
    judged = judge(h, [[f]], [[turned]])
    assert judged["angle_deg"] == pytest.approx(15.0, abs=0.01) and judged["angle_deg"] > POOR_ANGLE_DEG
    assert poor({**judged, "float_detections": 10})  # (6 objects: too few to alarm on their own)
    assert describe(judged).endswith("turned 15.0 degrees")
    wrapped = f.copy()
    wrapped[0, 7] = np.where(f[0, 7] > np.pi / 4, f[0, 7] - np.pi, f[0, 7] + np.pi)  # the same box, half a turn on
    assert judge(h, [[f]], [[wrapped]])["angle_deg"] == pytest.approx(0.0, abs=1e-3)
    (plain,) = heads(["y"], [[boxes]])
    assert plain.angle is None and "angle_deg" not in judge(plain, [[boxes]], [[boxes]])
