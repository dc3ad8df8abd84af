"""Calibrate: turn every ``QuantizationSpec`` request into a ``!quant.uniform`` type.

Weights (initializers) are measured directly from their data; activations by running the float
model over the calibration data (:mod:`requant.calibration.runner`). The chosen type goes on the
value as its annotation; the returned records say which observer chose it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.moments import MOMENTS_KEY, InputMoments, Patches, measured_kernel
from requant.calibration.observers import CalibrationError, MinMaxObserver, Observer, make_observer, observe
from requant.calibration.runner import Kept, Progress, collect
from requant.errors import QuantTypeError
from requant.ir.annotations import element_name, request, set_parameter_type, set_quant_type
from requant.ir.queries import graph_values
from requant.ir.requests import QuantizationSpec, SharedSpec
from requant.targets.stem import behind
from requant.types import UniformType, from_range

__all__ = [
    "STEM_METHOD",
    "STEM_PERCENTILE",
    "Calibrated",
    "StatisticsCache",
    "calibrate",
    "fine_maps",
    "near_outputs",
    "weight_type",
]

# method "stem_percentile" (what method="auto" calibrates a detector with, requant.stages.choose): the
# percentile method, its fine maps (:func:`fine_maps`) at this percentile. On 64 photo crops (molecule
# drawings for ABD-model), judged on 60 others, recall / precision / corner shift against float's
# detections (bench/bench_zoo.py's YOLO exports): ABD-model 0.27 / 0.64 / 3.10 px at 99.999 everywhere,
# 0.86 / 0.84 / 1.46 px so; tau_obb 0.25 / 0.66 / 2.10 -> 0.69 / 0.70 / 1.73 (docs/benchmarks.md)
STEM_METHOD = "stem_percentile"
STEM_PERCENTILE = 99.99
KEPT_OUTPUT_BYTES = 64 << 20  # the float outputs a cache keeps (a prefix of the samples: 22 of the detector's maps)


@dataclass(frozen=True)
class Calibrated:
    """Which type a value got, and how."""

    value: str
    type: UniformType  # printed when the report is written (a per-channel type's text takes ~10 us a scale)
    observer: str
    kind: str  # "weight" or "activation"
    seen: dict[str, Any] | None = None  # what calibration observed (activations): range, histogram

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "type": str(self.type)}


def weight_type(
    data: npt.NDArray[Any], spec: QuantizationSpec, expressed: str, name: str, reader: str | None = None
) -> UniformType:
    """The type for constant ``data`` (min/max over the spec's granularity); ``reader``: the node that
    reads it, for errors."""
    values = np.asarray(data, dtype=np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if np.isnan(values[first]) else "infinite"
        read = f" (read by node '{reader}')" if reader else ""
        raise CalibrationError(
            f"weight '{name}'{read} holds {int(bad.sum())} non-finite value(s), the first {what} at index "
            f"{list(first)}: the float model itself computes NaN or infinity there; fix its weights"
        )
    flags = spec.range_flags
    try:
        if spec.granularity == "per_tensor":
            return from_range(values.min(initial=0.0), values.max(initial=0.0), spec.storage, expressed, **flags)
        axis = spec.axis if spec.axis is not None and spec.axis >= 0 else values.ndim + (spec.axis or 0)
        if spec.granularity == "per_axis":
            moved = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
            return from_range(moved.min(1), moved.max(1), spec.storage, expressed, axis=axis, **flags)
        block = spec.block_size or 1
        if values.shape[axis] % block:
            raise CalibrationError(
                f"weight '{name}': its size {values.shape[axis]} on axis {axis} "
                f"is not a multiple of the block size {block}"
            )
        grid = list(values.shape)
        grid[axis] //= block
        blocked = values.reshape(*values.shape[:axis], grid[axis], block, *values.shape[axis + 1 :])
        lo, hi = blocked.min(axis=axis + 1), blocked.max(axis=axis + 1)
        sizes = {i: (block if i == axis else 1) for i in range(values.ndim)}
        return from_range(lo, hi, spec.storage, expressed, block_sizes=sizes, **flags)
    except QuantTypeError as exc:
        raise CalibrationError(f"weight '{name}': {exc}") from None


@dataclass
class StatisticsCache:
    """The observers of earlier calibrations of one model and data set, by value name and spec; the
    weights' types, by tensor, name and spec; the channel ranges smoothing measured, by value name;
    and the float model's first output on the first samples, when a probe kept it."""

    observers: dict[tuple[str, QuantizationSpec], Observer] = dataclasses.field(default_factory=dict)
    weights: dict[tuple[int, str, QuantizationSpec], UniformType] = dataclasses.field(default_factory=dict)
    samples: int = 0
    channels: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the second moments of kernels' inputs (weight rounding), by input name, patches and reduction length
    moments: dict[tuple[str, Patches, int], InputMoments] = dataclasses.field(default_factory=dict)
    # the float model's first output on the first samples, where a probe ran them anyway (equalization's):
    # method="auto" compares its candidates' outputs with them (PP-OCRv4's detector: 8 float runs, ~1 s)
    outputs: Kept = dataclasses.field(default_factory=lambda: Kept(KEPT_OUTPUT_BYTES))


class _Fanout(Observer):
    """Several observers of one tensor fed in the same pass (each keeps its own statistics; the array's
    extremes found once for all, :func:`~requant.calibration.observers.observe`)."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers
        self.batchable = all(o.batchable for o in observers)

    def update(self, array: Any) -> None:
        observe(self.observers, array)


class Stem(NamedTuple):
    """What ``stem_percentile`` calibrates apart, by value name: a CNN's fine maps (:func:`fine_maps`), at
    ``STEM_PERCENTILE``, and the values an output is computed from without a kernel between
    (:func:`near_outputs`), at ``minmax`` as the outputs themselves."""

    fine: frozenset[str] = frozenset()
    near_outputs: frozenset[str] = frozenset()


NO_STEM = Stem()


def _activation_spec(
    value: ir.Value, requested: QuantizationSpec, method: str | None, stem: Stem = NO_STEM
) -> QuantizationSpec:
    """The spec an activation is observed with: ``method``'s observer, except at the model's own inputs
    and outputs, observed over their whole range (minmax) whatever the method. ``stem_percentile`` is the
    percentile observer, with the values of ``stem`` apart."""
    spec = requested
    if method == STEM_METHOD and value.name in stem.near_outputs:
        spec = dataclasses.replace(requested, observer="minmax", observer_options={})
    elif method == STEM_METHOD:
        options = {"percentile": STEM_PERCENTILE} if value.name in stem.fine else {}
        spec = dataclasses.replace(requested, observer="percentile", observer_options=options)
    elif method is not None and method != requested.observer:  # the config's options were its observer's
        spec = dataclasses.replace(requested, observer=method, observer_options={})
    if (value.is_graph_output() or value.is_graph_input()) and spec.observer != "minmax":
        spec = dataclasses.replace(spec, observer="minmax", observer_options={})
    return spec


def near_outputs(graph: ir.Graph) -> frozenset[str]:
    """The names of the values the model's outputs are computed from without a kernel (a convolution or a
    matrix product) between, the kernels' outputs included (:func:`requant.targets.stem.behind`): a detector's
    class logits before their Sigmoid, whose rare large values are the detections (YOLO11n-seg's, clipped at the
    99.999th percentile, fell below the threshold everywhere: no detection on 60 photo crops)."""
    return behind(graph)


def fine_maps(graph: ir.Graph) -> frozenset[str]:
    """The names of the 4-d values whose height and width are each at least a quarter of the model's image
    input's (static shapes only; NCHW or NHWC input): a CNN's first stages, whose edge responses are sparse
    and large (ABD-model's second convolution: |x| 0.24 at the median, 457 at most, on molecule drawings)."""
    sides = []
    for x in graph.inputs:
        shape = x.shape.dims if x.shape is not None and len(x.shape) == 4 else ()
        dims = [d for d in shape[1:] if isinstance(d, int)]
        if len(dims) == 3:
            sides.append(sorted(dims)[1:])  # the two larger: NCHW or NHWC
    if not sides:
        return frozenset()
    low, high = max(sides, key=lambda s: s[0] * s[1])
    fine = set()
    for value in graph_values(graph):
        shape = value.shape.dims if value.shape is not None and len(value.shape) == 4 else ()
        spatial = [d for d in shape[2:] if isinstance(d, int)]
        if len(spatial) == 2:
            h, w = sorted(spatial)
            if 4 * h >= low and 4 * w >= high:
                fine.add(str(value.name))
    return frozenset(fine)


def _new_observer(spec: QuantizationSpec) -> Observer:
    return MinMaxObserver(spec.axis) if spec.granularity != "per_tensor" else make_observer(spec)


def _check_not_constant(value: ir.Value, observer: Observer, count: int) -> None:
    """A model input that holds one value in every calibration sample (blank or unloaded images, a
    placeholder array) gives its quantization a range of one point, onto which every real input
    would round: an error naming it. (A constant tensor inside the model is fine: a dead channel.)"""
    shown = observer.seen() if value.is_graph_input() else None
    if shown is None or shown["observed"][0] != shown["observed"][1]:
        return
    samples = f"every one of its {count} samples" if count > 1 else "its only sample"
    raise CalibrationError(
        f"calibration input '{value.name}' holds one value ({shown['observed'][0]:g}) in {samples}: its "
        "quantization range would be that one point, and every real input would round onto it (blank or "
        "unloaded images?): give samples of real inputs"
    )


def _kernel_moments(graph: ir.Graph, cache: StatisticsCache, fresh: dict[str, Observer]) -> dict[ir.Node, InputMoments]:
    """An :class:`InputMoments` for the input of each dense kernel whose weight and input are
    quantized (from ``cache``, or new: then fed with the other observers of the input, in ``fresh``)."""
    found = {}
    for node in graph:
        measured = measured_kernel(node)
        x = node.inputs[0] if measured is not None else None
        if measured is None or x is None or x.const_value is not None:
            continue
        wanted, weight = request(x), request(node.inputs[1])  # type: ignore[arg-type]  # measured_kernel checked it
        # the input quantized (observed, or sharing its producer's type: a Pad's), and the weight
        if not isinstance(wanted, QuantizationSpec | SharedSpec) or not isinstance(weight, QuantizationSpec):
            continue
        patches, reduction = measured
        key = (str(x.name), patches, reduction)
        moments = cache.moments.get(key)
        if moments is None:
            moments = cache.moments[key] = InputMoments(patches, reduction)
            name = str(x.name)
            if name not in fresh:
                fresh[name] = moments
            elif isinstance(fresh[name], _Fanout):
                fresh[name] = _Fanout([*fresh[name].observers, moments])  # type: ignore[attr-defined]
            else:
                fresh[name] = _Fanout([fresh[name], moments])
        found[node] = moments
    return found


def _weight(value: ir.Value, r: QuantizationSpec, cache: StatisticsCache | None) -> Calibrated:
    """A constant's type (min/max; from ``cache`` when an earlier calibration measured it), set on it."""
    assert value.const_value is not None
    key = (id(value.const_value), str(value.name), r)  # clones share their tensors
    t = cache.weights.get(key) if cache is not None else None
    if t is None:
        reader = next((str(u.node.name) for u in value.uses()), None)
        expressed = element_name(value.dtype) or "f32"
        t = weight_type(value.const_value.numpy(), r, expressed, str(value.name), reader)
        if cache is not None:  # the next candidate gets the same object
            cache.weights[key] = t
    set_parameter_type(value, t)  # a per-channel type's text is not printed (~10 us a scale)
    return Calibrated(str(value.name), t, "minmax", "weight")


def calibrate(
    model: ir.Model,
    data: Any,
    method: str | None = None,
    progress: Progress | None = None,
    cache: StatisticsCache | None = None,
    also: tuple[str, ...] = (),
) -> list[Calibrated]:
    """Annotate every value that asks for a ``QuantizationSpec`` with its calibrated type.

    ``method`` replaces the observer of activation requests (weights always use min/max).
    ``cache`` (filled here): a value asking what it asked in an earlier calibration of the same
    model and data is not observed again, and when none is new the data is not run at all.
    ``also``: other methods whose statistics go into ``cache`` from the same pass over the data (a
    later calibration with one of them then runs nothing).
    """
    graph = model.graph
    records: list[Calibrated] = []
    pending: dict[str, tuple[ir.Value, QuantizationSpec, Observer]] = {}
    fresh: dict[str, Observer] = {}
    values = graph_values(graph)
    stem = Stem(fine_maps(graph), near_outputs(graph)) if STEM_METHOD in (method, *also) else NO_STEM
    for value in values:
        r = request(value)
        if not isinstance(r, QuantizationSpec):
            continue
        if value.const_value is not None:
            records.append(_weight(value, r, cache))
            continue
        spec = _activation_spec(value, r, method, stem)
        name = str(value.name)
        observer = cache.observers.get((name, spec)) if cache is not None else None
        if observer is None:  # not observed in an earlier calibration: observed now
            observer = fresh[name] = _new_observer(spec)
            if cache is not None:
                others: dict[QuantizationSpec, Observer] = {}
                for other in (_activation_spec(value, r, m, stem) for m in also):
                    if other != spec and other not in others and (name, other) not in cache.observers:
                        others[other] = _new_observer(other)
                cache.observers.update({(name, s): o for s, o in others.items()})
                fresh[name] = _Fanout([observer, *others.values()]) if others else observer
        pending[name] = (value, spec, observer)
    kernels = _kernel_moments(graph, cache, fresh) if cache is not None else {}
    # every ONNX Runtime rewrite (NCHWc float convs; the observed values stay outputs, so nothing they
    # are is fused away): EfficientNet-Lite0 15.8 -> 10.5 ms a sample, its extremes differing from the
    # unoptimized model's in the last float digits only (float sums in another order)
    count = collect(model, data, fresh, progress, optimize=True) if fresh or cache is None else cache.samples
    for node, moments in kernels.items():
        node.meta[MOMENTS_KEY] = moments
    if cache is not None:
        cache.observers.update({(name, spec): obs for name, (_, spec, obs) in pending.items()})
        cache.samples = count
    for name, (value, spec, observer) in pending.items():
        _check_not_constant(value, observer, count)
        try:
            t = observer.compute(spec, element_name(value.dtype) or "f32")
        except (CalibrationError, QuantTypeError) as exc:
            raise CalibrationError(f"value '{name}' after {count} samples: {exc}") from None
        set_quant_type(value, t)
        records.append(Calibrated(name, t, spec.observer, "activation", observer.seen()))
    return records
