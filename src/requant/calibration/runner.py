"""The streaming runner: run the float model in ONNX Runtime and feed observed tensors to their observers.

Only the tensors that have observers are exposed (as extra outputs); each run's tensors go to
their observers and are dropped, so memory stays flat however many samples there are. When the
observed tensors of one run would exceed ``memory_budget`` bytes, they are observed in several
passes over the data (the data must then be re-iterable: a list, a path, a dict).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]

from requant.calibration.data import iter_samples
from requant.calibration.observers import CalibrationError, Observer
from requant.ir.queries import graph_values

__all__ = ["Progress", "collect", "terminal_progress"]

log = logging.getLogger("requant.calibration")

Progress = Callable[[int, float], None]


@dataclass
class _Bar:
    """A one-line progress display on standard error: samples, rate, elapsed."""

    label: str
    total: int | None = None
    last: float = 0.0

    def __call__(self, done: int, elapsed: float) -> None:
        now = time.perf_counter()
        if now - self.last < 0.2 and done != self.total:
            return
        self.last = now
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", {(self.total - done) / rate:.0f} s left" if self.total and rate else ""
        of = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r{self.label}: {done}{of} samples, {rate:.1f}/s, {elapsed:.1f} s{left}   ")
        sys.stderr.flush()


def terminal_progress(label: str = "calibrating", total: int | None = None) -> Progress:
    """A progress callback that redraws one line on standard error (when it is a terminal)."""
    if not sys.stderr.isatty():
        return lambda done, elapsed: None
    return _Bar(label, total)


@contextmanager
def _session(model: ir.Model, names: list[str], optimize: bool = False) -> Iterator[ort.InferenceSession]:
    """A session on ``model`` with ``names`` as extra outputs, its weights memory-mapped.

    The model goes to a temporary folder with its weights as external data, which ONNX Runtime maps
    instead of copying: loading from serialized bytes held the model three times (requant's, the
    bytes, ONNX Runtime's; MiniLM: 610 MB peak, 470 MB of it weights). ``model`` is left as it was.
    """
    graph = model.graph
    by_name = {str(v.name): v for v in graph_values(graph)}
    present = {id(o) for o in graph.outputs}
    added = [by_name[n] for n in names if n in by_name and id(by_name[n]) not in present]
    options = ort.SessionOptions()
    # observe the model as it is; ``optimize``: basic rewrites only (constant folding), which keep every value
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_BASIC if optimize else level.ORT_DISABLE_ALL
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="requant-calibrate-") as folder:
        graph.outputs.extend(added)
        try:
            ir.save(model, Path(folder) / "model.onnx", external_data="model.data")
        finally:
            for _ in added:  # one by one: onnx-ir 1.1's slice deletion leaves the values marked as outputs
                graph.outputs.pop()
        yield ort.InferenceSession(str(Path(folder) / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _sizes(model: ir.Model, names: list[str]) -> dict[str, int]:
    """Bytes per sample of each observed tensor, where shapes are static (symbolic dims count 1)."""
    by_name = {str(v.name): v for v in graph_values(model.graph)}
    sizes = {}
    for name in names:
        value = by_name.get(name)
        elements = 1
        if value is not None and value.shape is not None:
            for d in value.shape:
                elements *= d if isinstance(d, int) else 1
        sizes[name] = elements * 4
    return sizes


def _groups(names: list[str], sizes: Mapping[str, int], budget: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return groups


def collect(
    model: ir.Model,
    data: Any,
    observers: Mapping[str, Observer],
    progress: Progress | None = None,
    memory_budget: int = 1 << 30,
    optimize: bool = False,
) -> int:
    """Run ``model`` on every sample of ``data``, feeding the observed tensors to ``observers``.

    Returns the number of samples. ``optimize`` lets ONNX Runtime fold constants first (a model
    whose constants are dequantized weights runs faster); the observed values are the same.
    """
    names = list(observers)
    if not names:
        return 0
    groups = _groups(names, _sizes(model, names), memory_budget)
    if len(groups) > 1:
        log.info("observing %d tensors in %d passes to stay within %d MB", len(names), len(groups), memory_budget >> 20)
        if not isinstance(data, (list, tuple, str, Mapping)) and not hasattr(data, "__fspath__"):
            data = list(data)
    count = 0
    for group in groups:
        with _session(model, group, optimize) as session:
            count = _observe(session, model, data, group, observers, progress)
    return count


def _observe(
    session: ort.InferenceSession,
    model: ir.Model,
    data: Any,
    group: list[str],
    observers: Mapping[str, Observer],
    progress: Progress | None,
) -> int:
    start = time.perf_counter()
    count = 0
    for sample in iter_samples(model, data):
        try:
            results = session.run(group, sample)
        except Exception as exc:  # ONNX Runtime reports shape and type errors this way
            raise CalibrationError(f"calibration sample {count + 1}: ONNX Runtime failed: {exc}") from None
        for name, result in zip(group, results, strict=True):
            array = np.asarray(result)
            if array.dtype.kind == "f":
                observers[name].update(array)
        del results
        count += 1
        if progress is not None:
            progress(count, time.perf_counter() - start)
    return count
