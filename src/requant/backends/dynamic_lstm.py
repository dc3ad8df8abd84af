"""LSTMs with quantized weights become ONNX Runtime's ``DynamicQuantizeLSTM`` (``com.microsoft``).

ONNX Runtime fuses no ``DequantizeLinear -> LSTM``: its int8 LSTM is a kernel of its own, which
quantizes its input (once per run) and its hidden state (at every step) to uint8 over their
current range, and multiplies them with 8-bit weights stored transposed, ``[directions, size,
4 x hidden]``, with a scale and zero point per direction (``[directions]``) or per direction and
gate row (``[directions, 4 x hidden]``). int8 weights need zero points of 0, uint8 ones one zero
point for all rows. Bias, gates and states stay float.

The node keeps its name, outputs and attributes (but ``layout``, which the kernel lacks: the
support table keeps batch-first LSTMs float). The weights' stored integers are the ones the weight
encoding chose (:mod:`requant.encoding.weight_encoding`), or the type's rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.ir.annotations import quant_type, set_quant_type, stored_values
from requant.ir.queries import is_op
from requant.passes._rewrite import drop_if_unused, new_initializer
from requant.types import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    UniformType,
    qcast,
)

__all__ = ["MS_DOMAIN", "write_dynamic_lstms"]

MS_DOMAIN = "com.microsoft"
_STORAGE = {"i8": ir.DataType.INT8, "u8": ir.DataType.UINT8}
_UNIFORM = (UniformQuantizedType, UniformQuantizedPerAxisType, UniformQuantizedSubChannelType)


def _grid(t: UniformType, directions: int, rows: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]] | None:
    """The type's scales and zero points as ``[directions]`` or ``[directions, rows]``; None if it
    has another layout."""
    if isinstance(t, UniformQuantizedType):
        return np.full(directions, t.scale), np.full(directions, t.zero_point)
    if isinstance(t, UniformQuantizedPerAxisType) and t.axis in (0, 1):
        scales, zeros = np.asarray(t.scales), np.asarray(t.zero_points)
        if t.axis == 0:
            return scales, zeros
        return np.tile(scales, (directions, 1)), np.tile(zeros, (directions, 1))
    if isinstance(t, UniformQuantizedSubChannelType) and t.scales.shape in ((directions, rows), (directions, rows, 1)):
        return t.scales.reshape(directions, rows), t.zero_points.reshape(directions, rows)
    return None


def _rewritable(node: ir.Node) -> list[tuple[ir.Value, UniformType]] | None:
    weights = [node.inputs[i] if i < len(node.inputs) else None for i in (1, 2)]
    found = []
    for value in weights:
        t = quant_type(value) if value is not None else None
        if value is None or value.const_value is None or not isinstance(t, _UNIFORM) or t.storage not in _STORAGE:
            return None
        shape = value.const_value.shape
        if len(shape) != 3 or _grid(t, shape[0], shape[1]) is None:  # type: ignore[arg-type]
            return None
        found.append((value, t))
    return found


def write_dynamic_lstms(model: ir.Model) -> int:
    """Rewrite every LSTM of the main graph whose two weights have 8-bit types; returns how many.

    The weights' types are cleared (the float weight stays only if something else reads it)."""
    graph = model.graph
    count = 0
    for node in [n for n in graph if is_op(n, "LSTM")]:
        weights = _rewritable(node)
        if weights is None:
            continue
        params: list[ir.Value] = []
        for index, (value, t) in zip((1, 2), weights, strict=True):
            assert value.const_value is not None
            data = value.const_value.numpy()
            chosen = stored_values(value)
            stored = (chosen if chosen is not None else qcast(data, t)).astype(t.storage_type.numpy_dtype)
            grid = _grid(t, data.shape[0], data.shape[1])
            assert grid is not None
            name = str(value.name)
            node.replace_input_with(index, new_initializer(graph, f"{name}_quantized", stored.transpose(0, 2, 1)))
            params += [
                new_initializer(graph, f"{name}_scale", grid[0].astype(np.float32)),
                new_initializer(graph, f"{name}_zero_point", grid[1].astype(t.storage_type.numpy_dtype)),
            ]
            set_quant_type(value, None)
            drop_if_unused(graph, value)
        node.resize_inputs(8)
        for param in params:
            node.resize_inputs(len(node.inputs) + 1)
            node.replace_input_with(len(node.inputs) - 1, param)
        node.op_type, node.domain = "DynamicQuantizeLSTM", MS_DOMAIN
        node.attributes.pop("layout", None)
        count += 1
    if count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return count
