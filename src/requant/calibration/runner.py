"""The streaming runner: run the float model in ONNX Runtime and feed observed tensors to their observers.

Only the tensors that have observers are exposed (as extra outputs); each run's tensors go to
their observers and are dropped, so memory stays flat however many samples there are. When the
observed tensors of one run would exceed ``memory_budget`` bytes, they are observed in several
passes over the data (the data must then be re-iterable: a list, a path, a dict).
"""

from __future__ import annotations

import itertools
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

from requant.calibration.data import Sample, model_inputs
from requant.calibration.observers import CalibrationError, Observer
from requant.calibration.samples import HeldOut, Samples, iter_samples
from requant.ir.queries import graph_values, static_elements
from requant.runtime import cpu_session

__all__ = ["Kept", "Progress", "collect", "terminal_progress"]

log = logging.getLogger("requant.calibration")

Progress = Callable[[int, float], None]

STACK_BYTES = 16 << 20  # observed bytes per run when samples are stacked
MAX_STACK = 64  # samples per stacked run


class Kept(Observer):
    """The arrays of one tensor from the first runs, one sample a run, while they fit in ``limit``
    bytes (a prefix of the samples: once one does not fit, no later one is kept). A probe that runs
    the float model anyway keeps its output this way for a later comparison against float."""

    batchable = False

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.arrays: list[Any] = []
        self.full = False

    def update(self, array: Any) -> None:
        self.full = self.full or sum(a.nbytes for a in self.arrays) + array.nbytes > self.limit
        if not self.full:
            self.arrays.append(array)


@dataclass
class _Bar:
    """A one-line progress display on standard error: samples, rate, elapsed."""

    label: str
    total: int | None = None
    unit: str = "samples"
    last: float = 0.0

    def __call__(self, done: int, elapsed: float) -> None:
        now = time.perf_counter()
        if now - self.last < 0.2 and done != self.total:
            return
        self.last = now
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", {(self.total - done) / rate:.0f} s left" if self.total and rate else ""
        of = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r{self.label}: {done}{of} {self.unit}, {rate:.1f}/s, {elapsed:.1f} s{left}   ")
        sys.stderr.flush()


def terminal_progress(label: str = "calibrating", total: int | None = None, unit: str = "samples") -> Progress:
    """A progress callback that redraws one line on standard error (when it is a terminal)."""
    if not sys.stderr.isatty():
        return lambda done, elapsed: None
    return _Bar(label, total, unit)


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
    # ``optimize``: every rewrite (fusions, NCHWc layouts), whose values differ in the last float digits
    # (a value asked for as an output is kept whatever is fused around it); else the model as it is
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    if optimize:  # ONNX Runtime folds no DequantizeLinear of a constant weight without this (it keeps
        # them for its int8 fusions): MobileNetV2's bias-correction probe dequantized every weight on
        # every run, 15 of its 50 ms
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="requant-calibrate-") as folder:
        graph.outputs.extend(added)
        try:
            ir.save(model, Path(folder) / "model.onnx", external_data="model.data")
        finally:
            for _ in added:  # one by one: onnx-ir 1.1's slice deletion leaves the values marked as outputs
                graph.outputs.pop()
        stage = "calibration (the model with the values it observes as outputs)"
        session = cpu_session(str(Path(folder) / "model.onnx"), options, stage)
        yield session


def _sizes(model: ir.Model, names: list[str]) -> dict[str, int]:
    """Bytes per sample of each observed tensor, where shapes are static (symbolic dims count 1)."""
    by_name = {str(v.name): v for v in graph_values(model.graph)}
    sizes = {}
    for name in names:
        value = by_name.get(name)
        elements = static_elements(value) if value is not None else None
        sizes[name] = (1 if elements is None else elements) * 4
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
    stack: bool = True,
) -> int:
    """Run ``model`` on every sample of ``data``, feeding the observed tensors to ``observers``.

    Returns the number of samples. ``optimize``: every ONNX Runtime rewrite (constants folded,
    dequantized weights once; fusions; float convs in the NCHWc layout), for statistics that may
    differ in the last digits (such a conv adds in another order). ``stack=False``: one sample
    per run, for a model whose observed tensors are small but its activations are not (stacked, they
    leave the caches: EfficientNet-Lite0 ran 16 samples stacked in 1.8x the time of 16 runs).
    """
    names = list(observers)
    if not names:
        return 0
    groups = _groups(names, _sizes(model, names), memory_budget)
    if len(groups) > 1:
        log.info("observing %d tensors in %d passes to stay within %d MB", len(names), len(groups), memory_budget >> 20)
        held = data if isinstance(data, HeldOut) else None
        source = held.source if held is not None else data
        if isinstance(source, Samples):
            source = source.source
        if not isinstance(source, (list, tuple, str, Mapping)) and not hasattr(source, "__fspath__"):
            source = list(source)  # read once per group
        if held is not None:
            held.source = source
        else:
            data = source
    count = 0
    for group in groups:
        with _session(model, group, optimize) as session:
            stack_bytes = min(STACK_BYTES, memory_budget) if stack else 0
            count = _observe(session, model, data, group, observers, progress, stack_bytes)
    return count


def _stackable(model: ir.Model) -> bool:
    """Whether every input has a symbolic first dimension, along which samples can be stacked."""
    shapes = [v.shape for v in model_inputs(model)]
    return bool(shapes) and all(s is not None and s.rank() > 0 and not isinstance(s[0], int) for s in shapes)


def _rows(sample: Sample) -> int | None:
    """The sample's size on the first axis, when all its inputs agree on one."""
    sizes = {a.shape[0] if a.ndim else None for a in sample.values()}
    return next(iter(sizes)) if len(sizes) == 1 else None


def _same_rows(stacked: Any, alone: Any, rows: int, total: int) -> bool:
    """Whether a tensor of a stacked run holds, in its first ``rows`` rows, what the first sample
    gave alone (the model computes each sample on its own), up to the rounding of other kernels."""
    stacked, alone = np.asarray(stacked), np.asarray(alone)
    if stacked.shape == alone.shape:
        part = stacked  # the same for every batch: a value computed from the weights only
    elif alone.ndim and alone.shape[0] == rows and stacked.shape == (total, *alone.shape[1:]):
        part = stacked[:rows]
    else:
        return False
    if alone.dtype.kind != "f":
        return bool(np.array_equal(part, alone))
    scale = float(np.nanmax(np.abs(alone), initial=0.0)) if alone.size else 0.0
    return bool(np.allclose(part, alone, rtol=1e-3, atol=1e-4 * scale + 1e-30, equal_nan=True))


@dataclass
class _Runs:
    """Runs of the session on samples, stacked ``batch`` at a time, each result fed to its observer."""

    session: ort.InferenceSession
    group: list[str]
    observers: Mapping[str, Observer]
    batch: int = 1
    done: int = 0  # samples observed
    alone: tuple[Sample, list[Any]] | None = None  # a sample and its results from a run of its own
    checked: bool = False  # a stacked run agreed with its first sample run alone

    def feed(self, results: list[Any]) -> None:
        for name, result in zip(self.group, results, strict=True):
            array = np.asarray(result)
            if array.dtype.kind == "f":
                self.observers[name].update(array)

    def run(self, sample: Sample, index: int) -> list[Any]:
        try:
            return list(self.session.run(self.group, sample))
        except Exception as exc:  # ONNX Runtime reports shape and type errors this way
            raise CalibrationError(f"calibration sample {index}: ONNX Runtime failed: {exc}") from None

    def one_by_one(self, samples: list[Sample]) -> None:
        for sample in samples:
            self.feed(self.run(sample, self.done + 1))
            self.done += 1

    def stacked(self, samples: list[Sample]) -> None:
        """Observe ``samples`` in one run. The first stacked run is checked against its first sample
        run alone: a model that mixes the samples of a batch (a Reshape to a fixed batch size, an
        input whose first axis is not a batch) runs this and later samples one by one."""
        if len(samples) == 1:
            self.one_by_one(samples)
            return
        stacked = {name: np.concatenate([s[name] for s in samples]) for name in samples[0]}
        try:
            results: list[Any] | None = list(self.session.run(self.group, stacked))
        except Exception:  # a model that cannot take a stacked batch
            results = None
        if results is not None and not self.checked:
            alone = self.alone[1] if self.alone and self.alone[0] is samples[0] else self.run(samples[0], self.done + 1)
            rows, total = _rows(samples[0]) or 0, _rows(stacked) or 0
            self.checked = all(_same_rows(s, a, rows, total) for s, a in zip(results, alone, strict=True))
            self.alone = None
            if not self.checked:
                results = None
        if results is None:
            log.info("the model does not compute stacked samples one by one: calibrating one sample per run")
            self.batch = 1
            self.one_by_one(samples)
            return
        self.feed(results)
        self.done += len(samples)


def _observe(
    session: ort.InferenceSession,
    model: ir.Model,
    data: Any,
    group: list[str],
    observers: Mapping[str, Observer],
    progress: Progress | None,
    stack_bytes: int,
) -> int:
    """Feed ``observers`` from runs on ``data``. Small samples of one shape are stacked along the
    first axis, up to ``stack_bytes`` of observed tensors a run (one run per sample of a tiny model
    is mostly call overhead), when the model's inputs have a symbolic first axis, every observer
    is ``batchable``, and the first stacked run agrees with its first sample run alone."""
    start = time.perf_counter()
    runs = _Runs(session, group, observers)
    samples = iter_samples(model, data)
    if _stackable(model) and all(observers[name].batchable for name in group):
        first = next(samples)
        results = runs.run(first, 1)
        runs.batch = max(1, min(MAX_STACK, stack_bytes // max(1, sum(np.asarray(r).nbytes for r in results))))
        if runs.batch > 1:  # run again in the first stack; the results alone check that stack
            runs.alone = (first, results)
            samples = itertools.chain([first], samples)
        else:
            runs.feed(results)
            runs.done = 1
        del results  # a large model's tensors of one run (MobileNetV2: ~50 MB) are not kept through the loop
    for stack in _stacks(samples, runs):
        runs.stacked(stack)
        if progress is not None:
            progress(runs.done, time.perf_counter() - start)
    return runs.done


def _stacks(samples: Iterator[Sample], runs: _Runs) -> Iterator[list[Sample]]:
    """Consecutive samples of one shape (but the first axis), at most ``runs.batch`` at a time."""
    pending: list[Sample] = []
    shape: Any = None
    for sample in samples:
        key = tuple((name, a.shape[1:]) for name, a in sample.items()) if _rows(sample) else object()
        if pending and (key != shape or len(pending) >= runs.batch):
            yield pending
            pending = []
        shape = key
        pending.append(sample)
    if pending:
        yield pending
