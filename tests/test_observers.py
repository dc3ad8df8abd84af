"""Calibration observers: ranges from statistics, merging, degenerate data, user methods."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from requant.calibration import CalibrationError, MinMaxObserver, Observer, make_observer, register_method
from requant.quantizers import QuantizationSpec
from requant.types import UniformQuantizedPerAxisType, UniformQuantizedType

RNG = np.random.default_rng(0)


def spec(method: str, **kw: object) -> QuantizationSpec:
    return QuantizationSpec(observer=method, **kw)  # type: ignore[arg-type]


def test_minmax_per_tensor_and_per_axis_ignore_nan_and_inf() -> None:
    o = MinMaxObserver()
    o.update(np.array([1.0, np.nan, -2.0, np.inf], np.float32))
    o.update(np.array([3.0], np.float32))
    assert o.range(spec("minmax")) == (-2.0, 3.0)
    w = RNG.standard_normal((4, 3, 2))
    a = make_observer(spec("minmax", granularity="per_axis", axis=0), axis=0)
    a.update(w)
    lo, hi = a.range(spec("minmax"))
    assert np.array_equal(lo, w.reshape(4, -1).min(1)) and np.array_equal(hi, w.reshape(4, -1).max(1))
    t = a.compute(QuantizationSpec("int8", True, granularity="per_axis", axis=0))
    assert isinstance(t, UniformQuantizedPerAxisType) and len(t.scales) == 4


def test_nothing_observed_is_an_error() -> None:
    for method in ("minmax", "percentile", "entropy", "mse"):
        o = make_observer(spec(method))
        o.update(np.array([np.nan, np.nan], np.float32))
        with pytest.raises(CalibrationError, match="no finite value was observed"):
            o.compute(spec(method))


def test_histograms_count_the_finite_values_only_in_the_tensors_precision() -> None:
    o = make_observer(spec("percentile"))
    o.update(np.array([1.0, np.nan, -2.0, np.inf, 3.0], np.float32))
    h = o.histogram  # type: ignore[attr-defined]
    assert h.counts.sum() == 3 and (h.data_lo, h.data_hi) == (-2.0, 3.0)
    x = RNG.standard_normal(100000).astype(np.float32)
    single, double = make_observer(spec("percentile")), make_observer(spec("percentile"))
    single.update(x), double.update(x.astype(np.float64))
    # float32 bin indices: a value on a bin edge may fall on either side, nothing else moves
    moved = np.abs(single.histogram.counts - double.histogram.counts).sum()  # type: ignore[attr-defined]
    assert moved <= 4


def test_minmax_merge_is_exact_and_histograms_merge_like_their_union() -> None:
    x = RNG.standard_normal(20000)
    a, b, whole = MinMaxObserver(), MinMaxObserver(), MinMaxObserver()
    a.update(x[:7000]), b.update(x[7000:] * 5), whole.update(np.concatenate([x[:7000], x[7000:] * 5]))
    a.merge(b)
    assert a.range(spec("minmax")) == whole.range(spec("minmax"))
    h1, h2, hw = (make_observer(spec("percentile")) for _ in range(3))
    h1.update(x[:7000]), h2.update(x[7000:] * 5), hw.update(np.concatenate([x[:7000], x[7000:] * 5]))
    h1.merge(h2)
    width = (hw.histogram.hi - hw.histogram.lo) / hw.histogram.bins  # type: ignore[attr-defined]
    for got, want in zip(h1.range(spec("percentile")), hw.range(spec("percentile")), strict=True):
        assert abs(float(got) - float(want)) <= 4 * width


def test_percentile_entropy_and_mse_clip_outliers_sensibly() -> None:
    x = RNG.standard_normal(200000)
    x[:3] = 50.0  # three wild outliers
    ranges = {}
    for method in ("minmax", "percentile", "entropy", "mse"):
        o = make_observer(
            spec(
                method,
                dtype="int8",
                symmetric=True,
                observer_options={"percentile": 99.99} if method == "percentile" else {},
            )
        )
        for chunk in np.array_split(x, 20):
            o.update(chunk)
        ranges[method] = float(o.range(spec(method, dtype="int8", symmetric=True))[1])
    assert ranges["minmax"] == 50.0
    assert 3.0 < ranges["percentile"] < 5.0  # the 99.99th percentile of |N(0,1)| is about 3.9
    assert 3.0 < ranges["entropy"] < 10.0
    assert ranges["mse"] <= 50.0


def test_entropy_is_not_pulled_down_by_the_zeros_of_a_relu() -> None:
    """Three quarters exact zeros (after a ReLU), the rest half-normal: a uint8 range from 0.

    The zeros are exact at any threshold. Counted in the divergence, their spike pulled the
    threshold to 0.27 here (MobileNetV2's ReLU6 outputs clipped to 1/8 of their range, top-1
    agreement 0.43); and [0, t] has all 256 levels, not half of them.
    """
    x = np.maximum(RNG.standard_normal(200000), 0)
    x[:100000] = 0
    o = make_observer(spec("entropy"))
    o.update(x)
    lo, hi = o.range(spec("entropy", dtype="uint8"))
    assert float(lo) == 0.0 and float(hi) > np.percentile(x[x > 0], 99.9)


def test_entropy_of_a_narrow_histogram_far_from_zero() -> None:
    # MiniLM has such tensors: |x| over [0, max] at the histogram's own bin width needed 2e15 bins
    o = make_observer(spec("entropy"))
    o.update(np.full(1000, 1.0, np.float32))
    assert o.range(spec("entropy", dtype="uint8")) == (0.0, 1.0)
    o = make_observer(spec("entropy"))
    o.update(1000.0 + RNG.random(10000))
    lo, hi = o.range(spec("entropy", dtype="uint8"))
    assert float(lo) == 0.0 and 990.0 < float(hi) <= 1001.0


def test_uniform_percentile_is_the_quantile() -> None:
    x = np.linspace(0.0, 1.0, 100001)
    o = make_observer(spec("percentile", observer_options={"percentile": 99.0}))
    o.update(x)
    lo, hi = o.range(spec("percentile"))
    assert abs(float(hi) - 0.99) < 2e-3 and abs(float(lo) - 0.01) < 2e-3


def test_users_register_their_own_method() -> None:
    class Fixed(Observer):
        def update(self, array: np.ndarray) -> None:
            pass

        def merge(self, other: Observer) -> None:
            pass

        def range(self, spec: QuantizationSpec) -> tuple[np.ndarray, np.ndarray]:
            return np.array(-1.0), np.array(1.0)

    register_method("unit_range", lambda spec, axis: Fixed())
    s = QuantizationSpec("int8", True, observer="unit_range")
    t = make_observer(s).compute(s)
    assert isinstance(t, UniformQuantizedType) and t.scale == float(np.float32(1 / 127.5))


def test_histogram_rules_count_the_levels_a_reduced_range_leaves() -> None:
    # 7-bit storage has half the levels: coarser steps make the MSE search clip harder, and the
    # computed type keeps the reduced bounds
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    ranges = {}
    for reduced in (False, True):
        spec = QuantizationSpec("uint8", observer="mse", reduce_range=reduced)
        observer = make_observer(spec)
        observer.update(x)
        ranges[reduced] = observer.range(spec)
        t = observer.compute(spec)
        assert isinstance(t, UniformQuantizedType) and t.storage_max == (127 if reduced else 255)
    assert ranges[True][1] < ranges[False][1] - 0.2 and ranges[True][0] > ranges[False][0] + 0.2


def test_mean_minmax_averages_each_samples_extremes_and_merges_exactly() -> None:
    """NNCF's MEAN_MINMAX: one wide sample among four moves the range by a quarter of its excess."""
    samples = [np.array([-1.0, 0.5, 2.0]), np.array([-1.0, 2.0]), np.array([0.0, 2.0, np.nan]), np.array([-1.0, 10.0])]
    whole = make_observer(spec("mean_minmax"))
    for s in samples:
        whole.update(s.astype(np.float32))
    assert whole.range(spec("mean_minmax")) == (-0.75, 4.0)
    first, second = make_observer(spec("mean_minmax")), make_observer(spec("mean_minmax"))
    for s in samples[:1]:
        first.update(s)
    for s in samples[1:]:
        second.update(s)
    first.merge(second)
    assert first.range(spec("mean_minmax")) == (-0.75, 4.0)
    assert not whole.batchable  # the runner must give it one sample per update
    empty = make_observer(spec("mean_minmax"))
    empty.update(np.array([np.nan]))
    with pytest.raises(CalibrationError, match="no finite value"):
        empty.range(spec("mean_minmax"))


def test_histogram_counts_are_the_same_through_torch_and_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch (loaded when a torch model is calibrated) counts the bins: its float32 subtraction and product must
    # put every value, those on bin edges too, in numpy's bin, or a histogram would depend on what is imported
    pytest.importorskip("torch")
    from requant.calibration.observers import _bin_counts

    rng = np.random.default_rng(3)
    for trial in range(60):
        values = (rng.standard_normal(int(rng.integers(1, 4000))) * 10.0 ** rng.uniform(-6, 6)).astype(np.float32)
        if trial % 2:
            values = np.round(values * 8) / 8  # many values exactly on bin edges
        lo, hi = float(values.min()), float(values.max())
        per_unit = 2048 / max(hi - lo, 1e-12)
        scaled = (values - np.float32(lo)) * np.float32(per_unit)
        expected = np.bincount(scaled.astype(np.intp), minlength=2049)
        assert np.array_equal(_bin_counts(values, lo, per_unit, 2049), expected)
        monkeypatch.delitem(sys.modules, "torch")
        assert np.array_equal(_bin_counts(values, lo, per_unit, 2049), expected)
        monkeypatch.undo()
