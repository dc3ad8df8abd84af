"""A YOLOv8-style detector, small: a conv backbone and a head whose output ``[1, 4 + C, N]`` concatenates
decoded boxes in pixels (``(offset + grid cell) * stride``, for a 320x320 image) with class probabilities
(a Sigmoid): the pattern whose scores an int8 type shared with the pixels turns to 0 or 1."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DECISION = 0.25  # a detection: a class score at or above this (YOLO's default confidence)


def make_detector(
    classes: int = 3, size: int = 64, image: int = 320, seed: int = 0, dfl: bool = False, split: bool = False
) -> onnx.ModelProto:
    """Random weights (seeded): about a third of the positions hold a score above ``DECISION`` on
    uniform noise images. ``dfl``: the boxes as YOLOv8 decodes them (each side's distance a Softmax over
    8 bins weighted by the bins' index, then ``(cell -+ distance) * stride``); ``split``: the joined head
    sliced into two outputs, ``boxes`` and ``scores`` (as exporters that split a head write it)."""
    rng = np.random.default_rng(seed)
    cells = size // 8  # three stride-2 convs
    count = cells * cells
    initializers: list[onnx.TensorProto] = []

    def constant(name: str, array: Any, dtype: Any = np.float32) -> str:
        initializers.append(numpy_helper.from_array(np.asarray(array, dtype), name))
        return name

    nodes, x, channels = [], "x", [3, 16, 32, 32]
    for i in range(3):
        weight = rng.normal(size=(channels[i + 1], channels[i], 3, 3)) * (2 / (9 * channels[i])) ** 0.5
        bias = rng.normal(size=channels[i + 1]) * 0.1
        nodes.append(helper.make_node("Conv", [x, constant(f"w{i}", weight), constant(f"b{i}", bias)], [f"c{i}"],
                                      strides=[2, 2], pads=[1, 1, 1, 1]))  # fmt: skip
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        x = f"r{i}"
    gy, gx = np.meshgrid(np.arange(cells), np.arange(cells), indexing="ij")
    if dfl:  # each side's distance in cells: the expectation of a Softmax over 8 bins
        bins = 8
        rng.normal(size=(4, 32, 1, 1))  # the plain head's draw: the class scores are the same in both
        box_weight = np.random.default_rng(seed + 1).normal(size=(4 * bins, 32, 1, 1)) * 0.3
        nodes.append(helper.make_node("Conv", [x, constant("wb", box_weight)], ["box_logits"]))
        shape = constant("bin_shape", [1, 4, bins, count], np.int64)
        nodes.append(helper.make_node("Reshape", ["box_logits", shape], ["bin_logits"]))
        nodes.append(helper.make_node("Softmax", ["bin_logits"], ["bin_probabilities"], axis=2))
        index = constant("bin_index", np.arange(bins).reshape(1, 1, bins, 1))
        nodes.append(helper.make_node("Mul", ["bin_probabilities", index], ["weighted"]))
        axes = constant("bin_axis", [2], np.int64)
        nodes.append(helper.make_node("ReduceSum", ["weighted", axes], ["distances"], keepdims=0))
        sign = constant("sides", np.array([-1, -1, 1, 1]).reshape(1, 4, 1))
        nodes.append(helper.make_node("Mul", ["distances", sign], ["signed"]))
        grid = np.stack([gx.ravel(), gy.ravel(), gx.ravel(), gy.ravel()])[None] + 0.5
        nodes.append(helper.make_node("Add", ["signed", constant("grid", grid)], ["in_cells"]))
    else:  # boxes: offsets in grid cells, decoded to pixels: (offset + cell) * stride
        box_weight, box_bias = rng.normal(size=(4, 32, 1, 1)) * 0.2, [0.5, 0.5, 2.0, 2.0]
        nodes.append(helper.make_node("Conv", [x, constant("wb", box_weight), constant("bb", box_bias)], ["offsets"]))
        nodes.append(helper.make_node("Reshape", ["offsets", constant("box_shape", [1, 4, count], np.int64)],
                                      ["flat"]))  # fmt: skip
        grid = np.stack([gx.ravel(), gy.ravel(), np.zeros(count), np.zeros(count)])[None]
        nodes.append(helper.make_node("Add", ["flat", constant("grid", grid)], ["in_cells"]))
    nodes.append(helper.make_node("Mul", ["in_cells", constant("stride", [image / cells])], ["boxes"]))
    # class probabilities
    class_weight, class_bias = rng.normal(size=(classes, 32, 1, 1)) * 0.5, [-3.0] * classes
    nodes.append(helper.make_node("Conv", [x, constant("wc", class_weight), constant("bc", class_bias)], ["logits"]))
    nodes.append(helper.make_node("Sigmoid", ["logits"], ["probabilities"]))
    nodes.append(helper.make_node("Reshape", ["probabilities", constant("class_shape", [1, classes, count], np.int64)],
                                  ["scores"]))  # fmt: skip
    nodes.append(helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4 + classes, count])]
    if split:
        for name, start, end in (("box_out", 0, 4), ("score_out", 4, 4 + classes)):
            ends = [constant(f"{name}_{k}", [v], np.int64) for k, v in (("start", start), ("end", end), ("axis", 1))]
            nodes.append(helper.make_node("Slice", ["y", *ends], [name]))
        outputs = [helper.make_tensor_value_info("box_out", TensorProto.FLOAT, [1, 4, count]),
                   helper.make_tensor_value_info("score_out", TensorProto.FLOAT, [1, classes, count])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])], outputs,
        initializers,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    return model


def noise_images(count: int, size: int = 64, seed: int = 1) -> list[dict[str, np.ndarray]]:
    images = np.random.default_rng(seed).uniform(0, 1, size=(count, 1, 3, size, size)).astype(np.float32)
    return [{"x": image} for image in images]


def detections(float_outputs: list[np.ndarray], int8_outputs: list[np.ndarray]) -> tuple[float, float]:
    """The share of float's detections (position and class at or above ``DECISION``) the int8 model keeps,
    and the mean shift of their boxes in pixels."""
    kept = found = 0
    shifts = []
    for f, q in zip(float_outputs, int8_outputs, strict=True):
        df, dq = f[0, 4:] >= DECISION, q[0, 4:] >= DECISION
        found, kept = found + int(df.sum()), kept + int((df & dq).sum())
        boxes = df.any(0)
        shifts.append(float(np.abs(f[0, :4, boxes] - q[0, :4, boxes]).mean()) if boxes.any() else 0.0)
    return kept / max(found, 1), float(np.mean(shifts))
