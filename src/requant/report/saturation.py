"""Which int8 kernels of a model ONNX Runtime has fused can saturate on x86 CPUs without VNNI.

Read from ONNX Runtime's optimized graph (the kernels it really runs), so it works on any QDQ
model, requant's or another tool's. For each uint8 x int8 kernel with constant weights, the
kernel model (:mod:`requant.targets.kernels`) says how its products are added; where pairs are
added in int16, every pair is bounded over every value the input can hold (its storage range):
the kernels that can saturate, how many pairs, and the worst error it can cause in one output,
in the accumulator, in float, and in output steps (for kernels with a quantized output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from requant.targets.kernels import ONNXRUNTIME_X86, KernelModel, Reduction, is_depthwise

__all__ = ["SaturationFinding", "find_saturation"]

# ORT kernel -> (the float op it computes, input index of: A, B (weight), A's scale, A's zero point,
# B's scale, output scale or None)
_KERNELS: dict[str, tuple[str, int, int, int, int | None, int, int | None]] = {
    "QLinearConv": ("Conv", 0, 3, 1, 2, 4, 6),
    "QGemm": ("Gemm", 0, 3, 1, 2, 4, 7),
    "QLinearMatMul": ("MatMul", 0, 3, 1, 2, 4, 6),
    "MatMulIntegerToFloat": ("MatMul", 0, 1, 2, 4, 3, None),
    "MatMulInteger": ("MatMul", 0, 1, -1, 2, -1, None),
    "DynamicQuantizeMatMul": ("MatMul", 0, 1, -1, None, 2, None),
}
_STORAGE = {onnx.TensorProto.UINT8: "u8", onnx.TensorProto.INT8: "i8"}


@dataclass(frozen=True)
class SaturationFinding:
    """One kernel whose int16 pair sums can leave their range: its pairs that can, the channels they
    are in, and the worst error one output can get (accumulator units, float, output steps)."""

    node: str
    op_type: str
    pairs: int
    channels: int
    worst_accumulator_error: int
    worst_error: float | None
    worst_output_steps: float | None

    def text(self) -> str:
        worst = f"up to {self.worst_accumulator_error} in the accumulator"
        if self.worst_error is not None:
            worst += f" ({self.worst_error:.3g} in float"
            worst += f", {self.worst_output_steps:.1f} output steps)" if self.worst_output_steps is not None else ")"
        return f"{self.op_type} '{self.node}': {self.pairs} pairs in {self.channels} channels, {worst}"


def _constant(graph: dict[str, onnx.TensorProto], node: onnx.NodeProto, index: int | None) -> Any:
    if index is None or index < 0 or index >= len(node.input) or node.input[index] not in graph:
        return None
    return numpy_helper.to_array(graph[node.input[index]])


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _check(
    node: onnx.NodeProto, op: str, weight: Any, storage: str, kernels: KernelModel, scales: tuple[Any, Any, Any]
) -> tuple[bool, SaturationFinding | None]:
    """(whether the weight is a uint8 x int8 kernel's, the finding if its pairs can saturate)."""
    group = _attribute(node, "group", 1)
    rule = kernels.find(op, storage, "i8", op == "Conv" and is_depthwise(weight.shape, group))
    if rule is None or storage != "u8":
        return False, None
    if not rule.accumulation.saturates:
        return True, None
    reduction = Reduction(op, weight.shape, bool(_attribute(node, "transB", 0)), group)
    up, down, _ = rule.accumulation.pair_overflows(reduction.rows(weight), 0, 255)
    if not (up.any() or down.any()):
        return True, None
    worst = np.maximum(up.sum(axis=1), down.sum(axis=1))  # per output channel: every pair at its worst
    channel = int(worst.argmax())
    scale_x, scale_w, scale_y = scales
    error = None
    if scale_x is not None and scale_w is not None:
        w_scale = np.broadcast_to(np.asarray(scale_w, np.float64).reshape(-1), worst.shape)[channel]
        error = float(worst[channel] * float(scale_x) * w_scale)
    steps = error / float(scale_y) if error is not None and scale_y is not None else None
    finding = SaturationFinding(
        node.name or node.op_type,
        node.op_type,
        int(((up > 0) | (down > 0)).sum()),
        int(((up > 0) | (down > 0)).any(axis=1).sum()),
        int(worst[channel]),
        error,
        steps,
    )
    return True, finding


def find_saturation(
    graph: onnx.GraphProto, kernels: KernelModel = ONNXRUNTIME_X86
) -> tuple[int, list[SaturationFinding]]:
    """(how many uint8 x int8 kernels with constant weights ``graph`` has, the ones that can saturate).

    A ``DynamicQuantizeLSTM`` counts once and is checked for both its weights (input and recurrence,
    stored ``[directions, size, 4 x hidden]``); its inputs' scales change with every run, so its
    worst error is given in accumulator units only."""
    constants = {t.name: t for t in graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info]}
    checked, findings = 0, []
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLSTM":
            weights = [_constant(constants, node, i) for i in (1, 2)]
            results = [
                _check(node, "LSTM", w.transpose(0, 2, 1), "u8", kernels, (None, None, None))
                for w in weights
                if w is not None and w.dtype == np.int8 and w.ndim == 3
            ]
            checked += any(counted for counted, _ in results)
            found = [f for _, f in results if f is not None]
            if found:  # one finding for the kernel: both weights' pairs and channels
                findings.append(
                    dataclasses.replace(
                        found[0],
                        pairs=sum(f.pairs for f in found),
                        channels=sum(f.channels for f in found),
                        worst_accumulator_error=max(f.worst_accumulator_error for f in found),
                    )
                )
            continue
        layout = _KERNELS.get(node.op_type)
        if layout is None:
            continue
        op, a, b, a_scale, a_zero, b_scale, y_scale = layout
        weight = _constant(constants, node, b)
        if weight is None or weight.dtype != np.int8:
            continue
        zero = _constant(constants, node, a_zero)
        storage = (
            _STORAGE.get(types.get(node.input[a], 0), "u8")
            if zero is None
            else _STORAGE.get(onnx.helper.np_dtype_to_tensor_dtype(zero.dtype), "u8")
        )  # DynamicQuantizeMatMul quantizes its float input to uint8
        scales = tuple(_constant(constants, node, i) for i in (a_scale, b_scale, y_scale))
        counted, finding = _check(node, op, weight, storage, kernels, scales)
        checked += counted
        if finding is not None:
            findings.append(finding)
    return checked, findings
