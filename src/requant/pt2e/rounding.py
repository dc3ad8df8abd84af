"""Error-feedback rounding (GPTQ) of the convolutions' weights in a prepared PT2E module, as requant rounds
them on ONNX (:mod:`requant.encoding.rounding`: the method, its limits and its measurements).

During calibration's one pass, each static int8 convolution's float input (what its input observer
passes on) fills an :class:`~requant.calibration.moments.InputMoments` (``H = sum x x^T`` over its
input patches, in its reduction order). After the pass, each weight is rounded against ``H`` at the
scales its observer gives (per output channel, symmetric), and the float weight is replaced by those
integers times their scales: ``convert_pt2e`` rounds each such value to itself, so the program holds
the integers chosen. A weight is kept so only where its output error on the calibration inputs
(``trace(E H E^T)``) is below nearest rounding's. Linear layers are rounded to nearest (as on ONNX:
all-MiniLM-L6-v2 gained nothing measurable); so are convolutions with a reduction longer than
``MAX_REDUCTION``, grouped ones that are not depthwise, and those with too few input vectors.

The float weights replaced are kept in the module's ``meta`` (``FLOAT_WEIGHTS``): bias correction
(:mod:`requant.pt2e.bias`) measures each weight's rounding against its float weight, not against the
integers it now holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule, Node

from requant.calibration.moments import MAX_REDUCTION, InputMoments, Patches
from requant.encoding.rounding import output_error, round_rows, round_rows_each
from requant.encoding.weight_encoding import energy_db
from requant.pt2e.equalize import constant, per_channel_weight, replace_constant
from requant.pt2e.quantizer import aten_name

__all__ = ["FLOAT_WEIGHTS", "Watched", "round_weights", "watch_inputs"]

FLOAT_WEIGHTS = "requant.float_weights"  # the prepared module's meta: weight target -> its float tensor


@dataclass
class Watched:
    """A convolution whose weight may be rounded against its input: its weight's constant and observer,
    and its input's moments."""

    node: Node
    weight: Node
    observer: Any
    moments: InputMoments


def _patches(node: Node, shape: tuple[int, ...]) -> Patches | None:
    """How the conv2d ``node`` (weight ``shape``) reads its input, when its arguments are plain lists."""
    args: list[Any] = list(node.args) + [None] * (7 - len(node.args))
    stride, padding, dilation, groups = args[3] or [1, 1], args[4] or [0, 0], args[5] or [1, 1], args[6] or 1
    if not all(isinstance(a, (list, tuple)) and len(a) == 2 for a in (stride, padding, dilation)):
        return None  # padding="same" and the like
    depthwise = groups != 1 and shape[1] == 1 and groups == shape[0]
    if groups != 1 and not depthwise:
        return None
    pads = (int(padding[0]), int(padding[1]), int(padding[0]), int(padding[1]))
    return Patches((shape[2], shape[3]), pads, tuple(stride), tuple(dilation), depthwise)


def watch_inputs(prepared: GraphModule) -> tuple[dict[str, Watched], Callable[[], None]]:
    """A :class:`Watched` per static conv2d of ``prepared``, fed by a hook on its input's observer; and
    the function that removes the hooks."""
    watched: dict[str, Watched] = {}
    handles = []
    for node in prepared.graph.nodes:
        x: Any = node.args[0] if aten_name(node) == "conv2d" else None
        weight = per_channel_weight(prepared, node) if isinstance(x, Node) and x.op == "call_module" else None
        if weight is None:
            continue
        shape = tuple(int(d) for d in weight.meta["val"].shape)
        patches = _patches(node, shape)
        reduction = (1 if patches is not None and patches.depthwise else shape[1]) * shape[2] * shape[3]
        if patches is None or reduction > MAX_REDUCTION:
            continue
        observer = prepared.get_submodule(str(node.args[1].target))
        entry = watched[node.name] = Watched(node, weight, observer, InputMoments(patches, reduction))

        value = x.args[0].meta.get("val") if x.args and isinstance(x.args[0], Node) else None  # what it observes
        seen = tuple(value.shape[1:]) if value is not None else None

        def feed(_module: Any, _args: Any, out: torch.Tensor, moments: InputMoments = entry.moments,
                 seen: tuple[int, ...] | None = seen) -> None:  # fmt: skip
            # one observer module serves every value sharing its type (a pool's output, a flatten's): only
            # the calls whose output has this input's shape are this input's
            if moments.vectors < moments.cap and tuple(out.shape[1:]) == seen:
                moments.update(out.detach().numpy())

        handles.append(prepared.get_submodule(str(x.target)).register_forward_hook(feed))

    def unhook() -> None:
        for handle in handles:
            handle.remove()

    return watched, unhook


def _rows(w: torch.Tensor, depthwise: bool) -> np.ndarray:
    """A conv weight ``[O, C, kh, kw]`` as rows in its reduction order (kernel rows, columns, channels)."""
    array = w.detach().double().numpy()
    return array.reshape(len(array), -1) if depthwise else array.transpose(0, 2, 3, 1).reshape(len(array), -1)


def _weight(rows: np.ndarray, shape: tuple[int, ...], depthwise: bool) -> torch.Tensor:
    o, c, kh, kw = shape
    array = rows.reshape(shape) if depthwise else rows.reshape(o, kh, kw, c).transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(array)).float()


def _round_one(prepared: GraphModule, entry: Watched) -> dict[str, Any] | None:
    """Round one watched conv's weight against its inputs; its record, or None when nearest stays."""
    h = entry.moments.total
    scale, zero_point = entry.observer.calculate_qparams()
    if not entry.moments.enough or h is None or bool((zero_point != 0).any()):
        return None
    target = str(entry.weight.target)
    float_weight = constant(prepared, target)
    depthwise = h.ndim == 3
    units = _rows(float_weight, depthwise) / scale.double().numpy()[:, None]
    low, high = int(entry.observer.quant_min), int(entry.observer.quant_max)
    q = round_rows_each(units, h, low, high) if depthwise else round_rows(units, h, low, high)
    nearest = np.clip(np.rint(units), low, high)
    before, after = output_error(units, nearest, h), output_error(units, q, h)
    if after >= before:
        return None
    prepared.meta.setdefault(FLOAT_WEIGHTS, {})[target] = float_weight.detach().clone()
    scales = scale.double().numpy()[:, None]
    replace_constant(prepared, target, _weight(q * scales, tuple(float_weight.shape), depthwise))
    signal = output_error(units, np.zeros_like(units), h)
    return {"node": entry.node.name, "moved": int((q != nearest).sum()), "nearest_output_sqnr_db":
            energy_db(signal, before), "output_sqnr_db": energy_db(signal, after)}  # fmt: skip


def round_weights(prepared: GraphModule, watched: dict[str, Watched]) -> dict[str, Any]:
    """Round every watched conv's weight against its inputs where that is closer (module docstring); the
    report's ``weight_rounding`` section."""
    rounded = [r for r in (_round_one(prepared, e) for e in watched.values()) if r is not None]
    return {"method": "error feedback (GPTQ) against each convolution's float inputs", "watched": len(watched),
            "kernels": rounded}  # fmt: skip
