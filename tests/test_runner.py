"""The streaming runner: observed tensors only, flat memory, several passes within a memory budget."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from requant.calibration import MinMaxObserver
from requant.calibration.runner import collect
from requant.frontends import load_onnx_text

MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,4] X) => (float[N,4] Y) {
    A = Relu(X)
    B = Neg(A)
    Y = Mul(B, B)
}
"""


def samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"X": rng.standard_normal((2, 4)).astype(np.float32)} for _ in range(5)]


def expected(name: str) -> tuple[float, float]:
    xs = np.concatenate([s["X"] for s in samples()])
    values = {"X": xs, "A": np.maximum(xs, 0), "B": -np.maximum(xs, 0), "Y": np.maximum(xs, 0) ** 2}[name]
    return float(values.min()), float(values.max())


def _one_node(op: str, x_shape: list[int | str], constant: np.ndarray) -> Any:
    """``Y = op(X, constant)``: X float of ``x_shape``, the constant an initializer."""
    import onnx_ir as ir

    x = ir.Value(name="X", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(x_shape))
    c = ir.Value(name="C", const_value=ir.tensor(constant, name="C"))
    node = ir.node(op, [x, c], name=op.lower())
    node.outputs[0].name = "Y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[c], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def test_observers_see_exactly_their_tensors() -> None:
    model = load_onnx_text(MODEL)
    observers = {name: MinMaxObserver() for name in ("X", "A", "B", "Y")}
    assert collect(model, samples(), observers) == 5
    for name, observer in observers.items():
        assert (float(observer.lo), float(observer.hi)) == expected(name)  # type: ignore[arg-type]


def test_a_small_memory_budget_observes_in_several_passes_with_the_same_result() -> None:
    model = load_onnx_text(MODEL)
    observers = {name: MinMaxObserver() for name in ("X", "A", "B", "Y")}
    passes: list[int] = []
    collect(model, iter(samples()), observers, progress=lambda done, elapsed: passes.append(done), memory_budget=1)
    assert passes.count(5) == 4  # one pass per tensor (the one-shot iterator was kept for re-reading)
    for name, observer in observers.items():
        assert (float(observer.lo), float(observer.hi)) == expected(name)  # type: ignore[arg-type]


def test_observing_leaves_the_model_as_it_was() -> None:
    import onnx_ir as ir

    model = load_onnx_text(MODEL)
    before = ir.serde.serialize_model(model).SerializeToString()
    collect(model, samples(), {name: MinMaxObserver() for name in ("X", "A", "B", "Y")}, memory_budget=1)
    # the observed values were graph outputs while the session was built; onnx-ir 1.1's
    # `del outputs[i]` would have left them marked as outputs (the graph input "X" among them)
    assert ir.serde.serialize_model(model).SerializeToString() == before
    assert [v.is_graph_output() for v in (model.graph.inputs[0], *(n.outputs[0] for n in model.graph))] == [
        False, False, False, True
    ]  # fmt: skip


def test_a_large_model_is_observed_with_its_weights_mapped_not_copied() -> None:
    """A 256 MB weight: the session maps it from the temporary folder instead of copying it."""
    model = _one_node("MatMul", [1, 8192], np.full((8192, 8192), 1e-4, np.float32))

    observer = MinMaxObserver()
    seen: list[float] = []
    before = _rss_mb()
    collect(
        model, [{"X": np.ones((1, 8192), np.float32)}], {"Y": observer}, progress=lambda d, e: seen.append(_rss_mb())
    )
    assert abs(float(observer.hi) - 0.8192) < 1e-5  # type: ignore[arg-type]
    # loading from serialized bytes held the 256 MB weight two more times (the bytes, ONNX Runtime's copy)
    # measured: +256 MB (the mapped weight) against +512 MB when the session was built from bytes
    assert seen[0] - before < 384


class _Shapes(MinMaxObserver):
    """Min/max, and the shape of every update."""

    def __init__(self, batchable: bool = True) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.batchable = batchable

    def update(self, array: np.ndarray) -> None:
        self.shapes.append(array.shape)
        super().update(array)


def test_small_samples_of_one_shape_are_stacked_into_one_run() -> None:
    model = load_onnx_text(MODEL)
    observers = {name: _Shapes() for name in ("X", "Y")}
    assert collect(model, samples(), observers) == 5
    assert observers["Y"].shapes == [(10, 4)]  # five samples of two rows, one run
    for name, observer in observers.items():
        assert (float(observer.lo), float(observer.hi)) == expected(name)  # type: ignore[arg-type]


def test_an_observer_that_is_not_batchable_sees_one_update_per_sample() -> None:
    model = load_onnx_text(MODEL)
    observers = {"X": _Shapes(), "Y": _Shapes(batchable=False)}
    collect(model, samples(), observers)
    assert observers["Y"].shapes == [(2, 4)] * 5
    assert observers["X"].shapes == [(2, 4)] * 5  # the same runs feed every observer of the pass


def test_samples_are_stacked_only_with_samples_of_the_same_shape() -> None:
    model = load_onnx_text(MODEL.replace("float[N,4] X) => (float[N,4] Y)", "float[N,L] X) => (float[N,L] Y)"))
    rng = np.random.default_rng(1)
    data = [{"X": rng.standard_normal((1, length)).astype(np.float32)} for length in (3, 3, 5, 5, 5, 3)]
    observer = _Shapes()
    assert collect(model, data, {"Y": observer}) == 6
    assert observer.shapes == [(2, 3), (3, 5), (1, 3)]
    values = np.concatenate([np.maximum(s["X"], 0).reshape(-1) ** 2 for s in data])
    assert (float(observer.lo), float(observer.hi)) == (float(values.min()), float(values.max()))  # type: ignore[arg-type]


MIXING = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,4] X) => (float[N,4] Y) {
    axes = Constant<value: tensor = int64[1] {0}>()
    M = ReduceMean<keepdims: int = 1>(X, axes)
    Y = Sub(X, M)
}
"""
FIXED = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,4] X) => (float[2,4] Y) {
    shape = Constant<value: tensor = int64[2] {2, 4}>()
    Y = Reshape(X, shape)
}
"""


def test_a_model_that_mixes_the_samples_of_a_batch_is_calibrated_one_sample_per_run(caplog: Any) -> None:
    """Stacking would change the values (a mean over the batch): the first stacked run is checked
    against its first sample alone, and the model then runs one sample at a time."""
    model = load_onnx_text(MIXING)
    observer = _Shapes()
    with caplog.at_level(logging.INFO, logger="requant.calibration"):
        assert collect(model, samples(), {"Y": observer}) == 5
    assert "one sample per run" in caplog.text
    centred = [s["X"] - s["X"].mean(axis=0, keepdims=True) for s in samples()]
    values = np.concatenate(centred)
    assert observer.shapes == [(2, 4)] * 5  # the stacked run's values were not observed
    assert np.isclose(float(observer.lo), values.min()) and np.isclose(float(observer.hi), values.max())  # type: ignore[arg-type]


def test_a_model_that_cannot_take_a_stacked_batch_is_calibrated_one_sample_per_run() -> None:
    model = load_onnx_text(FIXED)
    observer = _Shapes()
    assert collect(model, samples(), {"Y": observer}) == 5
    assert observer.shapes == [(2, 4)] * 5
    xs = np.concatenate([s["X"] for s in samples()])
    assert (float(observer.lo), float(observer.hi)) == (float(xs.min()), float(xs.max()))  # type: ignore[arg-type]


def test_a_large_sample_s_tensors_are_dropped_after_they_are_observed() -> None:
    """A 32 MB observed tensor per sample runs one sample at a time, and no run's tensors outlive
    their observation (the first sample's results, run alone to size the stacks, once stayed
    alive through the whole loop: MobileNetV2 +50 MB peak)."""
    model = _one_node("Expand", ["N", 1], np.array([1, 1 << 23], np.int64))

    observer = _Shapes()
    seen: list[float] = []
    data = [{"X": np.full((1, 1), float(i), np.float32)} for i in range(6)]
    before = _rss_mb()
    collect(model, data, {"Y": observer}, progress=lambda d, e: seen.append(_rss_mb()))
    assert observer.shapes == [(1, 1 << 23)] * 6 and (float(observer.lo), float(observer.hi)) == (0.0, 5.0)  # type: ignore[arg-type]
    # measured: +41 MB (the session's 32 MB output buffer, the session); +74 MB when the loop held
    # the first sample's results
    assert max(seen) - before < 56, (before, seen)


CONV_RELU = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,16,12,12] X, float[16,16,3,3] W, float[16] B) => (float[N,16,12,12] Y) {
    C = Conv <pads = [1, 1, 1, 1]> (X, W, B)
    R = Relu(C)
    D = Conv <pads = [1, 1, 1, 1]> (R, W, B)
    Y = Relu(D)
}
"""


def test_every_onnx_runtime_rewrite_keeps_the_observed_values() -> None:
    """``optimize=True`` (calibration's): ONNX Runtime fuses Conv+Relu and runs convs in NCHWc, but a
    value asked for as an output is still computed; its extremes are numpy's up to float sums' order."""
    import onnx
    import onnx_ir as ir

    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.2
    b = rng.standard_normal(16).astype(np.float32)
    proto = onnx.parser.parse_model(CONV_RELU)
    del proto.graph.input[1:]  # W and B as initializers
    proto.graph.initializer.extend([onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "B")])
    model = ir.serde.deserialize_model(proto)
    data = [{"X": rng.standard_normal((1, 16, 12, 12)).astype(np.float32)} for _ in range(3)]

    def conv(x: np.ndarray) -> np.ndarray:
        padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
        windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # N, C, H, W, 3, 3
        return np.einsum("nchwij,ocij->nohw", windows, w.astype(np.float64)) + b[None, :, None, None]

    c = np.concatenate([conv(x["X"]) for x in data])
    d = conv(np.maximum(c, 0))
    truth = {"C": c, "R": np.maximum(c, 0), "Y": np.maximum(d, 0)}  # D is not observed: fused with its Relu
    observers = {name: MinMaxObserver() for name in truth}
    assert collect(model, data, observers, optimize=True) == 3
    for name, values in truth.items():
        lo, hi = float(observers[name].lo), float(observers[name].hi)  # type: ignore[arg-type]
        assert np.allclose([lo, hi], [values.min(), values.max()], rtol=1e-5, atol=1e-5), name


def test_a_calibration_model_onnx_runtime_refuses_is_requants_error_naming_the_node() -> None:
    """A model requant writes to calibrate and ONNX Runtime refuses (here a Concat of a rank-1 and a rank-2
    value, as a rewrite that made a scalar rank 1 once wrote): a CalibrationError naming the stage, the
    node, its inputs' shapes, and ONNX Runtime's words; never ONNX Runtime's traceback."""
    from requant.calibration.runner import _session
    from requant.runtime import SessionError

    model = load_onnx_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[4] y) {
        one = Constant <value = float[1,1] {1.0}> ()
        y = Concat <axis = 0> (x, one)
    }
    """)
    model.graph.node(1).name = "cat"
    with pytest.raises(SessionError) as refused, _session(model, [], optimize=True):
        pass
    text = str(refused.value)
    assert text.startswith("calibration (the model with the values it observes as outputs): ONNX Runtime refused")
    assert "at Concat 'cat' (its inputs: x: [2]; one: [1, 1])" in text, text
    assert "All inputs to Concat must have same rank" in text and "requant's fault" in text
