"""``order-gelu``: a GELU written out with erf takes one order, which ONNX Runtime fuses into its Gelu kernel.

Exporters write the exact GELU, ``x * 0.5 * (1 + erf(x / sqrt 2))``, as five ops in several orders:
PaddlePaddle's (PP-OCR) ``Mul(Mul(x, 1 + erf), 0.5)``, others ``Mul(x, Mul(1 + erf, 0.5))`` or the
argument scaled by ``Mul(x, 1 / sqrt 2)``. ONNX Runtime 1.31's ``GeluFusion`` (an extended-level graph
optimization, on by default) fuses into one ``com.microsoft`` Gelu only the two orders with ``Div(x, sqrt 2)``
and the halving right before or after the product with ``x``; the others run as five float kernels over the
whole tensor (measured on a 1 x 8 x 32 x 32 GELU in each order). This pass writes every written-out erf
GELU as ``Mul(Mul(x, 0.5), Add(Erf(Div(x, sqrt 2)), 1))``: ONNX Runtime fuses each, and the ONNX Runtime
table and backend find them in one form (:func:`members`, :mod:`requant.backends.fused_gelu`). Halving is
exact in binary floating point, so ``(x * (1 + e)) * 0.5`` and ``(x * 0.5) * (1 + e)`` are the same
numbers; ``x / sqrt 2`` where the model multiplied by its reciprocal may differ in the last bit.

Legal where the constants are scalars within ONNX Runtime's own tolerance (relative 1e-5) of
``sqrt 2`` (or ``1 / sqrt 2`` for a Mul), ``1`` and ``0.5``, and each value inside is read only by
the next op (none is a graph output). The GELU's output keeps its name and readers. Main graph only.

Invariant after: every written-out erf GELU is in ONNX Runtime's order.

Before::

    %t = Div(%x, 1.4142135)   %e = Erf(%t)   %s = Add(%e, 1.0)   %m = Mul(%x, %s)   %y = Mul(%m, 0.5)

After::

    %t = Div(%x, 1.4142135)   %e = Erf(%t)   %s = Add(%e, 1.0)   %h = Mul(%x, 0.5)   %y = Mul(%h, %s)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from requant.ir.annotations import replace_value
from requant.ir.queries import fresh_name, graph_values
from requant.passes._base import Pass
from requant.passes._rewrite import adopt_name, constant, is_op, new_initializer, only_reader, other_input

__all__ = ["PASS", "Gelu", "OrderGelu", "find", "members"]

_SQRT2 = math.sqrt(2.0)


def _scalar(value: ir.Value | None, expected: float) -> bool:
    """A constant scalar (rank 0 or one value of rank 1) within ONNX Runtime's tolerance of ``expected``."""
    data = constant(value) if value is not None else None
    if data is None or data.size != 1 or data.ndim > 1 or not np.issubdtype(data.dtype, np.floating):
        return False
    return bool(abs(float(data.reshape(-1)[0]) - expected) <= 1e-8 + 1e-5 * abs(expected))


@dataclass
class Gelu:
    """One written-out erf GELU: its input, the op scaling it (Div or Mul), the Erf, the Add of 1, and
    the two Muls of its tail (the last writes the output); ``ordered``: already in ONNX Runtime's order."""

    x: ir.Value
    scale: ir.Node
    erf: ir.Node
    add: ir.Node
    tail: tuple[ir.Node, ir.Node]
    ordered: bool


def _argument(erf: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """``x`` and the op computing ``x / sqrt 2`` (a Div, or a Mul by the reciprocal) that ``erf`` reads."""
    t = erf.inputs[0] if erf.inputs else None
    scale = t.producer() if t is not None else None
    if t is None or scale is None or len(t.uses()) != 1 or t.is_graph_output() or len(scale.inputs) != 2:
        return None
    if is_op(scale, "Div") and _scalar(scale.inputs[1], _SQRT2) and scale.inputs[0] is not None:
        return scale.inputs[0], scale
    if is_op(scale, "Mul"):
        for x, c in (scale.inputs, reversed(scale.inputs)):
            if x is not None and constant(x) is None and _scalar(c, 1.0 / _SQRT2):
                return x, scale
    return None


def _tail(x: ir.Value, s: ir.Value) -> tuple[ir.Node, ir.Node, bool] | None:
    """The two Muls taking ``s = 1 + erf`` to the output, and whether they are ``Mul(Mul(x, 0.5), s)``."""
    first = only_reader(s, "Mul")
    if first is None:
        return None
    other = other_input(first, s)
    if other is None:
        return None
    inner = other.producer()
    alone = len(other.uses()) == 1 and not other.is_graph_output()
    if inner is not None and is_op(inner, "Mul") and alone and _scalar(other_input(inner, x), 0.5):
        return inner, first, True  # Mul(Mul(x, 0.5), s)
    if other is x or _scalar(other, 0.5):  # Mul(Mul(x, s), 0.5) or Mul(x, Mul(s, 0.5))
        second = only_reader(first.outputs[0], "Mul")
        last = other_input(second, first.outputs[0]) if second is not None else None
        if second is not None and last is not None and (last is x if other is not x else _scalar(last, 0.5)):
            return first, second, False
    return None


def _gelu(erf: ir.Node) -> Gelu | None:
    found = _argument(erf)
    if found is None:
        return None
    x, scale = found
    add = only_reader(erf.outputs[0], "Add")
    if add is None or not _scalar(other_input(add, erf.outputs[0]), 1.0):
        return None
    tail = _tail(x, add.outputs[0])
    if tail is None:
        return None
    first, second, ordered = tail
    return Gelu(x, scale, erf, add, (first, second), ordered and is_op(scale, "Div"))


def find(graph: ir.Graph) -> list[Gelu]:
    """The written-out erf GELUs of ``graph`` (not its subgraphs), in graph order."""
    return [g for node in list(graph) if is_op(node, "Erf") and (g := _gelu(node)) is not None]


def members(graph: ir.Graph) -> list[str]:
    """The names of the ops of every written-out erf GELU of ``graph`` already in ONNX Runtime's order."""
    return [str(n.name) for g in find(graph) if g.ordered for n in (g.scale, g.erf, g.add, *g.tail) if n.name]


def _reorder(graph: ir.Graph, gelu: Gelu) -> None:
    """Rewrite ``gelu`` as ``Mul(Mul(x, 0.5), Add(Erf(Div(x, sqrt 2)), 1))``, its output kept."""
    base = gelu.erf.name or "gelu"
    taken: set[str | None] = {v.name for v in graph_values(graph)}
    if not is_op(gelu.scale, "Div"):
        root = new_initializer(graph, f"{base}_sqrt2", np.array(_SQRT2, np.float32))
        div = ir.Node("", "Div", [gelu.x, root], num_outputs=1, name=gelu.scale.name)
        div.outputs[0].name, div.outputs[0].type = fresh_name(f"{base}_div", taken), gelu.scale.outputs[0].type
        div.outputs[0].shape = gelu.scale.outputs[0].shape
        graph.insert_before(gelu.scale, div)
        replace_value(gelu.scale.outputs[0], div.outputs[0])
        graph.remove(gelu.scale, safe=True)
    first, last = gelu.tail
    half = new_initializer(graph, f"{base}_half", np.array(0.5, np.float32))
    halved = ir.Node("", "Mul", [gelu.x, half], num_outputs=1, name=first.name)
    out = ir.Node("", "Mul", [halved.outputs[0], gelu.add.outputs[0]], num_outputs=1, name=last.name)
    halved.outputs[0].name, halved.outputs[0].type = fresh_name(f"{base}_half_x", taken), gelu.x.type
    halved.outputs[0].shape = gelu.x.shape
    old = last.outputs[0]
    adopt_name(old, out.outputs[0])
    out.outputs[0].shape, out.outputs[0].type = old.shape, old.type
    graph.insert_before(last, [halved, out])
    replace_value(old, out.outputs[0])
    graph.remove([last, first], safe=True)


class OrderGelu(Pass):
    name = "order-gelu"
    recurses_into_subgraphs = False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        found = [g for g in find(model.graph) if not g.ordered]
        for gelu in found:
            _reorder(model.graph, gelu)
        return ir.passes.PassResult(model, bool(found))


PASS = OrderGelu
