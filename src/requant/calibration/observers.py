"""Calibration observers: pure statistics, ``update(array)`` then ``compute(spec) -> quantized type``.

They never touch the graph, the disk or a runtime session, and they merge, so statistics can be
gathered in pieces (batches, passes, workers) and combined. Methods by name:

``minmax``
    the smallest and largest value seen (per tensor or per axis).
``moving_average_minmax``
    exponential moving averages of each batch's min and max (``averaging_constant``, 0.01).
``percentile``
    the range holding ``percentile`` percent (99.999) of the values, from a histogram.
``stem_percentile``
    ``percentile``, at 99.99 for a CNN's maps at a quarter of its input's resolution or finer (their
    sparse, large edge responses) and 99.999 elsewhere: what ``auto`` calibrates a detector with.
``entropy``
    the clipping threshold minimizing the KL divergence between the histogram and its quantized
    form, as TensorRT and TVM calibrate.
``mse``
    the clipping range minimizing the expected squared quantization error over the histogram.

Histograms have ``bins`` bins (2048) over the range seen so far; when data falls outside it, the
range doubles (as often as needed) and the old counts fold into the wider bins, so a histogram
of many batches equals the histogram of their union up to that folding.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.errors import RequantError
from requant.ir.requests import QuantizationSpec, register_observer
from requant.types import UniformType, from_range, storage_bounds

__all__ = [
    "CalibrationError",
    "Histogram",
    "HistogramObserver",
    "MeanMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "extremes",
    "make_observer",
    "observe",
    "register_method",
]

Array = npt.NDArray[Any]


class CalibrationError(RequantError):
    """Statistics that cannot give parameters (nothing observed, NaN everywhere...)."""


class Observer:
    """Statistics of one tensor; subclasses implement ``update``, ``merge`` and ``range``.

    ``batchable``: the statistics depend on the values seen, not on how they were split into
    updates, so the runner may stack several samples into one run (a subclass says so).
    """

    axis: int | None = None
    batchable = False

    def update(self, array: Array) -> None:
        raise NotImplementedError

    def merge(self, other: Observer) -> None:
        raise NotImplementedError

    def range(self, spec: QuantizationSpec) -> tuple[Array, Array]:
        """(min, max) to quantize, per tensor (0-d) or per axis (1-d)."""
        raise NotImplementedError

    def seen(self) -> dict[str, Any] | None:
        """What the report shows of the statistics, per tensor: ``observed`` [min, max] and, for
        histogram observers, a coarse ``histogram`` (64 bins); None when there is nothing to show."""
        return None

    def compute(self, spec: QuantizationSpec, expressed: str = "f32") -> UniformType:
        lo, hi = self.range(spec)
        axis = spec.axis if spec.granularity == "per_axis" else None
        return from_range(lo, hi, spec.storage, expressed, axis=axis, **spec.range_flags)


def _finite(array: Array) -> Array:
    flat = np.asarray(array, dtype=np.float64).reshape(-1)
    finite = np.isfinite(flat)
    return flat if finite.all() else flat[finite]


def extremes(array: Array) -> tuple[Array, float, float] | None:
    """The array (its finite values, flat, when NaN or Inf is among them) and their smallest and
    largest value; None when there is no finite value. One min and max in the common case."""
    if array.size == 0:
        return None
    low, high = float(array.min()), float(array.max())
    if math.isfinite(low) and math.isfinite(high):
        return array, low, high
    values = _finite(array)
    if values.size == 0:
        return None
    return values, float(values.min()), float(values.max())


def observe(observers: list[Observer], array: Array) -> None:
    """Update each of ``observers`` with ``array``, its finite values and extremes found once (:func:`extremes`)
    for those that read them: per-tensor min/max observers (``add_extremes``) and histograms."""
    found: Any = None
    for o in observers:
        shares = isinstance(o, HistogramObserver) or (isinstance(o, MinMaxObserver) and o.axis is None)
        if not shares:
            o.update(array)
            continue
        found = found or extremes(np.asarray(array).reshape(-1)) or ()
        if found and isinstance(o, HistogramObserver):
            o.histogram.add(*found)
        elif found:
            o.add_extremes(found[1], found[2])  # type: ignore[attr-defined]


def _per_axis(array: Array, axis: int) -> tuple[Array, Array]:
    axis %= array.ndim
    others = tuple(a for a in range(array.ndim) if a != axis)
    lo, hi = np.min(array, axis=others), np.max(array, axis=others)  # in place, no copy
    if np.isfinite(lo).all() and np.isfinite(hi).all():  # no NaN (it propagates) nor infinity anywhere
        return lo.astype(np.float64), hi.astype(np.float64)
    moved = np.moveaxis(np.asarray(array, dtype=np.float64), axis, 0).reshape(array.shape[axis], -1)
    with np.errstate(invalid="ignore"):
        masked = np.where(np.isfinite(moved), moved, np.nan)
        return np.nanmin(masked, axis=1), np.nanmax(masked, axis=1)


@dataclass
class MinMaxObserver(Observer):
    """The smallest and largest finite value seen; per axis when ``axis`` is set."""

    axis: int | None = None
    lo: Array | None = None
    hi: Array | None = None
    batchable = True

    def update(self, array: Array) -> None:
        if array.size == 0:
            return
        if self.axis is None:
            found = extremes(array)
            if found is not None:
                self.add_extremes(found[1], found[2])
            return
        lo, hi = _per_axis(array, self.axis)
        self.lo = lo if self.lo is None else np.fmin(self.lo, lo)
        self.hi = hi if self.hi is None else np.fmax(self.hi, hi)

    def add_extremes(self, low: float, high: float) -> None:
        """One update's smallest and largest finite value, per tensor (``axis`` None): what ``update``
        does with an array's, for a caller that feeds several observers the same array."""
        if self.lo is not None and self.hi is not None:  # the common case, without numpy calls
            if low >= self.lo and high <= self.hi:
                return
            low, high = min(low, float(self.lo)), max(high, float(self.hi))
        self.lo, self.hi = np.array(low), np.array(high)

    def merge(self, other: Observer) -> None:
        assert isinstance(other, MinMaxObserver)
        if other.lo is not None and other.hi is not None:
            self.lo = other.lo if self.lo is None else np.fmin(self.lo, other.lo)
            self.hi = other.hi if self.hi is None else np.fmax(self.hi, other.hi)

    def range(self, spec: QuantizationSpec) -> tuple[Array, Array]:
        if self.lo is None or self.hi is None or np.isnan(self.lo).any():
            raise CalibrationError("no finite value was observed")
        return self.lo, self.hi

    def seen(self) -> dict[str, Any] | None:
        if self.axis is not None or self.lo is None or self.hi is None or np.isnan(self.lo).any():
            return None
        return {"observed": [float(self.lo), float(self.hi)]}


@dataclass
class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving averages of each update's min and max."""

    averaging_constant: float = 0.01
    batchable = False  # an average of each update's extremes: one update per sample, as given

    def update(self, array: Array) -> None:
        batch = MinMaxObserver(self.axis)
        batch.update(array)
        if batch.lo is not None and batch.hi is not None:
            self._average(batch.lo, batch.hi)

    def add_extremes(self, low: float, high: float) -> None:
        self._average(np.array(low), np.array(high))

    def _average(self, lo: Array, hi: Array) -> None:
        if self.lo is None or self.hi is None:
            self.lo, self.hi = lo, hi
        else:
            c = self.averaging_constant
            self.lo = self.lo + c * (lo - self.lo)
            self.hi = self.hi + c * (hi - self.hi)


@dataclass
class MeanMinMaxObserver(MinMaxObserver):
    """The mean over updates (samples) of each one's min and max: NNCF's default for activations
    (``MEAN_MINMAX``). A rare sample with a wider range widens it by its share only."""

    count: int = 0
    sum_lo: Array | None = None
    sum_hi: Array | None = None
    batchable = False  # an average of each sample's extremes: one update per sample

    def update(self, array: Array) -> None:
        sample = MinMaxObserver(self.axis)
        sample.update(array)
        if sample.lo is not None and sample.hi is not None and not np.isnan(sample.lo).any():
            self._add(1, sample.lo, sample.hi)

    def add_extremes(self, low: float, high: float) -> None:
        self._add(1, np.array(low), np.array(high))

    def merge(self, other: Observer) -> None:
        assert isinstance(other, MeanMinMaxObserver)
        if other.count and other.sum_lo is not None and other.sum_hi is not None:
            self._add(other.count, other.sum_lo, other.sum_hi)

    def _add(self, count: int, sum_lo: Array, sum_hi: Array) -> None:
        """Add ``count`` samples' summed extremes; the range is their mean."""
        self.count += count
        self.sum_lo = sum_lo if self.sum_lo is None else self.sum_lo + sum_lo
        self.sum_hi = sum_hi if self.sum_hi is None else self.sum_hi + sum_hi
        self.lo, self.hi = self.sum_lo / self.count, self.sum_hi / self.count

    def seen(self) -> dict[str, Any] | None:
        seen = super().seen()
        return None if seen is None else {"observed": seen["observed"], "mean of samples": True}


@dataclass
class Histogram:
    """Counts of values in ``bins`` equal bins over [lo, hi]; the range only ever widens (doubling)."""

    bins: int = 2048
    lo: float = 0.0
    hi: float = 0.0
    counts: Array = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    data_lo: float = math.inf  # the true extremes seen (the bins may extend past them)
    data_hi: float = -math.inf

    @property
    def empty(self) -> bool:
        return self.counts.size == 0 or not self.counts.any()

    def _widen(self, lo: float, hi: float) -> None:
        if self.counts.size == 0:
            span = max(hi - lo, 1e-12)
            self.lo, self.hi = lo, lo + span
            self.counts = np.zeros(self.bins, dtype=np.int64)
            return
        while lo < self.lo or hi > self.hi:
            span = self.hi - self.lo
            # double, keeping the old range on the side the data did not leave
            grow_low = lo < self.lo and (hi <= self.hi or self.lo - lo > hi - self.hi)
            new_lo, new_hi = (self.lo - span, self.hi) if grow_low else (self.lo, self.hi + span)
            folded = self.counts.reshape(-1, 2).sum(axis=1)
            counts = np.zeros(self.bins, dtype=np.int64)
            counts[self.bins // 2 :] = folded if grow_low else 0
            counts[: self.bins // 2] = 0 if grow_low else folded
            self.lo, self.hi, self.counts = new_lo, new_hi, counts

    def update(self, values: Array) -> None:
        found = extremes(np.asarray(values).reshape(-1))
        if found is not None:
            self.add(*found)

    def add(self, values: Array, lo: float, hi: float) -> None:
        """Count ``values`` (finite, flat), whose extremes are ``lo`` and ``hi`` (:func:`extremes`)."""
        self.data_lo, self.data_hi = min(self.data_lo, lo), max(self.data_hi, hi)
        self._widen(lo, hi)
        # bin index in the values' own precision (float32 for float32 tensors: half the time of float64);
        # a value on a bin edge may land on either side of it. The values lie in [lo, hi] and lo is at most
        # the least (also once rounded to float32: the least float32 at or above it), so the index is at
        # least 0 and at most bins (hi): bin bins - 1 takes what lands past it, as a clip would
        kind = values.dtype if values.dtype.kind == "f" else np.dtype(np.float64)
        counts = _bin_counts(values.astype(kind, copy=False), self.lo, self.bins / (self.hi - self.lo), self.bins + 1)
        counts[self.bins - 1] += counts[self.bins :].sum()
        self.counts += counts[: self.bins]

    def merge(self, other: Histogram) -> None:
        if other.empty:
            return
        edges = np.linspace(other.lo, other.hi, other.bins + 1)
        centers = (edges[:-1] + edges[1:]) / 2
        self.data_lo, self.data_hi = min(self.data_lo, other.data_lo), max(self.data_hi, other.data_hi)
        self._widen(other.lo, other.hi)
        index = ((centers - self.lo) * (self.bins / (self.hi - self.lo))).astype(np.int64)
        np.clip(index, 0, self.bins - 1, out=index)
        self.counts += np.bincount(index, weights=other.counts, minlength=self.bins).astype(np.int64)

    @property
    def edges(self) -> Array:
        return np.linspace(self.lo, self.hi, self.bins + 1)


_SHOWN_BINS = 64  # a histogram's bins in the report (its 2048 folded by 32)


def _bin_counts(values: Array, lo: float, per_unit: float, bins: int) -> Array:
    """How many of ``values`` (floats, flat, at least ``lo``) fall in each of ``bins`` bins: the bin of ``x`` is
    ``(x - lo) * per_unit`` (each step rounded to the values' precision) truncated. Through torch when a torch
    model is being calibrated (torch loaded): the same arithmetic and the same counts, 1.5x faster (its
    subtraction and product use both cores, its bincount reads 32-bit indices); numpy's otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and values.dtype == np.float32 and values.flags.writeable and values.size < 2**31:
        scaled = torch.from_numpy(values).sub(float(np.float32(lo))).mul_(float(np.float32(per_unit)))
        found: Array = torch.bincount(scaled.to(torch.int32), minlength=bins).numpy()
        return found.astype(np.int64, copy=False)
    scaled = np.subtract(values, values.dtype.type(lo), dtype=values.dtype)
    scaled *= values.dtype.type(per_unit)
    return np.bincount(scaled.astype(np.intp), minlength=bins)


@dataclass
class HistogramObserver(Observer):
    """A histogram, and a rule turning it into a range (``percentile``, ``entropy`` or ``mse``)."""

    rule: str = "percentile"
    options: Mapping[str, Any] = field(default_factory=dict)
    histogram: Histogram = field(default_factory=Histogram)
    batchable = True  # the bins' layout follows the order of updates; the counts, the values

    def __post_init__(self) -> None:
        self.histogram = Histogram(int(self.options.get("bins", 2048)))

    def update(self, array: Array) -> None:
        self.histogram.update(array)

    def merge(self, other: Observer) -> None:
        assert isinstance(other, HistogramObserver)
        self.histogram.merge(other.histogram)

    def range(self, spec: QuantizationSpec) -> tuple[Array, Array]:
        h = self.histogram
        if h.empty:
            raise CalibrationError("no finite value was observed")
        rules = {"percentile": _percentile_range, "entropy": _entropy_range, "mse": _mse_range}
        lo, hi = rules[self.rule](h, spec, self.options)
        return np.array(lo), np.array(hi)

    def seen(self) -> dict[str, Any] | None:
        h = self.histogram
        if h.empty:
            return None
        coarse = h.counts.reshape(_SHOWN_BINS, -1).sum(axis=1) if h.bins % _SHOWN_BINS == 0 else h.counts
        return {
            "observed": [float(h.data_lo), float(h.data_hi)],
            "histogram": {"lo": float(h.lo), "hi": float(h.hi), "counts": [int(c) for c in coarse]},
        }


def _percentile_range(h: Histogram, spec: QuantizationSpec, options: Mapping[str, Any]) -> tuple[float, float]:
    p = float(options.get("percentile", 99.999))
    if not 50.0 < p <= 100.0:
        raise CalibrationError(f"percentile must be in (50, 100], got {p}")
    cdf = np.cumsum(h.counts) / h.counts.sum()
    edges = h.edges
    hi = min(float(edges[min(int(np.searchsorted(cdf, p / 100.0)) + 1, h.bins)]), h.data_hi)
    lo = max(float(edges[int(np.searchsorted(cdf, 1.0 - p / 100.0))]), h.data_lo)
    if spec.symmetric:
        bound = max(abs(lo), abs(hi))
        return -bound, bound
    return lo, hi


def _levels(spec: QuantizationSpec) -> int:
    qmin, qmax = storage_bounds(spec.storage, narrow_range=spec.narrow_range, reduce_range=spec.reduce_range)
    return qmax - qmin + 1


def _abs_histogram(h: Histogram) -> tuple[Array, float]:
    """Counts of |x| over [0, max|x|], and their bin width: the histogram's own, or coarser so that
    there are at most ``bins`` bins (a narrow histogram far from zero would need billions)."""
    top = max(abs(h.data_lo), abs(h.data_hi))
    width = max((h.hi - h.lo) / h.bins, top / h.bins)
    n = max(1, math.ceil(top / width))
    centers = (h.edges[:-1] + h.edges[1:]) / 2
    index = np.clip((np.abs(centers) / width).astype(np.int64), 0, n - 1)
    return np.bincount(index, weights=h.counts, minlength=n), width


def _entropy_range(h: Histogram, spec: QuantizationSpec, options: Mapping[str, Any]) -> tuple[float, float]:
    """TensorRT's KL calibration on |x|: the threshold whose clipped, quantized histogram diverges least."""
    counts, width = _abs_histogram(h)
    n = counts.size
    top = max(abs(h.data_lo), abs(h.data_hi))
    one_sided = h.data_lo >= 0 and not spec.symmetric  # [0, threshold] gets every level, not half
    quant_bins = _levels(spec) if one_sided else _levels(spec) // 2
    if one_sided:  # ReLU's zeros are exact at any threshold; their spike only pulls the threshold down
        counts = counts.copy()
        counts[0] = 0
    if n <= quant_bins:
        return (-top, top) if spec.symmetric or h.data_lo < 0 else (0.0, top)
    best, best_i = math.inf, n
    total = counts.sum()
    for i in range(quant_bins, n + 1, max(1, (n - quant_bins) // 256)):
        reference = counts[:i].astype(np.float64)
        reference[-1] += counts[i:].sum()
        # the first i bins merged into quant_bins groups (np.array_split's sizes), each group's
        # count spread evenly over its non-empty bins
        size, extra = divmod(i, quant_bins)
        group = np.repeat(np.arange(quant_bins), [size + 1] * extra + [size] * (quant_bins - extra))
        nonzero = counts[:i] > 0
        sums = np.bincount(group, weights=counts[:i], minlength=quant_bins)
        filled = np.bincount(group, weights=nonzero, minlength=quant_bins)
        quantized = np.where(nonzero, sums[group] / np.maximum(filled[group], 1), 0.0)
        p = reference / total
        q = quantized / max(quantized.sum(), 1e-12)
        mask = p > 0
        q = np.where(mask & (q == 0), 1e-12, q)
        divergence = float(np.sum(p[mask] * np.log(p[mask] / q[mask])))
        if divergence < best:
            best, best_i = divergence, i
    threshold = min(best_i * width, top)
    if spec.symmetric or h.data_lo < 0:
        return -threshold, threshold
    return 0.0, threshold


def _mse_range(h: Histogram, spec: QuantizationSpec, options: Mapping[str, Any]) -> tuple[float, float]:
    """The clipping range (a shrinking of the observed one) with the least expected squared error."""
    centers = (h.edges[:-1] + h.edges[1:]) / 2
    weights = h.counts.astype(np.float64)
    levels = _levels(spec) - 1
    best, best_range = math.inf, (h.data_lo, h.data_hi)
    for fraction in np.linspace(0.3, 1.0, 71):
        lo = min(h.data_lo * fraction, 0.0)
        hi = max(h.data_hi * fraction, 0.0)
        if spec.symmetric:
            bound = max(-lo, hi)
            lo, hi = -bound, bound
        step = (hi - lo) / levels if hi > lo else 1.0
        clipped = np.clip(centers, lo, hi)
        error = (clipped - centers) ** 2 + step**2 / 12.0
        mse = float(np.dot(weights, error))
        if mse < best:
            best, best_range = mse, (lo, hi)
    return best_range


Factory = Callable[[QuantizationSpec, int | None], Observer]

_METHODS: dict[str, Factory] = {
    "minmax": lambda spec, axis: MinMaxObserver(axis),
    "mean_minmax": lambda spec, axis: MeanMinMaxObserver(axis),
    "moving_average_minmax": lambda spec, axis: MovingAverageMinMaxObserver(
        axis, averaging_constant=float(spec.observer_options.get("averaging_constant", 0.01))
    ),
    "percentile": lambda spec, axis: HistogramObserver("percentile", spec.observer_options),
    # the percentile observer; calibration gives a CNN's fine maps another percentile (calibrate.fine_maps)
    "stem_percentile": lambda spec, axis: HistogramObserver("percentile", spec.observer_options),
    "entropy": lambda spec, axis: HistogramObserver("entropy", spec.observer_options),
    "mse": lambda spec, axis: HistogramObserver("mse", spec.observer_options),
}


def register_method(name: str, factory: Factory) -> None:
    """Make a calibration method of your own available by name: ``factory(spec, axis) -> Observer``."""
    register_observer(name)
    _METHODS[name] = factory


def known_methods() -> list[str]:
    """The calibration methods by name, built-in and registered, sorted."""
    return sorted(_METHODS)


def make_observer(spec: QuantizationSpec, axis: int | None = None) -> Observer:
    """The observer a spec asks for (per axis when ``axis`` is given and the method supports it)."""
    factory = _METHODS.get(spec.observer)
    if factory is None:
        raise CalibrationError(f"no calibration method named {spec.observer!r}; known: {', '.join(sorted(_METHODS))}")
    observer = factory(spec, axis)
    if axis is not None and observer.axis is None:
        raise CalibrationError(f"calibration method {spec.observer!r} observes whole tensors, not per axis")
    return observer
