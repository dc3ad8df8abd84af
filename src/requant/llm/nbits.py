"""An ONNX model's linear layers rewritten as ``MatMulNBits`` (com.microsoft): weight-only blocks of 4 or 8
bits, the activations float (ONNX Runtime's CPU kernels for language models).

A ``MatMul`` whose second input is a 2-d float32 initializer ``[K, N]`` read by it alone becomes
``MatMulNBits(A, B, scales[, zero_points])`` with ``K``, ``N``, ``bits``, ``block_size`` and
``accuracy_level`` (:data:`ACCURACY_LEVELS`), its weight rounded by
:func:`~requant.llm.rounding.round_layer` when the layer's input moments are known (``moments``, by node
name), else to nearest. A weight whose ``K`` is smaller than one block is left float.
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

__all__ = ["ACCURACY_LEVELS", "MS_DOMAIN", "linear_weights", "tied_gathers", "to_matmul_nbits"]

Array = npt.NDArray[Any]
MS_DOMAIN = "com.microsoft"
# MatMulNBits' accuracy_level by bits. 4 bits: 0, float math on the dequantized blocks (ONNX Runtime's quantizer's
# default). 8 bits: 4, the activations quantized to int8 per block at run time: ONNX Runtime 1.31 has no float
# kernel for 8-bit blocks and dequantizes the whole weight on every call (SmolLM2's LM head, [576, 49152], one
# token: 57.5 ms at level 0, 0.90 ms at level 4; 4 bits: 1.55 ms at level 0; interleaved, 2 threads)
ACCURACY_LEVELS = {4: 0, 8: 4}


def tied_gathers(graph: ir.Graph) -> dict[str, list[tuple[ir.Node, ir.Node]]]:
    """The embeddings tied to a linear layer's weight, by weight name: each ``Gather`` (axis 0) whose table
    is a ``Transpose`` of a 2-d initializer that a ``MatMul`` reads (the LM head of a tied embedding), with
    that ``Transpose``."""
    found: dict[str, list[tuple[ir.Node, ir.Node]]] = {}
    for node in graph:
        w = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if w is None or not w.is_initializer() or list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
            continue
        readers = [(u.node, u.idx) for u in node.outputs[0].uses()]
        gathers = [
            n for n, idx in readers if n.op_type == "Gather" and idx == 0 and n.attributes.get_int("axis", 0) == 0
        ]
        if gathers and len(gathers) == len(readers) and any(u.node.op_type == "MatMul" for u in w.uses()):
            found.setdefault(str(w.name), []).extend((node, g) for g in gathers)
    return found


def linear_weights(
    graph: ir.Graph, ties: Mapping[str, list[tuple[ir.Node, ir.Node]]] | None = None
) -> dict[str, tuple[ir.Node, ir.Value]]:
    """The ``MatMul`` nodes with a 2-d float32 initializer weight of their own (or shared only with tied
    embeddings: ``ties``, :func:`tied_gathers`' when not given), by node name, in graph order."""
    found = {}
    ties = tied_gathers(graph) if ties is None else ties
    for node in graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        if w is None or not w.is_initializer() or w.const_value is None:
            continue
        if len(w.uses()) != 1 + len({id(t) for t, _ in ties.get(str(w.name), [])}):
            continue
        if w.const_value.dtype == ir.DataType.FLOAT and len(w.const_value.shape) == 2:
            found[str(node.name)] = (node, w)
    return found


def _initializer(graph: ir.Graph, name: str, data: Array) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(data, name=name))
    graph.register_initializer(value)
    return value


def _replace(graph: ir.Graph, node: ir.Node, weight: ir.Value, fmt: BlockFormat, blocked: Any) -> list[ir.Value]:
    """``node`` as ``MatMulNBits`` of ``blocked``; its ``B``, ``scales`` and (asymmetric) ``zero_points``."""
    b, scales, zero_points = pack(blocked)
    base, n = str(weight.name), int(blocked.codes.shape[0])
    inputs = [node.inputs[0], _initializer(graph, f"{base}_Q", b), _initializer(graph, f"{base}_scales",
                                                                                   scales.reshape(n, -1))]  # fmt: skip
    if zero_points is not None:
        inputs.append(_initializer(graph, f"{base}_zero_points", zero_points.reshape(n, -1)))
    attributes = {"K": blocked.k, "N": n, "bits": fmt.bits, "block_size": fmt.block_size,
                  "accuracy_level": ACCURACY_LEVELS[fmt.bits]}  # fmt: skip
    new = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=node.name,
                  outputs=[ir.Value(name=node.outputs[0].name, shape=node.outputs[0].shape,
                                    type=node.outputs[0].type)])  # fmt: skip
    graph.insert_before(node, new)
    node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    return [v for v in inputs[1:] if v is not None]


def _tie(graph: ir.Graph, transpose: ir.Node, gather: ir.Node, stored: list[ir.Value], blocked: Any) -> str:
    """The tied embedding ``gather`` (of ``transpose`` of the LM head's weight) as ``GatherBlockQuantized`` of
    the LM head's blocks: its ``B`` reshaped to one row per token, the scales and zero points shared; when ``K``
    is not a multiple of the block, the rows carry the last block's padding, which a ``Slice`` drops. How it is
    stored, in words."""
    fmt, n, k = blocked.format, int(blocked.codes.shape[0]), blocked.k
    padded = fmt.blocks(k) * fmt.block_size
    shape = _initializer(graph, f"{gather.name}_shape", np.array([n, padded * fmt.bits // 8], np.int64))
    reshape = ir.node("Reshape", [stored[0], shape], name=f"{gather.name}_Reshape")
    attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": fmt.block_size, "bits": fmt.bits}
    new = ir.node("GatherBlockQuantized", [reshape.outputs[0], gather.inputs[1], *stored[1:]], attributes=attributes,
                  domain=MS_DOMAIN, name=gather.name)  # fmt: skip
    nodes = [reshape, new]
    if padded != k:
        ends = [_initializer(graph, f"{gather.name}_{what}", np.array([v], np.int64))
                for what, v in (("starts", 0), ("ends", k), ("axes", -1))]  # fmt: skip
        nodes.append(ir.node("Slice", [new.outputs[0], *ends], name=f"{gather.name}_Slice"))
    for node in nodes:
        graph.insert_before(gather, node)
    last = nodes[-1].outputs[0]
    last.name, last.shape, last.type = gather.outputs[0].name, gather.outputs[0].shape, gather.outputs[0].type
    gather.outputs[0].name = None
    gather.outputs[0].replace_all_uses_with(last, replace_graph_outputs=True)
    graph.remove(gather, safe=True)
    if not transpose.outputs[0].uses():
        graph.remove(transpose, safe=True)
    if padded == k:
        return "reads the LM head's blocks"
    return f"reads the LM head's blocks, a Slice dropping the last block's padding (K = {k})"


def to_matmul_nbits(model: ir.Model, fmt: BlockFormat, moments: Mapping[str, Array] | None = None,
                    methods: tuple[str, ...] = METHODS, progress: Callable[[int, float], None] | None = None,
                    tied_format: BlockFormat | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Rewrite ``model``'s linear layers (in place) as ``MatMulNBits`` in ``fmt`` (a layer tied to an embedding:
    in ``tied_format`` when given); a record per layer (its name, ``K``, ``N``, bits, the rounding chosen and
    each one's output SQNR, how its tied embedding reads it, or why it stayed float)."""
    graph, moments = model.graph, moments or {}
    records: list[dict[str, Any]] = []
    ties, started = tied_gathers(graph), time.perf_counter()
    layers = linear_weights(graph, ties)
    for name, (node, weight) in layers.items():
        if progress is not None:
            progress(len(records), time.perf_counter() - started)
        w = np.asarray(weight.const_value.numpy(), np.float32)  # type: ignore[union-attr]
        k, n = w.shape
        layer_fmt = tied_format if tied_format is not None and str(weight.name) in ties else fmt
        record: dict[str, Any] = {"node": name, "k": int(k), "n": int(n), "bits": layer_fmt.bits}
        if k < layer_fmt.block_size:
            records.append({**record, "float": f"K = {k} is less than one block of {layer_fmt.block_size}"})
            continue
        h = moments.get(name)
        if h is None:
            blocked = round_to_nearest(w, layer_fmt)
            record["rounding"] = {"chosen": "nearest", "why": "no input moments"}
        else:
            blocked, record["rounding"] = round_layer(w, h, layer_fmt, methods)
        stored = _replace(graph, node, weight, layer_fmt, blocked)
        tied = ties.get(str(weight.name), [])
        if tied:
            record["tied"] = {str(g.name): _tie(graph, t, g, stored, blocked) for t, g in tied}
        if not weight.uses():
            graph.initializers.pop(str(weight.name))
        records.append(record)
    if any("rounding" in r for r in records):
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return records
