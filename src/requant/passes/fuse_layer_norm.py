"""``fuse-layer-norm``: a LayerNorm written out op by op becomes one ``LayerNormalization``.

PaddlePaddle's exporter (PP-OCRv4's recognizer) and others write a LayerNorm over the last axis as::

    %mean = ReduceMean(%x) {axes = [-1]}      %d = Sub(%x, %mean)        %p = Pow(%d, 2)
    %var = ReduceMean(%p) {axes = [-1]}       %s = Sqrt(Add(%var, eps))  %n = Div(%d, %s)
    %y = Add(Mul(%n, %gamma), %beta)          (the affine part optional)

Legal when both means are over the last axis only, keeping it; the exponent is 2 and ``eps`` one
constant number; ``gamma`` and ``beta`` are constants of the last axis's size; and nothing but the
next op reads each value inside (none is a graph output). ``LayerNormalization`` is an op of opset
17: in a model of an older opset nothing changes (``tosa-int8``, which lowers the op to integers
and not its pieces, raises the model's opset first where this pass finds one: :func:`find`).

Invariant after (opset 17 and later): no such chain remains.

After::

    %y = LayerNormalization(%x, %gamma, %beta) {axis = -1, epsilon = eps}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from requant.passes._base import Pass
from requant.passes._rewrite import (
    constant,
    is_op,
    new_initializer,
    only_reader,
    other_input,
    reduces_last_axis,
    replace_chain,
)

__all__ = ["OPSET", "PASS", "FuseLayerNorm", "find"]

OPSET = 17  # LayerNormalization's


@dataclass
class _Chain:
    x: ir.Value
    nodes: list[ir.Node]  # every node of the chain, in order; the last one's output is the LayerNorm's
    epsilon: float
    gamma: ir.Value | None
    beta: ir.Value | None


def _number(value: ir.Value | None) -> float | None:
    data = constant(value) if value is not None else None
    return float(data.reshape(-1)[0]) if data is not None and data.size == 1 else None


def _per_channel(node: ir.Node, value: ir.Value, size: int | None) -> ir.Value | None:
    """``node``'s other input when it is a constant of values along the last axis (``size`` of them,
    where the last axis's size is known)."""
    other = other_input(node, value)
    data = constant(other) if other is not None else None
    if data is None or data.ndim == 0 or any(d != 1 for d in data.shape[:-1]):
        return None
    return other if size is None or data.size == size else None


def _chain(mean: ir.Node) -> _Chain | None:
    """The LayerNorm written out from ``mean`` on, or None. The input's shape may be unknown (a model
    with a dynamic width: PP-OCRv4's recognizer): the axes are then ``-1``, and the last axis's size
    is the scale's."""
    x = mean.inputs[0]
    rank = len(x.shape) if x is not None and x.shape is not None else None
    last = x.shape[-1] if x is not None and x.shape is not None and rank else None
    size = last if isinstance(last, int) else None
    if x is None or not reduces_last_axis(mean, rank):
        return None
    sub = only_reader(mean.outputs[0], "Sub")
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
        return None
    d = sub.outputs[0]
    readers = {use.node.op_type: use for use in d.uses()}
    if d.is_graph_output() or len(d.uses()) != 2 or set(readers) != {"Pow", "Div"}:
        return None
    power, div = readers["Pow"].node, readers["Div"].node
    if readers["Pow"].idx != 0 or readers["Div"].idx != 0 or _number(power.inputs[1]) != 2.0:
        return None
    variance = only_reader(power.outputs[0], "ReduceMean")
    if variance is None or not reduces_last_axis(variance, rank):
        return None
    plus = only_reader(variance.outputs[0], "Add")
    epsilon = _number(other_input(plus, variance.outputs[0])) if plus is not None else None
    root = only_reader(plus.outputs[0], "Sqrt") if plus is not None else None
    if plus is None or root is None or epsilon is None or epsilon < 0:
        return None
    if only_reader(root.outputs[0], "Div") is not div:
        return None
    nodes = [mean, sub, power, variance, plus, root, div]
    gamma = beta = None
    scale = only_reader(div.outputs[0], "Mul")
    if scale is not None and (gamma := _per_channel(scale, div.outputs[0], size)) is not None:
        nodes.append(scale)
        shift = only_reader(scale.outputs[0], "Add")
        if shift is not None and (beta := _per_channel(shift, scale.outputs[0], size)) is not None:
            nodes.append(shift)
    if size is None and gamma is None:  # no scale to take the size from: the ones it needs are unknown
        return None
    return _Chain(x, nodes, epsilon, gamma, beta)


def find(model: ir.Model) -> list[_Chain]:
    """The written-out LayerNorms of ``model``'s main graph, whatever its opset."""
    return [c for node in list(model.graph) if is_op(node, "ReduceMean") and (c := _chain(node)) is not None]


def _vector(graph: ir.Graph, value: ir.Value | None, size: int, name: str) -> ir.Value:
    """``value`` where it is a constant of shape ``[size]``, else an initializer of its values (ones
    where there is none: a LayerNorm without its scale) in that shape."""
    data = constant(value) if value is not None else None
    if value is not None and data is not None and data.shape == (size,):
        return value
    values = np.ones(size, np.float32) if data is None else np.asarray(data, np.float32).reshape(size)
    return new_initializer(graph, name, values)


def _fuse(graph: ir.Graph, chain: _Chain) -> None:
    scale = constant(chain.gamma) if chain.gamma is not None else None
    size = scale.size if scale is not None else chain.x.shape[-1] if chain.x.shape is not None else None
    assert isinstance(size, int)
    base = chain.nodes[-1].name or "layer_norm"
    inputs = [chain.x, _vector(graph, chain.gamma, size, f"{base}_scale")]
    if chain.beta is not None:
        inputs.append(_vector(graph, chain.beta, size, f"{base}_bias"))
    attributes = [ir.AttrInt64("axis", -1), ir.AttrFloat32("epsilon", chain.epsilon)]
    fused = ir.Node("", "LayerNormalization", inputs, attributes, num_outputs=1, name=chain.nodes[0].name or None)
    replace_chain(chain.nodes, fused)


class FuseLayerNorm(Pass):
    name = "fuse-layer-norm"
    recurses_into_subgraphs = False
    opset = OPSET
    into = "one LayerNormalization (a LayerNorm written out op by op)"

    def finds(self, model: ir.Model) -> list[str]:
        return [f"{c.nodes[0].op_type} '{c.nodes[0].name}'" for c in find(model)]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.opset_imports.get("", 0) < OPSET:
            return ir.passes.PassResult(model, False)
        chains = find(model)
        for chain in chains:
            _fuse(model.graph, chain)
        return ir.passes.PassResult(model, bool(chains))


PASS = FuseLayerNorm
