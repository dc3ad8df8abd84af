"""Smoothing on an ATen graph: a linear layer's outlier input channels moved into its weight (SmoothQuant),
as :mod:`requant.transforms.smoothing` does on ONNX (the factors and spreads are its
:func:`~requant.transforms.smoothing.evened`; the reasoning is there).

Each group of ``aten.linear`` nodes reading one value ``x`` (each with a 2-d constant weight of its own)
reads ``aten.mul(x, 1 / s)`` instead, and each weight's columns are multiplied by ``s``: the float model
computes the same numbers. The ``mul`` is left float by the quantizer (:func:`smooth` returns the names):
XNNPACK runs it in its float delegate. It is never folded into the ``layer_norm`` before it: in a BERT
(post-LN) that value also feeds the residual sum, and a fold would change it there.

It runs on the float module before annotation, only in models with more linear layers than convolutions
(the ONNX rule); ``x``'s channel maxima are the float model's on the first ``SMOOTHING_SAMPLES``
calibration samples (:func:`input_maxima`, read by an FX interpreter). A group whose largest channel is
less than ``MIN_SPREAD`` times its median one is left alone (the ``mul`` would cost more than it gains).

Measured (all-MiniLM-L6-v2, executorch-xnnpack, 128 calibration / 256 other sentences, cosine of the
``.pte``'s embeddings against float; ``bench/try_pt2e_smoothing.py --alphas 0,0.3,0.4,0.5,0.6,0.8``): 0.99901
without, 0.99944 with ``alpha`` 0.5 (0.99934 at 0.4, 0.99941 at 0.6), 0.99892 with 0.8, the ONNX targets'
default (its linear inputs are quantized per call here, per tensor: the target's default alpha is 0.5,
:mod:`requant.targets.registry`).

The module's parameters are replaced, not written into (they are the float program's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.fx import GraphModule, Node

from requant.pt2e.equalize import constant, replace_constant
from requant.pt2e.quantizer import Look, aten_name
from requant.transforms.smoothing import MIN_SPREAD, Smoothed, Smoothing, evened

__all__ = ["SMOOTHING_SAMPLES", "input_maxima", "linear_groups", "smooth"]

SMOOTHING_SAMPLES = 64  # the float model's linear inputs observed on this many calibration samples
_CONVS = ("conv1d", "conv2d", "conv_transpose2d")


def _weight(module: GraphModule, node: Node) -> Node | None:
    """The ``get_attr`` behind ``node``'s weight when it is a 2-d float constant read by ``node`` alone."""
    w = node.args[1] if len(node.args) > 1 else None
    if not isinstance(w, Node) or w.op != "get_attr" or list(w.users) != [node]:
        return None
    tensor = constant(module, str(w.target))
    return w if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.dtype == torch.float32 else None


def linear_groups(module: GraphModule) -> tuple[dict[Node, list[Node]], str | None]:
    """The linear layers by the value they read, in graph order; or why the model is not smoothed."""
    names = [aten_name(n) for n in module.graph.nodes if n.op == "call_function"]
    linear, convs = names.count("linear"), sum(names.count(c) for c in _CONVS)
    if linear <= convs:
        return {}, (f"a convolutional model ({convs} convolutions, {linear} linear layers): only models with more "
                    "linear layers than convolutions are smoothed")  # fmt: skip
    groups: dict[Node, list[Node]] = {}
    for node in module.graph.nodes:
        if node.op == "call_function" and aten_name(node) == "linear" and isinstance(node.args[0], Node):
            groups.setdefault(node.args[0], []).append(node)
    return groups, None


def input_maxima(groups: dict[Node, list[Node]]) -> tuple[dict[str, torch.Tensor], Look]:
    """The largest magnitude per last-axis channel of each group's input, by input name, filled by the
    returned ``look`` (for :func:`~requant.pt2e.quantizer.look_at_outputs`)."""
    wanted = {x.name for x in groups}
    maxima: dict[str, torch.Tensor] = {}

    def look(node: Node, out: torch.Tensor) -> None:
        if node.name in wanted and out.dim() >= 2:
            m = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).double()
            maxima[node.name] = torch.maximum(maxima[node.name], m) if node.name in maxima else m

    return maxima, look


def _why_not(module: GraphModule, linears: list[Node], maxima: torch.Tensor | None) -> str | None:
    if maxima is None:
        return "no value was observed"
    if any(_weight(module, li) is None for li in linears):
        return "a weight is not a 2-d float32 constant of its own"
    sizes = {int(constant(module, str(li.args[1].target)).shape[1]) for li in linears}  # type: ignore[union-attr]
    if sizes != {maxima.numel()}:
        return f"its linear layers read {sorted(sizes)} channels, it has {maxima.numel()}"
    return None


def smooth(module: GraphModule, maxima: dict[str, torch.Tensor], alpha: float,
           min_spread: float = MIN_SPREAD) -> tuple[Smoothing, dict[str, np.ndarray]]:  # fmt: skip
    """Smooth each linear-layer input of ``module`` (changed in place) with ``alpha``; what was done (the
    ``mul`` nodes added, to keep float), and each ``mul``'s output channel factors against float (``1 / s``,
    last axis: :func:`~requant.pt2e.equalize.unscaled`)."""
    groups, why = linear_groups(module)
    if why is not None:
        return Smoothing([], [], why), {}
    records, muls, factors = [], [], {}
    for x, linears in groups.items():
        names = [li.name for li in linears]
        found = maxima.get(x.name)
        reason = _why_not(module, linears, found)
        if reason is not None:
            records.append(Smoothed(x.name, names, skipped=reason))
            continue
        assert found is not None
        act = found.numpy()
        weights = [str(li.args[1].target) for li in linears]  # type: ignore[union-attr]
        wmax = np.max([constant(module, w).detach().abs().amax(0).double().numpy() for w in weights], axis=0)
        s, before, after = evened(act, wmax, alpha)
        if before < min_spread:
            why = f"its largest channel is {before:.1f}x its median one (a float mul pays from {min_spread:g}x)"
            records.append(Smoothed(x.name, names, None, why, int(act.size), before, before))
            continue
        for w in weights:
            old = constant(module, w).detach()
            replace_constant(module, w, old * torch.from_numpy(s).to(old.dtype))
        mul = _insert_mul(module, x, linears, (1 / s).astype(np.float32))
        muls.append(mul)
        factors[mul] = 1 / s
        records.append(Smoothed(x.name, names, f"aten.mul '{mul}' before the linear layers", None, int(act.size),
                                before, after))  # fmt: skip
    module.recompile()
    return Smoothing(records, muls), factors


def _insert_mul(module: GraphModule, x: Node, linears: list[Node], inverse: np.ndarray) -> str:
    """``aten.mul(x, inverse)`` before the first of ``linears``, which read it instead of ``x``; its name."""
    target = f"requant_smoothing_{x.name}"
    module.register_buffer(target, torch.from_numpy(inverse))
    graph = module.graph
    with graph.inserting_before(linears[0]):
        factor = graph.get_attr(target)
        mul = graph.call_function(torch.ops.aten.mul.Tensor, (x, factor))
    factor.meta["val"] = getattr(module, target)
    mul.meta = {**x.meta, "val": x.meta.get("val")}
    mul.meta.pop("source_fn_stack", None)
    for li in linears:
        li.replace_input_with(x, mul)
    return str(mul.name)
