"""A data set opened once: :class:`Samples` is what every stage asks for samples.

The user's source (a path, arrays, a list, a generator, an image folder: :mod:`requant.calibration.data`)
is wrapped once, when a run starts. Stages ask it for all of its samples (calibration: streamed, one
at a time, so memory stays flat), for the first ones (bias correction, equalization, the comparisons
of ``method="auto"``, the budget's ranking, latency, the TOSA checks: kept after the first time, up to
``KEEP_BYTES``), or for all but a held-out head (:class:`HeldOut`). A generator is read once and its
first samples replayed (:class:`Replayed`).

Every sample is checked against the model that asks (:func:`~requant.calibration.data.checked_samples`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.data import Sample, checked_samples, input_specs, read_labels, samples_for

__all__ = ["KEEP_BYTES", "HeldOut", "Replayed", "Samples", "first_samples", "iter_samples", "split_labels"]

KEEP_BYTES = 128 << 20  # the first samples a data set keeps for the stages that read them again
KEEP_SAMPLES = 64  # and at most this many (bias correction's, equalization's and the budget's count)


class Replayed:
    """A one-shot iterator (a generator) made readable more than once without holding all of it.

    Each pass yields the first ``keep`` samples it kept, then reads on where the source stopped: a
    stage that reads only the first samples (equalization, before calibration) leaves the rest for
    the next pass. Once the source is exhausted, later passes replay the kept samples only (bias
    correction, the latency sample, a second quantization pass read the first ones)."""

    def __init__(self, source: Iterator[Any], keep: int) -> None:
        self._source, self._keep = source, keep
        self._kept: list[Any] = []
        self._read = 0  # samples taken from the source
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        position = 0
        while True:
            if position < len(self._kept):
                yield self._kept[position]
            elif self._done or position < self._read:  # read past what is kept: those are gone
                return
            else:
                sample = next(self._source, _END)
                if sample is _END:
                    self._done = True
                    return
                self._read += 1
                if len(self._kept) < self._keep:
                    self._kept.append(sample)
                yield sample
            position += 1


_END = object()


class HeldOut:
    """``source`` without its first samples, which are held out: as many as ``count(values)`` says for
    the number of values in the first sample, and none when the source has fewer than twice that
    (too few left to calibrate on). ``method="auto"`` calibrates its candidates on the rest and
    compares them on the held-out samples: compared on samples they were calibrated on, ``minmax``
    (whose range covers each of their extremes) is favoured over a method that clips them.

    ``skipped``: how many the last pass held out. Iterating it (``iter_samples``) reads the source
    as it is read anyway; at most twice the held-out count of samples is kept in memory at a time."""

    def __init__(self, source: Any, count: Callable[[int], int]) -> None:
        self.source, self.count = source, count
        self.skipped = 0

    def samples(self, checked: Iterator[Sample]) -> Iterator[Sample]:
        first = next(checked, None)
        if first is None:
            return
        wanted = max(1, self.count(sum(int(np.size(a)) for a in first.values())))
        head = [first, *itertools.islice(checked, wanted - 1)]
        spare = list(itertools.islice(checked, wanted))
        self.skipped = wanted if len(spare) == wanted else 0
        yield from spare if self.skipped else [*head, *spare]
        yield from checked


class Samples:
    """One data set of a run: its source opened once (a generator wrapped in :class:`Replayed`), its
    name in messages (``what``), and the first checked samples once read (by the inputs they were
    checked for), up to ``KEEP_SAMPLES`` and ``KEEP_BYTES``."""

    def __init__(self, source: Any, what: str = "calibration", keep: int = KEEP_SAMPLES) -> None:
        if isinstance(source, Samples):
            source = source.source
        self.source: Any = Replayed(source, keep) if isinstance(source, Iterator) else source
        self.what = what
        self._first: dict[Any, tuple[list[Sample], bool]] = {}  # inputs -> (first samples, all of them)

    def each(self, model: ir.Model, what: str | None = None) -> Iterator[Sample]:
        """Every sample, checked for ``model``, read from the source as it goes."""
        return checked_samples(model, self.source, what or self.what)

    def head(self, model: ir.Model, count: int) -> list[Sample]:
        """The first ``count`` samples (fewer when there are fewer)."""
        key = input_specs(model)
        kept, complete = self._first.get(key, ([], False))
        if len(kept) >= count or complete:
            return kept[:count]
        found = list(itertools.islice(self.each(model), count))
        if len(found) > len(kept) and sum(a.nbytes for s in found for a in s.values()) <= KEEP_BYTES:
            self._first[key] = (found[:KEEP_SAMPLES], len(found) < count and len(found) <= KEEP_SAMPLES)
        return found

    def first(self, model: ir.Model, requested: int) -> list[Sample]:
        """The first samples a pass measuring means or maxima runs on: ``requested``, or fewer for large
        inputs (:func:`~requant.calibration.data.samples_for`)."""
        one = self.head(model, 1)
        if not one:
            next(self.each(model))  # an empty data set: the error that names it
        count = samples_for(sum(int(np.size(a)) for a in one[0].values()), requested)
        return self.head(model, count)

    def held_out(self, count: Callable[[int], int]) -> HeldOut:
        """These samples without a head of ``count(values)`` held out (:class:`HeldOut`)."""
        return HeldOut(self, count)


def iter_samples(model: ir.Model, source: Any, what: str = "calibration") -> Iterator[Sample]:
    """The checked samples of ``source`` for ``model``; an empty source is an error.

    ``what`` names the data in messages ("calibration", "evaluation"). A :class:`HeldOut` source
    gives its samples after the held-out ones (each still checked, and numbered as in the whole
    source); a :class:`Samples` its own, in its own name."""
    if isinstance(source, HeldOut):
        return source.samples(iter_samples(model, source.source, what))
    if isinstance(source, Samples):
        return source.each(model)
    return checked_samples(model, source, what)


def first_samples(model: ir.Model, source: Any, requested: int) -> list[Sample]:
    """The first checked samples of ``source``: as many as :func:`samples_for` says for the size of
    the first (an empty source is an error that names it)."""
    if isinstance(source, Samples):
        return source.first(model, requested)
    stream = iter_samples(model, source)
    first = next(stream)
    count = samples_for(sum(int(np.size(a)) for a in first.values()), requested)
    return [first, *itertools.islice(stream, count - 1)]


def split_labels(data: Any, inputs: set[str]) -> tuple[Any, npt.NDArray[Any] | None]:
    """Evaluation data without its ``labels``, and the labels (None when it has none): an ``.npz``'s
    array of that name, or a dict's entry when the model has no input of that name."""
    source = data.source if isinstance(data, Samples) else data
    if isinstance(source, (str, os.PathLike)) and Path(source).suffix == ".npz" and Path(source).is_file():
        return data, read_labels(Path(source))  # the samples are read without it, one at a time
    if isinstance(source, Mapping) and "labels" in source and "labels" not in inputs:
        rest = {k: v for k, v in source.items() if k != "labels"}
        labels = np.asarray(source["labels"]).reshape(-1)
        return (Samples(rest, data.what) if isinstance(data, Samples) else rest), labels
    return data, None
