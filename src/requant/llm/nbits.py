"""An ONNX model's linear layers rewritten as ``MatMulNBits`` (com.microsoft): weight-only blocks of 4 or 8
bits, the activations float (ONNX Runtime's CPU kernels for language models).

A ``MatMul`` whose second input is a 2-d float32 initializer ``[K, N]`` read by it alone becomes
``MatMulNBits(A, B, scales[, zero_points])`` with ``K``, ``N``, ``bits``, ``block_size`` and
``accuracy_level`` (0: float math on the dequantized weights, ONNX Runtime's quantizer's default), its
weight rounded by :func:`~requant.llm.rounding.round_layer` when the layer's input moments are known
(``moments``, by node name), else to nearest. A weight whose ``K`` is smaller than one block is left float.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.llm.blocks import BlockFormat, pack, round_to_nearest
from requant.llm.rounding import METHODS, round_layer

__all__ = ["MS_DOMAIN", "linear_weights", "to_matmul_nbits", "untie"]

Array = npt.NDArray[Any]
MS_DOMAIN = "com.microsoft"


def linear_weights(graph: ir.Graph) -> dict[str, tuple[ir.Node, ir.Value]]:
    """The ``MatMul`` nodes with a 2-d float32 initializer weight of their own, by node name, in graph order."""
    found = {}
    for node in graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        if w is None or not w.is_initializer() or w.const_value is None or len(w.uses()) != 1:
            continue
        if w.const_value.dtype == ir.DataType.FLOAT and len(w.const_value.shape) == 2:
            found[str(node.name)] = (node, w)
    return found


def untie(graph: ir.Graph) -> list[dict[str, Any]]:
    """Give each ``MatMul`` whose 2-d float weight is also read through a ``Transpose`` (a tied embedding:
    the LM head's weight, transposed for the embedding's ``Gather``) the weight alone: each such
    ``Transpose`` becomes an initializer of its own (float). A record per weight untied."""
    records = []
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        w = node.inputs[0]
        if w is None or not w.is_initializer() or w.const_value is None or len(w.const_value.shape) != 2:
            continue
        if w.const_value.dtype != ir.DataType.FLOAT:
            continue
        readers = [u.node for u in w.uses()]
        if not any(r.op_type == "MatMul" for r in readers) or len(readers) < 2:
            continue
        perm = node.attributes.get_ints("perm", [1, 0])
        data = np.ascontiguousarray(np.transpose(w.const_value.numpy(), perm))
        name = f"{node.outputs[0].name}_untied"
        copy = ir.Value(name=name, shape=ir.Shape(data.shape), type=ir.TensorType(ir.DataType.FLOAT),
                        const_value=ir.tensor(data, name=name))  # fmt: skip
        graph.register_initializer(copy)
        node.outputs[0].replace_all_uses_with(copy, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        users = sorted(str(u.node.name) for u in copy.uses())
        records.append({"weight": str(w.name), "float_copy": name, "read_by": users})
    return records


def _replace(graph: ir.Graph, node: ir.Node, weight: ir.Value, fmt: BlockFormat, blocked: Any) -> None:
    b, scales, zero_points = pack(blocked)
    base = str(weight.name)
    inputs = [node.inputs[0]]
    for suffix, data in (("_Q", b), ("_scales", scales), ("_zero_points", zero_points)):
        if data is not None:
            value = ir.Value(name=f"{base}{suffix}", const_value=ir.tensor(data, name=f"{base}{suffix}"))
            graph.register_initializer(value)
            inputs.append(value)
    k, n = blocked.k, int(blocked.codes.shape[0])
    attributes = {"K": k, "N": n, "bits": fmt.bits, "block_size": fmt.block_size, "accuracy_level": 0}
    new = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=node.name,
                  outputs=[ir.Value(name=node.outputs[0].name, shape=node.outputs[0].shape,
                                    type=node.outputs[0].type)])  # fmt: skip
    graph.insert_before(node, new)
    node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    graph.initializers.pop(base)


def to_matmul_nbits(model: ir.Model, fmt: BlockFormat, moments: Mapping[str, Array] | None = None,
                    methods: tuple[str, ...] = METHODS,
                    progress: Callable[[int, float], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Rewrite ``model``'s linear layers (in place) as ``MatMulNBits`` in ``fmt``; a record per layer (its
    name, ``K``, ``N``, the rounding chosen and each one's output SQNR, or why it stayed float)."""
    graph, moments = model.graph, moments or {}
    records: list[dict[str, Any]] = []
    layers, started = linear_weights(graph), time.perf_counter()
    for name, (node, weight) in layers.items():
        if progress is not None:
            progress(len(records), time.perf_counter() - started)
        w = np.asarray(weight.const_value.numpy(), np.float32)  # type: ignore[union-attr]
        k, n = w.shape
        record: dict[str, Any] = {"node": name, "k": int(k), "n": int(n)}
        if k < fmt.block_size:
            records.append({**record, "float": f"K = {k} is less than one block of {fmt.block_size}"})
            continue
        h = moments.get(name)
        if h is None:
            blocked, record["rounding"] = round_to_nearest(w, fmt), {"chosen": "nearest", "why": "no input moments"}
        else:
            blocked, record["rounding"] = round_layer(w, h, fmt, methods)
        _replace(graph, node, weight, fmt, blocked)
        records.append(record)
    if any("rounding" in r for r in records):
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return records
