"""A converted PT2E program in the form it is compared in: the same numbers, in about half the time.

``convert_pt2e`` writes each quantized tensor as ``quantize_per_tensor -> dequantize_per_tensor`` and each
weight as an int8 constant dequantized on every call; run eagerly, those decomposed ops are Python functions
(EfficientNet-Lite0: 60 ms a sample against float's 20). :func:`fused` copies the program with each such pair
one function of five in-place tensor ops (:func:`rounded`: the decomposed ops' arithmetic, so the same
numbers; a third of their time, and a tenth of ATen's ``fake_quantize_per_tensor_affine``, which is not
vectorized: 0.74, 2.6 and 7.4 ms on a [1, 96, 112, 112] tensor here) and each constant weight dequantized
once: 28 ms a sample. The copy shares the program's constants, so a bias corrected in the
program in place is corrected in the copy. Used where candidates are compared (the method choice, bias
correction); the program itself is what is lowered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

__all__ = ["fused", "rounded", "simulated"]

_QUANTIZE = "quantized_decomposed.quantize_per_tensor.default"
_DEQUANTIZE = "quantized_decomposed.dequantize_per_tensor.default"
_STORAGE = {torch.int8: torch.int8, torch.uint8: torch.uint8, torch.qint8: torch.int8, torch.quint8: torch.uint8}
_CONSTANT_DEQUANTIZE = ("quantized_decomposed.dequantize_per_channel.default", _DEQUANTIZE)


def _attr(module: GraphModule, node: Node) -> torch.Tensor:
    value = module
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value  # type: ignore[return-value]


def _fold(module: GraphModule, node: Node, count: int) -> bool:
    """Replace a dequantize of constants only by its float result; whether it was one."""
    args = [_attr(module, a) if isinstance(a, Node) and a.op == "get_attr" else a for a in node.args]
    if any(isinstance(a, Node) for a in args):
        return False
    with module.graph.inserting_before(node):
        node.replace_all_uses_with(_constant(module, node.target(*args, **node.kwargs), count))  # type: ignore[operator]
    return True


def _constant(module: GraphModule, value: torch.Tensor, count: int) -> Node:
    """``value`` as a buffer of ``module`` and the node reading it (at the graph's insertion point)."""
    module.register_buffer(f"_fused_constant_{count}", value)
    return module.graph.get_attr(f"_fused_constant_{count}")


def rounded(x: torch.Tensor, scale: float, zero_point: int, low: int, high: int) -> torch.Tensor:
    """``x`` quantized and dequantized as ``quantize_per_tensor`` and ``dequantize_per_tensor`` do it:
    ``(clamp(round(x * (1 / scale)) + zero_point, low, high) - zero_point) * scale``."""
    y = x.mul(1.0 / scale)
    y.round_().add_(zero_point).clamp_(low, high)
    return y.sub_(zero_point).mul_(scale)


def _fake_quantize(module: GraphModule, node: Node) -> bool:
    """Replace a dequantize of a quantize (the same parameters) by :func:`rounded`; whether it was one."""
    source = node.args[0]
    if not isinstance(source, Node) or str(source.target) != _QUANTIZE or source.args[1:5] != node.args[1:5]:
        return False
    with module.graph.inserting_before(node):  # x, scale, zero point, low, high: literals, as convert_pt2e writes
        fake = module.graph.call_function(rounded, tuple(source.args[:5]))
    node.replace_all_uses_with(fake)
    return True


def fused(converted: GraphModule) -> GraphModule:
    """A copy of ``converted`` computing the same outputs with quantize/dequantize pairs fused and constant
    weights dequantized once (module docstring)."""
    module = GraphModule(converted, converted.graph.__deepcopy__())
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target in _CONSTANT_DEQUANTIZE and _fold(module, node, count):
            count += 1
        elif target == _DEQUANTIZE:
            _fake_quantize(module, node)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def _observer(prepared: GraphModule, node: Node) -> Any:
    if node.op != "call_module":
        return None
    module = prepared.get_submodule(str(node.target))
    return module if hasattr(module, "calculate_qparams") and hasattr(module, "quant_min") else None


def _simulate(module: GraphModule, node: Node, observer: Any, count: int) -> None:
    """Replace an observer's call by what ``convert_pt2e`` would write for it, fused: a constant (a weight,
    quantized and dequantized per channel once) or :func:`rounded`."""
    scale, zero_point = observer.calculate_qparams()
    low, high, source = int(observer.quant_min), int(observer.quant_max), node.args[0]
    with module.graph.inserting_before(node):
        if observer.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
            assert isinstance(source, Node) and source.op == "get_attr", f"{node.name}: a per-channel activation"
            ops = torch.ops.quantized_decomposed
            dtype, axis = _STORAGE[observer.dtype], int(observer.ch_axis)
            params = (scale, zero_point, axis, low, high, dtype)
            q = ops.quantize_per_channel.default(_attr(module, source), *params)
            replacement = _constant(module, ops.dequantize_per_channel.default(q, *params), count)
        else:
            replacement = module.graph.call_function(rounded, (source, float(scale), int(zero_point), low, high))
    node.replace_all_uses_with(replacement)
    module.graph.erase_node(node)


def simulated(prepared: GraphModule) -> GraphModule | None:
    """What :func:`fused` gives for ``convert_pt2e(copy of prepared)``, without converting: each observer
    read at its current method. None when an observer is one this does not simulate (dynamic, or a dtype
    other than int8/uint8)."""
    observers = {n: _observer(prepared, n) for n in prepared.graph.nodes}
    observers = {n: o for n, o in observers.items() if o is not None}
    if any(getattr(o, "is_dynamic", False) or o.dtype not in _STORAGE for o in observers.values()):
        return None
    module = GraphModule(prepared, prepared.graph.__deepcopy__())
    copies = {n.name: n for n in module.graph.nodes}
    for count, (node, observer) in enumerate(observers.items()):
        _simulate(module, copies[node.name], observer, count)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module
