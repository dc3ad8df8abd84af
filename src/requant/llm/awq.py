"""Activation-aware per-input scales (Lin et al., "AWQ", 2023), searched on the layers' input moments.

A linear layer computes the same ``x W = (x / s) (diag(s) W)`` for any positive ``s`` (one per input): its inputs
of large magnitude, whose weights' rounding errors cost the output most, get their weights scaled up, a finer
share of their blocks' steps; ``1 / s`` is folded into what makes the input, so the model computes what it did.
The layers reading one value share its ``s`` (a *group*); what makes it decides where ``1 / s`` goes
(:data:`FOLDS`):

- a normalization's output (``SimplifiedLayerNormalization``, ``SkipSimplifiedLayerNormalization``,
  ``LayerNormalization``; the input layer norm before ``qkv_proj``, the post-attention one before ``gate_proj``
  and ``up_proj``): its scale (and bias) divided by ``s``;
- a ``Mul`` of a linear layer's output (``up_proj``'s times the gate's, before ``down_proj``): that layer's
  weight's columns divided by ``s``.

Any other group (the attention's output before ``o_proj``; a layer tied to an embedding, whose table the
``GatherBlockQuantized`` reads) keeps ``s = 1``.

The search, on each group's moments ``H = sum x x^T`` alone: ``s = a^alpha`` (normalized to a geometric mean
of 1 between its extremes, as AWQ does) for ``a`` the root mean square of each input (``sqrt(diag(H))``) and
``alpha`` on a grid from 0 (no scaling) to 1; each ``s`` scored by the group's output error
``trace(E^T H E)`` with ``E = diag(1/s) Q(diag(s) W) - W`` and ``Q`` rounding to nearest in the layer's blocks
(AWQ's search; scored on at most :data:`OUTPUTS` of each layer's outputs, every n-th). The least error's ``s`` is
applied: the group's weights scaled, its moments ``H / (s s^T)``;
then each layer's rounding is chosen as for any layer (:mod:`requant.llm.rounding`), on the scaled weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.llm.blocks import BlockFormat, padded_rows
from requant.llm.memory import on_disk

__all__ = ["ALPHAS", "FOLDS", "Group", "ScaleSearch", "groups"]

Array = npt.NDArray[Any]
ALPHAS = tuple(float(a) for a in np.round(np.linspace(0, 1, 11), 2))  # AWQ's grid has 20 points
SMALLEST = 1e-4  # an input's magnitude at least this fraction of the largest (one never seen: s not 0)
# the outputs the search scores, at most (every n-th of a wider layer): each output's error is its own, the sum
# over a fair share of them ranks the alphas as the whole does (SmolLM2: the same perplexity, search 11 -> 5 s)
OUTPUTS = 512

# what makes a group's input -> the indices of its inputs divided by s (a normalization's scale and bias)
FOLDS = {
    ("", "LayerNormalization"): (1, 2),
    ("", "SimplifiedLayerNormalization"): (1,),
    ("com.microsoft", "SimplifiedLayerNormalization"): (1,),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2,),
}


@dataclass
class Group:
    """The linear layers reading one value (node names, in graph order) and where ``1 / s`` folds: the
    initializers to divide (``rows``: a normalization's scale and bias; ``columns``: a linear weight's columns)."""

    layers: list[str]
    into: str
    rows: list[ir.Value]
    columns: ir.Value | None


def _initializer_of_one(value: ir.Value | None) -> bool:
    return value is not None and value.is_initializer() and value.const_value is not None and len(value.uses()) == 1


def _fold(value: ir.Value, by_output: Mapping[int, tuple[str, ir.Value]]) -> tuple[str, list[ir.Value],
                                                                                  ir.Value | None] | None:  # fmt: skip
    """Where ``1 / s`` of a group reading ``value`` folds (see :data:`FOLDS`; ``by_output``: each linear layer's
    name and weight by the ``id`` of its output), or None."""
    maker = value.producer()
    if maker is None or value.index() != 0:
        return None
    indices = FOLDS.get((maker.domain or "", maker.op_type))
    if indices is not None:
        params = [maker.inputs[i] for i in indices if i < len(maker.inputs) and maker.inputs[i] is not None]
        if params and all(_initializer_of_one(p) for p in params):
            return str(maker.name), [p for p in params if p is not None], None
        return None
    if maker.op_type == "Mul" and maker.domain in ("", "ai.onnx"):
        for side in maker.inputs:
            found = by_output.get(id(side)) if side is not None else None
            if found is not None and len(side.uses()) == 1 and _initializer_of_one(found[1]):  # type: ignore[union-attr]
                return found[0], [], found[1]
    return None


def groups(linear: Mapping[str, tuple[ir.Node, ir.Value]], rounded: set[str]) -> list[Group]:
    """The groups of ``linear`` layers (:func:`~requant.llm.nbits.linear_weights`) whose input's ``1 / s`` can be
    folded: every reader of the value a layer in ``rounded`` (not tied, at least a block long)."""
    readers: dict[int, list[str]] = {}
    values: dict[int, ir.Value] = {}
    for name, (node, _) in linear.items():
        x = node.inputs[0]
        if x is not None:
            readers.setdefault(id(x), []).append(name)
            values[id(x)] = x
    by_output = {id(node.outputs[0]): (name, w) for name, (node, w) in linear.items()}
    found = []
    for key, names in readers.items():
        x = values[key]
        if len(x.uses()) != len(names) or not set(names) <= rounded:
            continue
        fold = _fold(x, by_output)
        if fold is not None:
            found.append(Group(names, *fold))
    return found


def _scales(h: Array, alpha: float) -> Array:
    magnitude = np.sqrt(np.maximum(np.diagonal(h), 0.0))
    magnitude = np.maximum(magnitude, SMALLEST * max(float(magnitude.max()), 1e-30))
    s = magnitude**alpha
    return np.asarray(s / np.sqrt(s.max() * s.min()), np.float64)


def _rounded_back(blocks: Array, fmt: BlockFormat) -> Array:
    """Float32 blocks (``[N, blocks, block_size]``) rounded to nearest in ``fmt`` and dequantized, in place: what
    :func:`~requant.llm.blocks.round_to_nearest` stores, in float32 (the search's proxy, 3x faster)."""
    hi, lo = blocks.max(axis=-1), blocks.min(axis=-1)
    if fmt.symmetric:  # the value of the largest magnitude on the lowest code
        scales = np.where(hi >= -lo, hi, lo) / -fmt.middle
        zero_points = np.full(scales.shape, fmt.middle, np.float32)
    else:
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
        scales = (hi - lo) / fmt.top
        zero_points = np.clip(np.rint(-lo / np.where(scales == 0, 1, scales)), 0, fmt.top)
    scales[scales == 0] = 1
    blocks /= scales[..., None]
    np.rint(blocks, out=blocks)
    blocks += zero_points[..., None]
    np.clip(blocks, 0, fmt.top, out=blocks)
    blocks -= zero_points[..., None]
    blocks *= scales[..., None]
    return blocks


def _nearest_error(rows: Array, h32: Array, s: Array, fmt: BlockFormat) -> float:
    """``trace(E^T H E)`` of the weight ``rows`` (``[N, K]`` float32, padded to whole blocks) rounded to nearest
    once its inputs are scaled by ``s`` (and back)."""
    k = h32.shape[0]
    s32 = np.ones(rows.shape[1], np.float32)
    s32[:k] = s
    scaled = rows * s32
    back = _rounded_back(scaled.reshape(rows.shape[0], -1, fmt.block_size), fmt).reshape(rows.shape)
    e = back[:, :k] / s32[:k] - rows[:, :k]
    return float(np.sum((e @ h32) * e, dtype=np.float64))


def search(weights: list[Array], h: Array, fmt: BlockFormat) -> tuple[float, Array, dict[float, float]]:
    """The ``alpha`` of least output error for layers of weights ``weights`` reading inputs of moments ``h``: it,
    its ``s`` and the error of each ``alpha`` tried (see the module's docstring). The ``alpha`` are tried upwards
    from 0 until two in a row do worse than the best (the error falls, then rises: SmolLM2's 90 groups chose
    0.1-0.6 of the whole grid)."""
    h32 = np.asarray(h, np.float32)
    rows = [padded_rows(w[:, :: -(-w.shape[1] // OUTPUTS)], fmt).reshape(-1, fmt.blocks(w.shape[0]) * fmt.block_size)
            .astype(np.float32) for w in weights]  # fmt: skip
    errors: dict[float, float] = {}
    for alpha in ALPHAS:
        errors[alpha] = sum(_nearest_error(r, h32, _scales(h, alpha).astype(np.float32), fmt) for r in rows)
        best = min(errors, key=lambda a: (errors[a], a))
        if alpha - best >= 0.15:  # (two steps of 0.1 past it)
            break
    return best, _scales(h, best), errors


class ScaleSearch:
    """Applied to each section's moments as they are gathered (``LayerMoments``' ``prepare``): each group of the
    section searched and, when an ``alpha`` above 0 wins, applied to the graph's weights and the moments.
    ``records``: one per group searched."""

    def __init__(self, linear: Mapping[str, tuple[ir.Node, ir.Value]], found: list[Group],
                 formats: Mapping[str, BlockFormat], folder: Path | None = None) -> None:  # fmt: skip
        self._linear, self._formats, self._folder = linear, formats, folder
        self._by_layer = {name: g for g in found for name in g.layers}
        self.records: list[dict[str, Any]] = []
        self._written = 0

    def __call__(self, moments: Mapping[str, Array]) -> None:
        done: set[int] = set()
        for name in list(moments):
            group = self._by_layer.get(name)
            if group is None or id(group) in done or not all(n in moments for n in group.layers):
                continue
            done.add(id(group))
            self._apply(group, moments)

    def _weight(self, name: str) -> Array:
        return np.asarray(self._linear[name][1].const_value.numpy(), np.float32)  # type: ignore[union-attr]

    def _apply(self, group: Group, moments: Mapping[str, Array]) -> None:
        h = moments[group.layers[0]]
        fmt = self._formats[group.layers[0]]
        alpha, s, errors = search([self._weight(n) for n in group.layers], h, fmt)
        self.records.append({"layers": group.layers, "into": group.into, "alpha": float(alpha),
                             "error_ratio": errors[alpha] / errors[0.0] if errors[0.0] > 0 else 1.0})  # fmt: skip
        if alpha == 0:
            return
        for name in group.layers:
            self._set(self._linear[name][1], self._weight(name) * s[:, None].astype(np.float32))
        for param in group.rows:
            self._set(param, np.asarray(param.const_value.numpy(), np.float32) / s.astype(np.float32))  # type: ignore[union-attr]
        if group.columns is not None:
            self._set(group.columns, np.asarray(group.columns.const_value.numpy(), np.float32) / s.astype(np.float32))  # type: ignore[union-attr]
        for shared in {id(moments[n]): moments[n] for n in group.layers}.values():  # (LayerMoments': one array)
            shared /= s[:, None]  # H / (s s^T), in place (a K x K float64 fewer)
            shared /= s[None, :]

    def _set(self, value: ir.Value, data: Array) -> None:
        """``value``'s tensor replaced by ``data`` (float32), written to the folder and memory-mapped back when there
        is one: the scaled weights of every layer would otherwise be held until the model is written."""
        data = np.ascontiguousarray(data, np.float32)
        if self._folder is not None:
            data = on_disk(data, self._folder / f"scaled-{self._written}.npy")
            self._written += 1
        value.const_value = ir.tensor(data, name=str(value.name))
