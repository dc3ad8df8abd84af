"""Smoothing: move the outlier channels of a linear layer's input into its weight (SmoothQuant).

A linear layer ``Y = X W`` computes the same with ``X' = X / s`` and ``W' = diag(s) W`` for any
positive ``s`` per input channel (Xiao et al., "SmoothQuant", 2023). A transformer's linear inputs
have a few channels tens of times larger than the rest; with one scale per tensor, those channels
set the step and the others keep a few levels. With

    s_k = max|X_k| ** alpha / max|W_k| ** (1 - alpha)

(``max|X_k|`` over the calibration data, ``max|W_k|`` over the weight's row ``k`` of every linear
layer reading ``X``), the input's channels are evened out and the weight's rows take the
difference, which per-output-channel weight scales absorb better than a per-tensor activation
scale absorbs it.

The float model computes the same numbers (up to float32 rounding). ``1 / s`` is applied:

- folded into the ``LayerNormalization`` that produces ``X`` (its scale and bias), when the linear
  layers are all that read ``X``: no extra node;
- otherwise by a ``Mul`` before the linear layers (other readers of ``X`` still read ``X``): a
  float node the quantizers must keep float (:func:`smooth_linears` returns their names), a few
  microseconds per layer.

An LSTM's input weights (``[directions, 4 x hidden, input]``) are a linear layer of its input too; ONNX
Runtime's int8 LSTM quantizes that input over each run's own range, so its alpha is chosen apart
(:func:`lstm_alpha`: of ``LSTM_ALPHAS`` and the run's, the one closest for that kernel).

Measured (all-MiniLM-L6-v2, 200 calibration / 298 evaluation sentences, cosine of the embeddings
against float): 0.9931 without, 0.9979 with ``alpha`` 0.8 (0.9975 at 0.7, 0.9976 at 0.9, 0.9972 at
0.95, 0.9893 at 0.5); NNCF 3.4 (``model_type=TRANSFORMER``, which smooths too): 0.9977.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.observers import MinMaxObserver
from requant.calibration.runner import Kept, Progress, collect
from requant.calibration.samples import iter_samples
from requant.ir.queries import constant, fresh_name, graph_values, weighted_layers
from requant.passes._rewrite import new_initializer

__all__ = [
    "DEFAULT_ALPHA",
    "FLOATS",
    "Smoothed",
    "Smoothing",
    "channel_spread",
    "linear_groups",
    "lstm_alpha",
    "smooth_linears",
    "smoothing_factors",
]

DEFAULT_ALPHA = 0.8
# An input that needs a float Mul is smoothed when its largest channel range is at least this many
# times its median one. MiniLM: its 24 inputs measured 2.1x-17x; the six of 2.1x-4.1x (attention
# outputs) gained nothing (cosine 0.99808 all, 0.99807 without the five below 3x), and each Mul costs
# a few microseconds (1 % of a 64-token run).
MIN_SPREAD = 3.0
LSTM_ALPHAS = (0.5, 0.65)  # an LSTM's input: tried beside the run's alpha (:func:`lstm_alpha`)
LSTM_BYTES = 16 << 20  # an LSTM's input lstm_alpha measures on: the first runs' (4,096 rows of 1,024 channels)
FLOATS = (ir.DataType.FLOAT,)  # weights requant rescales (float16 models are computed in float32 first)


@dataclass(frozen=True)
class Smoothed:
    """One activation read by linear layers: what was done (``applied``), or why not (``skipped``).

    ``spread_before`` / ``spread_after``: the largest channel range of the input over its median
    channel range, before and after (1.0 is flat)."""

    input: str
    linears: list[str]
    applied: str | None = None
    skipped: str | None = None
    channels: int = 0
    spread_before: float = 0.0
    spread_after: float = 0.0
    alpha: float | None = None  # where it differs from the run's: an LSTM's input (:func:`lstm_alpha`)


@dataclass(frozen=True)
class Smoothing:
    """What smoothing did: a record per linear-layer input, the float ``Mul`` nodes it added (the
    quantizers keep them float), or why the model was not smoothed at all (``not_applied``)."""

    inputs: list[Smoothed]
    muls: list[str]
    not_applied: str | None = None


@dataclass(frozen=True)
class _Linear:
    node: ir.Node
    weight: ir.Value
    axis: int  # the weight's input-channel axis: 0 for X @ W, 1 for a Gemm with transB
    channels: int  # its size on that axis


def _linear(node: ir.Node) -> _Linear | None:
    """``node`` as a linear layer with a constant float weight, reading its activation on input 0: a MatMul or
    Gemm (a 2-d weight), or an LSTM's input weights (``[directions, 4 x hidden, input]``, sequence-first: the
    layout ONNX Runtime's int8 LSTM has)."""
    lstm = node.op_type == "LSTM" and not node.attributes.get_int("layout", 0)
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "LSTM") or len(node.inputs) < 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or constant(x) is not None or constant(w) is None or not w.is_initializer():
        return None
    if w.dtype not in FLOATS or w.shape is None or w.shape.rank() != (3 if lstm else 2):
        return None
    if node.op_type == "LSTM":
        return _Linear(node, w, 2, w.const_value.shape.numpy()[2]) if lstm and w.const_value is not None else None
    axis = 0
    if node.op_type == "Gemm":
        if node.attributes.get_int("transA", 0):
            return None
        axis = 1 if node.attributes.get_int("transB", 0) else 0
    assert w.const_value is not None  # an initializer with data (constant() above)
    return _Linear(node, w, axis, w.const_value.shape.numpy()[axis])


def linear_groups(graph: ir.Graph) -> dict[ir.Value, list[_Linear]]:
    """The linear layers by the activation they read, in graph order."""
    groups: dict[ir.Value, list[_Linear]] = {}
    for node in graph:
        found = _linear(node)
        if found is not None:
            groups.setdefault(node.inputs[0], []).append(found)  # type: ignore[arg-type]
    return groups


def _why_not(x: ir.Value, linears: list[_Linear]) -> str | None:
    nodes = {id(li.node) for li in linears}
    for li in linears:
        others = [u.node for u in li.weight.uses() if id(u.node) not in nodes]
        if others:
            return f"its weight '{li.weight.name}' is also read by node '{others[0].name}'"
    sizes = {li.channels for li in linears}
    if len(sizes) != 1:
        return f"its linear layers disagree on the number of input channels ({sorted(sizes)})"
    if x.dtype is not None and x.dtype not in FLOATS:  # (unknown: float32, as its weight is)
        return f"it is {x.dtype}, not float32"
    return None


def channel_spread(ranges: npt.NDArray[np.float64]) -> float:
    """The largest channel range over the median one (1.0 is even; infinite when the median is 0)."""
    median = float(np.median(ranges))
    return float(ranges.max() / median) if median > 0 else math.inf


def smoothing_factors(
    act: npt.NDArray[np.float64], wmax: npt.NDArray[np.float64], alpha: float
) -> npt.NDArray[np.float64]:
    """``s_k = max|X_k| ** alpha / max|W_k| ** (1 - alpha)`` per input channel (1 where either is 0 or not
    finite), in [1e-5, 1e5]."""
    live = np.isfinite(act) & (act > 0) & (wmax > 0)
    s = np.ones_like(act)
    s[live] = np.clip(act[live] ** alpha / wmax[live] ** (1 - alpha), 1e-5, 1e5)
    return s


def evened(
    act: npt.NDArray[np.float64], wmax: npt.NDArray[np.float64], alpha: float
) -> tuple[npt.NDArray[np.float64], float, float]:
    """:func:`smoothing_factors` for input channel maxima ``act`` (a non-finite one counts as 0) and weight
    maxima ``wmax``, and the input's :func:`channel_spread` before and after."""
    s = smoothing_factors(act, wmax, alpha)
    finite = np.where(np.isfinite(act), act, 0.0)
    return s, channel_spread(finite), channel_spread(finite / s)


def smooth_linears(
    model: ir.Model,
    data: Any,
    alpha: float = DEFAULT_ALPHA,
    progress: Progress | None = None,
    ranges: dict[str, MinMaxObserver] | None = None,
    min_spread: float = MIN_SPREAD,
) -> Smoothing:
    """Smooth every linear layer's input in ``model`` (float, changed in place) over ``data``, when
    it has more linear layers than convolutions (a transformer, an MLP: on MobileNetV2's and
    EfficientNet-Lite0's one classifier it gained nothing and cost a float pass over the data).

    ``ranges``: channel ranges of earlier runs by value name (reused, and filled with new ones).
    ``min_spread``: an input that needs a float ``Mul`` is smoothed only when its largest channel
    range is at least this many times its median one.
    """
    graph = model.graph
    linear, convs = weighted_layers(graph)
    if linear <= convs:
        return Smoothing([], [], f"a convolutional model ({convs} convolutions, {linear} linear layers): "
                                 "only models with more linear layers than convolutions are smoothed")  # fmt: skip
    groups = linear_groups(graph)
    records: list[Smoothed] = []
    usable: dict[ir.Value, list[_Linear]] = {}
    for x, linears in groups.items():
        reason = _why_not(x, linears)
        if reason is None:
            usable[x] = linears
        else:
            records.append(Smoothed(str(x.name), [str(li.node.name) for li in linears], skipped=reason))
    ranges = {} if ranges is None else ranges
    fresh = {str(x.name): MinMaxObserver(axis=-1) for x in usable if str(x.name) not in ranges}
    if fresh:
        collect(model, data, fresh, progress)
        ranges.update(fresh)
    taken = {v.name for v in graph_values(graph)} | {n.name for n in graph}
    muls: list[str] = []
    kept = _lstm_inputs(model, data, [x for x, ls in usable.items() if any(li.node.op_type == "LSTM" for li in ls)])
    for x, linears in usable.items():
        records.append(_smooth(graph, x, linears, ranges[str(x.name)], alpha, min_spread, taken, muls, kept))
    return Smoothing(records, muls)


def _smooth(graph: ir.Graph, x: ir.Value, linears: list[_Linear], observer: MinMaxObserver, alpha: float,
            min_spread: float, taken: set[str | None], muls: list[str],
            kept: dict[str, list[Any]]) -> Smoothed:  # fmt: skip
    """Smooth the input ``x`` of ``linears`` (see :func:`smooth_linears`); the record. ``kept``: an LSTM's input
    values, by name, where its factors' alpha is chosen (:func:`lstm_alpha`)."""
    names = [str(li.node.name) for li in linears]
    if observer.lo is None or observer.hi is None:
        return Smoothed(str(x.name), names, skipped="no finite value was observed")
    act = np.fmax(np.abs(observer.lo), np.abs(observer.hi)).astype(np.float64)
    weights = [constant(li.weight) for li in linears]
    wmax = np.max([np.abs(np.moveaxis(np.asarray(w, np.float64), li.axis, 0)).reshape(li.channels, -1).max(1)
                   for w, li in zip(weights, linears, strict=True)], axis=0)  # fmt: skip
    if act.shape != wmax.shape:
        return Smoothed(str(x.name), names, skipped=f"its last axis has {act.size} channels, its weights {wmax.size}")
    lstm = next((w for w, li in zip(weights, linears, strict=True) if li.node.op_type == "LSTM"), None)
    chosen = lstm_alpha(kept[str(x.name)], np.asarray(lstm), act, wmax, alpha) if str(x.name) in kept else None
    s, before, after = evened(act, wmax, alpha if chosen is None else chosen)
    norm = _norm_parameters(x, linears, s)
    if norm is None and before < min_spread:
        why = f"its largest channel is {before:.1f}x its median one (a float Mul pays from {min_spread:g}x)"
        return Smoothed(str(x.name), names, None, why, int(act.size), before, before)
    for li, w in zip(linears, weights, strict=True):
        shape = [1] * np.ndim(np.asarray(w))
        shape[li.axis] = -1
        scaled = (np.asarray(w, np.float64) * s.reshape(shape)).astype(np.float32)
        li.weight.const_value = ir.Tensor(scaled, name=li.weight.name)
    if norm is not None:
        node, params = norm
        for p in params:
            p.const_value = ir.Tensor((np.asarray(constant(p), np.float64) / s).astype(np.float32), name=p.name)
        applied = f"folded into LayerNormalization '{node.name}' (its scale and bias)"
    else:
        muls.append(_insert_mul(graph, x, linears, s, taken))
        applied = f"Mul '{muls[-1]}' before the linear layers"
    return Smoothed(str(x.name), names, applied, None, int(act.size), before, after, chosen)


def _lstm_inputs(model: ir.Model, data: Any, inputs: list[ir.Value]) -> dict[str, list[Any]]:
    """The LSTMs' inputs' values on the first samples of ``data`` (one array per run), by name: runs until each
    has ``LSTM_BYTES`` (:class:`~requant.calibration.runner.Kept`), not over the whole data set."""
    if not inputs:
        return {}
    observers = {str(x.name): Kept(LSTM_BYTES) for x in inputs}
    until_full = itertools.takewhile(lambda _: not all(o.full for o in observers.values()), iter_samples(model, data))
    collect(model, until_full, observers, stack=False)
    return {name: o.arrays for name, o in observers.items()}


def lstm_alpha(runs: list[Any], weight: Any, act: Any, wmax: Any, alpha: float) -> float:
    """The alpha among ``LSTM_ALPHAS`` and ``alpha`` whose factors give the LSTM's input product ``X W^T``
    closest to float over ``runs`` (each ``[..., input]``) as ONNX Runtime's int8 LSTM computes it: the input
    on uint8 steps over each run's own range, the weight ``[directions, 4 x hidden, input]`` on int8 steps per
    gate row. An LSTM's input is quantized per run, not over a calibrated range, so the alpha that suits a
    transformer's linear layers need not suit it (DTLN's spectrum: 33.7 dB at 0.8, 35.3 at 0.65)."""
    w = np.asarray(weight, np.float64).reshape(-1, weight.shape[-1])
    runs = [np.asarray(r, np.float64).reshape(-1, r.shape[-1]) for r in runs]
    exact = [r @ w.T for r in runs]
    errors = {}
    for a in sorted({alpha, *LSTM_ALPHAS}, reverse=True):
        s = smoothing_factors(act, wmax, a)
        ws = w * s
        step = np.abs(ws).max(axis=1, keepdims=True) / 127
        wq = np.round(ws / np.where(step > 0, step, 1)) * step
        errors[a] = sum(float(np.square(_dynamic_uint8(r / s) @ wq.T - e).sum())
                        for r, e in zip(runs, exact, strict=True))  # fmt: skip
    return min(errors, key=lambda a: (errors[a], -a))


def _dynamic_uint8(x: Any) -> Any:
    """``x`` on uint8 steps over its own range (with 0), as ONNX Runtime's dynamic quantization rounds it."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    step = (hi - lo) / 255 if hi > lo else 1.0
    zero = np.round(-lo / step)
    return (np.clip(np.round(x / step) + zero, 0, 255) - zero) * step


def _norm_parameters(
    x: ir.Value, linears: list[_Linear], s: npt.NDArray[np.float64]
) -> tuple[ir.Node, list[ir.Value]] | None:
    """The LayerNormalization producing ``x`` and its scale and bias, when ``1 / s`` can be folded into
    them: only ``linears`` read ``x``, and they are the normalization's own 1-d float constants."""
    norm = x.producer()
    readers = {id(li.node) for li in linears}
    if norm is None or norm.op_type != "LayerNormalization" or norm.domain not in ("", "ai.onnx"):
        return None
    # (its other outputs, the mean and inverse deviation, do not depend on its scale and bias)
    if x is not norm.outputs[0] or x.is_graph_output() or any(id(u.node) not in readers for u in x.uses()):
        return None
    params = [v for v in norm.inputs[1:3] if v is not None]
    for p in params:
        data = constant(p)
        if data is None or not p.is_initializer() or data.shape != s.shape or len(p.uses()) != 1:
            return None
        if p.dtype not in FLOATS:
            return None
    return norm, params


def _insert_mul(
    graph: ir.Graph, x: ir.Value, linears: list[_Linear], s: npt.NDArray[np.float64], taken: set[str | None]
) -> str:
    """Insert ``Mul(x, 1 / s)`` before the linear layers, which read it instead of ``x``; its name."""
    base = str(x.name)
    factor = new_initializer(graph, f"{base}/smoothing", (1.0 / s).astype(np.float32))
    taken.add(factor.name)
    out = ir.Value(name=fresh_name(f"{base}/smoothed", taken), shape=x.shape, type=x.type)
    mul = ir.Node("", "Mul", [x, factor], outputs=[out], name=fresh_name(f"{base}/smooth", taken))
    graph.insert_before(linears[0].node, mul)
    for li in linears:
        li.node.replace_input_with(0, out)
    return str(mul.name)
