"""The streaming runner: observed tensors only, flat memory, several passes within a memory budget."""

from __future__ import annotations

import numpy as np

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
