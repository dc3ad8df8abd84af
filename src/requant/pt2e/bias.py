"""Bias correction on a converted PT2E program, in its analytic form: each int8 kernel's float bias gets back
the mean shift its weight's rounding causes, ``(W_q - W) . E[x]`` per output channel.

On ``executorch-xnnpack`` the biases stay float in the program (XNNPACK quantizes them itself), so a corrected
bias is a float bias like any other. ``E[x]`` is each kernel's input channel means in the float model (the
prepared program: batch norms folded, observers pass values through), measured in one pass; ``W`` is the
folded float weight and ``W_q`` the weight rounded with the parameters its observer gives (what
``convert_pt2e`` writes). Padding is ignored (a border pixel reads fewer inputs). Measured before this form:
every kernel's output shift measured at once in the converted program compounded from layer to layer
(MobileNetV2's KL 0.09 -> 6.4), which a weight-only shift cannot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.fx import Node

from requant.pt2e.equalize import constant
from requant.pt2e.quantizer import aten_name, look_at_outputs
from requant.pt2e.rounding import FLOAT_WEIGHTS
from requant.targets.xnnpack import XNNPACK_OPS

__all__ = ["correct_biases", "static_kernels"]

# the table's kernels whose weight is [out, in / groups, *kernel] (a transposed conv's is [in, out / groups, ...])
_KERNELS = tuple(op.aten for op in XNNPACK_OPS.values() if op.role == "kernel" and op.weight_axis == 0)


def static_kernels(converted: torch.fx.GraphModule) -> dict[str, str]:
    """The kernels whose input was quantized statically and whose bias is a constant: name -> bias attribute."""
    found = {}
    for node in converted.graph.nodes:
        if aten_name(node) not in _KERNELS or len(node.args) < 3:
            continue
        x, bias = node.args[0], node.args[2]
        static = isinstance(x, Node) and "dequantize_per_tensor.default" in str(x.target)
        if static and isinstance(bias, Node) and bias.op == "get_attr":
            found[node.name] = str(bias.target)
    return found


def _input_means(
    prepared: torch.fx.GraphModule, kernels: Iterable[Node], samples: list[tuple[Any, ...]]
) -> dict[str, Any]:
    """Each kernel's input averaged over the samples and every axis but the channel's (1 for a
    convolution, the last for a linear layer), by kernel name."""
    readers: dict[Node, list[Node]] = {}  # what each kernel reads -> the kernels reading it
    for kernel in kernels:
        if isinstance(kernel.args[0], Node):
            readers.setdefault(kernel.args[0], []).append(kernel)
    sums: dict[str, Any] = {}

    def add(n: Node, x: torch.Tensor) -> None:
        for kernel in readers.get(n, []):
            axis = x.dim() - 1 if aten_name(kernel) == "linear" else 1
            mean = x.double().mean(dim=[d for d in range(x.dim()) if d != axis])
            sums[kernel.name] = sums.get(kernel.name, 0) + mean / len(samples)

    look_at_outputs(prepared, samples, add)
    return sums


def _weight_error(prepared: torch.fx.GraphModule, node: Node) -> torch.Tensor | None:
    """``W_q - W`` of a kernel of the prepared program: its float weight, rounded with its observer's parameters."""
    observer_node = node.args[1]
    if not isinstance(observer_node, Node) or observer_node.op != "call_module":
        return None
    observer: Any = prepared.get_submodule(str(observer_node.target))
    weight_node = observer_node.args[0]
    if not isinstance(weight_node, Node) or weight_node.op != "get_attr" or not hasattr(observer, "ch_axis"):
        return None
    kept = prepared.meta.get(FLOAT_WEIGHTS, {}).get(str(weight_node.target))  # rounded against its inputs
    current = constant(prepared, str(weight_node.target)).detach()
    weight = (kept if kept is not None else current).double()
    scale, zero_point = observer.calculate_qparams()
    axis, low, high = int(observer.ch_axis), int(observer.quant_min), int(observer.quant_max)
    rounded = torch.fake_quantize_per_channel_affine(current.float(), scale.float(), zero_point.int(), axis, low, high)
    error: torch.Tensor = rounded.double() - weight
    return error


def _shift(error: torch.Tensor, mean: torch.Tensor, groups: int) -> torch.Tensor:
    """``(W_q - W) . E[x]`` per output channel, for a weight [out, in / groups, *kernel]."""
    out, per_group = error.shape[0], error.shape[1]
    summed = error.reshape(out, per_group, -1).sum(dim=2)  # [out, in / groups]
    by_group = summed.reshape(groups, out // groups, per_group)
    return torch.einsum("goi,gi->go", by_group, mean.reshape(groups, per_group)).reshape(out)


def correct_biases(prepared: torch.fx.GraphModule, converted: torch.fx.GraphModule,
                   samples: list[tuple[Any, ...]], sign: float = 1.0) -> list[dict[str, Any]]:  # fmt: skip
    """Subtract ``sign`` x each static kernel's weight-rounding shift from its bias in ``converted``; what
    moved, per kernel (``sign=-1`` undoes it)."""
    kernels = static_kernels(converted)
    nodes = {n.name: n for n in prepared.graph.nodes if n.name in kernels}
    means = _input_means(prepared, nodes.values(), samples)
    moved = []
    with torch.no_grad():
        for name, node in nodes.items():
            error = _weight_error(prepared, node)
            if error is None or name not in means:
                continue
            groups = int(node.args[6]) if aten_name(node) != "linear" and len(node.args) > 6 else 1
            shift = _shift(error, means[name], groups).float()
            bias = constant(converted, kernels[name])
            if bias.shape != shift.shape:
                continue
            bias.sub_(sign * shift)
            moved.append({"node": name, "max_shift": float(shift.abs().max())})
    return moved
