"""An ONNX model's linear layers rewritten as ``MatMulNBits`` (com.microsoft): weight-only blocks of 4 or 8
bits, the activations float (ONNX Runtime's CPU kernels for language models).

A ``MatMul`` whose second input is a 2-d float32 initializer ``[K, N]`` read by it alone becomes
``MatMulNBits(A, B, scales[, zero_points])`` with ``K``, ``N``, ``bits``, ``block_size`` and
``accuracy_level`` (:data:`ACCURACY_LEVELS`), its weight rounded by
:func:`~requant.llm.rounding.round_layer` when the layer's input moments are known (``moments``, by node
name), else to nearest. A weight whose ``K`` is smaller than one block is left float.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.errors import RequantError
from requant.llm.blocks import BlockFormat, dequantized_rows, pack, padded_rows, quantize_with, round_to_nearest
from requant.llm.budget import Candidate, promoted, stored_bytes
from requant.llm.clip import clipped_scales
from requant.llm.memory import on_disk
from requant.llm.rounding import METHODS, round_layer

__all__ = [
    "ACCURACY_LEVELS",
    "MS_DOMAIN",
    "BudgetError",
    "RoundingError",
    "block_table",
    "linear_weights",
    "tied_gathers",
    "to_matmul_nbits",
    "untied_embeddings",
    "weight_dims",
]

Array = npt.NDArray[Any]
MS_DOMAIN = "com.microsoft"
# MatMulNBits' accuracy_level by bits. 4 bits: 0, float math on the dequantized blocks (ONNX Runtime's quantizer's
# default). 8 bits: 4, the activations quantized to int8 per block at run time: ONNX Runtime 1.31 has no float
# kernel for 8-bit blocks and dequantizes the whole weight on every call (SmolLM2's LM head, [576, 49152], one
# token: 57.5 ms at level 0, 0.90 ms at level 4; 4 bits: 1.55 ms at level 0; interleaved, 2 threads)
ACCURACY_LEVELS = {4: 0, 8: 4}
# blocks of this many bits are rounded without the clipping search (clip; clip_gptq becomes GPTQ at the weights'
# own ranges, gptq_activation_order): at 8 bits it won 1 of
# SmolLM2's 151 layers (1.9 dB there, 0.01 dB on average; all layers at 8 bits, blocks of 128) and took 6.5 s of
# the 10 s its 8-bit LM head's rounding took
UNCLIPPED_BITS = 8


class BudgetError(RequantError):
    """A size budget (``--max-size``) the model cannot meet."""


class RoundingError(RequantError):
    """A layer whose input moments no rounding can use (not finite; not positive definite once damped)."""


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


@dataclass(frozen=True)
class Packed:
    """A rounded layer as ``MatMulNBits`` stores it (:func:`~requant.llm.blocks.pack`), packed as soon as it is
    rounded: half its codes' bytes at 4 bits, what the model's other layers' rounding holds meanwhile."""

    b: Array
    scales: Array
    zero_points: Array | None
    n: int
    k: int
    format: BlockFormat

    @classmethod
    def of(cls, blocked: Any) -> Packed:
        b, scales, zero_points = pack(blocked)
        return cls(b, scales, zero_points, int(blocked.codes.shape[0]), int(blocked.k), blocked.format)

    def kept(self, folder: Path | None, name: str) -> Packed:
        """These blocks written to ``folder`` (files named ``name``) and read back memory-mapped: the rounded
        layers then take no memory of the flow's (the file's pages are the system's to drop); as they are without
        a folder."""
        if folder is None:
            return self
        fields = [f for f in ("b", "scales", "zero_points") if getattr(self, f) is not None]
        arrays: dict[str, Any] = {f: on_disk(getattr(self, f), folder / f"{name}.{f}.npy") for f in fields}
        return dataclasses.replace(self, **arrays)


def _replace(graph: ir.Graph, node: ir.Node, weight: ir.Value, fmt: BlockFormat, packed: Packed) -> list[ir.Value]:
    """``node`` as ``MatMulNBits`` of ``packed``; its ``B``, ``scales`` and (asymmetric) ``zero_points``."""
    b, scales, zero_points = packed.b, packed.scales, packed.zero_points
    base, n = str(weight.name), packed.n
    inputs = [node.inputs[0], _initializer(graph, f"{base}_Q", b), _initializer(graph, f"{base}_scales",
                                                                                   scales.reshape(n, -1))]  # fmt: skip
    if zero_points is not None:
        inputs.append(_initializer(graph, f"{base}_zero_points", zero_points.reshape(n, -1)))
    attributes = {"K": packed.k, "N": n, "bits": fmt.bits, "block_size": fmt.block_size,
                  "accuracy_level": ACCURACY_LEVELS[fmt.bits]}  # fmt: skip
    new = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=node.name,
                  outputs=[ir.Value(name=node.outputs[0].name, shape=node.outputs[0].shape,
                                    type=node.outputs[0].type)])  # fmt: skip
    graph.insert_before(node, new)
    node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    return [v for v in inputs[1:] if v is not None]


def _label(node: ir.Node) -> str:
    """A node's name, or its first output's when it has none (the names of what replaces it start with it)."""
    return str(node.name or node.outputs[0].name)


def _block_gather(graph: ir.Graph, gather: ir.Node, inputs: list[ir.Value], fmt: BlockFormat, k: int,
                  before: list[ir.Node]) -> bool:  # fmt: skip
    """``gather`` replaced by ``GatherBlockQuantized`` of ``inputs`` (a table of one row of blocks per token, its
    scales and zero points), after ``before``; when ``K`` is not a multiple of the block, the rows carry the last
    block's padding, which a ``Slice`` drops (True then)."""
    padded, label = fmt.blocks(k) * fmt.block_size, _label(gather)
    attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": fmt.block_size, "bits": fmt.bits}
    new = ir.node("GatherBlockQuantized", [*inputs[:1], gather.inputs[1], *inputs[1:]], attributes=attributes,
                  domain=MS_DOMAIN, name=label)  # fmt: skip
    nodes = [*before, new]
    if padded != k:
        ends = [_initializer(graph, f"{label}_{what}", np.array([v], np.int64))
                for what, v in (("starts", 0), ("ends", k), ("axes", -1))]  # fmt: skip
        nodes.append(ir.node("Slice", [new.outputs[0], *ends], name=f"{label}_Slice"))
    for node in nodes:
        graph.insert_before(gather, node)
    last = nodes[-1].outputs[0]
    last.name, last.shape, last.type = gather.outputs[0].name, gather.outputs[0].shape, gather.outputs[0].type
    gather.outputs[0].name = None
    gather.outputs[0].replace_all_uses_with(last, replace_graph_outputs=True)
    graph.remove(gather, safe=True)
    return padded != k


def _tie(graph: ir.Graph, transpose: ir.Node, gather: ir.Node, stored: list[ir.Value], packed: Packed) -> str:
    """The tied embedding ``gather`` (of ``transpose`` of the LM head's weight) as ``GatherBlockQuantized`` of
    the LM head's blocks: its ``B`` reshaped to one row per token, the scales and zero points shared
    (:func:`_block_gather`). How it is stored, in words."""
    fmt, n, k = packed.format, packed.n, packed.k
    padded = fmt.blocks(k) * fmt.block_size
    shape = _initializer(graph, f"{_label(gather)}_shape", np.array([n, padded * fmt.bits // 8], np.int64))
    reshape = ir.node("Reshape", [stored[0], shape], name=f"{_label(gather)}_Reshape")
    sliced = _block_gather(graph, gather, [reshape.outputs[0], *stored[1:]], fmt, k, [reshape])
    if not transpose.outputs[0].uses():
        graph.remove(transpose, safe=True)
    if not sliced:
        return "reads the LM head's blocks"
    return f"reads the LM head's blocks, a Slice dropping the last block's padding (K = {k})"


def untied_embeddings(graph: ir.Graph, ids: str = "input_ids") -> dict[str, tuple[ir.Value, list[ir.Node]]]:
    """The embeddings with a table of their own, by table name: the ``Gather`` nodes (axis 0) of the graph's
    input ``ids`` from a 2-d float32 initializer that no other node reads (a position table, a rotary cache, is
    gathered by other indices)."""
    found = {}
    for value in graph.initializers.values():
        table, uses = value.const_value, value.uses()
        if table is None or table.dtype != ir.DataType.FLOAT or len(table.shape) != 2 or not uses:
            continue
        if all(u.node.op_type == "Gather" and u.node.domain in ("", "ai.onnx") and u.idx == 0
               and u.node.attributes.get_int("axis", 0) == 0 and u.node.inputs[1] is not None
               and u.node.inputs[1].is_graph_input() and u.node.inputs[1].name == ids for u in uses):  # fmt: skip
            found[str(value.name)] = (value, [u.node for u in uses])
    return found


# table rows rounded at a time (a vocabulary of 128k tokens: 32 chunks, each a few MB of float64 blocks)
TABLE_ROWS = 4096


def _table_blocks(table: Array, fmt: BlockFormat) -> tuple[Packed, float]:
    """An embedding's table ``[V, H]`` in blocks along ``H`` (one row of blocks per token), :data:`TABLE_ROWS` rows
    at a time, each block's range clipped to the ratio that leaves its row the least error (a gather's output is
    the row itself: :func:`~requant.llm.clip.clipped_scales` with ``H = I``); and the table's SQNR in dB."""
    parts, signal, noise = [], 0.0, 0.0
    for start in range(0, table.shape[0], TABLE_ROWS):
        rows = np.asarray(table[start : start + TABLE_ROWS], np.float32)
        cut = padded_rows(rows.T, fmt)  # (once, for the search and the rounding)
        blocked = quantize_with(rows.T, *clipped_scales(rows.T, None, fmt, rows=cut), fmt, cut)
        signal += float(np.sum(np.square(rows, dtype=np.float64)))
        noise += float(np.sum(np.square(dequantized_rows(blocked) - rows, dtype=np.float64)))
        parts.append(pack(blocked))
    b, scales = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    zero_points = None if fmt.symmetric else np.concatenate([p[2] for p in parts])
    packed = Packed(b, scales, zero_points, int(table.shape[0]), int(table.shape[1]), fmt)
    return packed, 10 * np.log10(signal / noise) if noise > 0 else float("inf")


def block_table(graph: ir.Graph, table: ir.Value, gathers: list[ir.Node], fmt: BlockFormat | None) -> dict[str, Any]:
    """An embedding's table of its own as ``GatherBlockQuantized`` blocks in ``fmt`` read by each of its
    ``gathers`` (:func:`_table_blocks`); its record (or why it stayed float: no ``fmt``, or too short)."""
    n, k = weight_dims(table)  # ([V, H]: a row per token)
    record: dict[str, Any] = {"table": str(table.name), "k": k, "n": n, "gathers": [_label(g) for g in gathers],
                              "bytes": table.const_value.nbytes}  # type: ignore[union-attr]  # fmt: skip
    if fmt is None:
        record["float"] = "not asked (embedding_format; --embedding-bits)"
        return record
    record["bits"] = fmt.bits
    if k < fmt.block_size:
        record["float"] = f"K = {k} is less than one block of {fmt.block_size}"
        return record
    packed, record["sqnr_db"] = _table_blocks(np.asarray(table.const_value.numpy()), fmt)  # type: ignore[union-attr]
    base = str(table.name)
    inputs = [_initializer(graph, f"{base}_Q", packed.b.reshape(n, -1)),
              _initializer(graph, f"{base}_scales", packed.scales.reshape(n, -1))]  # fmt: skip
    if packed.zero_points is not None:
        inputs.append(_initializer(graph, f"{base}_zero_points", packed.zero_points.reshape(n, -1)))
    sliced = [_block_gather(graph, g, inputs, fmt, k, []) for g in gathers]
    graph.initializers.pop(base)
    record["how"] = "each block's range clipped for the least error on its rows" + (
        f", a Slice dropping the last block's padding (K = {k})" if any(sliced) else ""
    )
    return record


def weight_dims(weight: ir.Value) -> tuple[int, int]:
    """A linear layer's weight's ``(K, N)`` (a 2-d tensor's two sizes)."""
    k, n = weight.const_value.shape.numpy()  # type: ignore[union-attr]
    return int(k), int(n)


def _round(name: str, w: Array, h: Array | None, fmt: BlockFormat,
           methods: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """``w`` (layer ``name``'s) in ``fmt`` by :func:`~requant.llm.rounding.round_layer` on its input moments
    ``h`` (8 bits: without the clipping search, :data:`UNCLIPPED_BITS`), or to nearest without them; the
    rounding's record. Moments that are not finite, or that GPTQ cannot factor once damped, are a
    :class:`RoundingError` naming the layer."""
    if h is None:
        return round_to_nearest(w, fmt), {"chosen": "nearest", "why": "no input moments"}
    if not np.isfinite(h).all():
        raise RoundingError(f"layer {name}: its calibration inputs hold NaN or infinity (the float model "
                            "overflows on the calibration text?): no rounding can be chosen on them")  # fmt: skip
    if fmt.bits >= UNCLIPPED_BITS:  # GPTQ at the weights' own ranges in place of the clipping search's
        methods = tuple(dict.fromkeys("gptq_activation_order" if m == "clip_gptq" else m for m in methods
                                      if m != "clip"))  # fmt: skip
    try:
        return round_layer(w, h, fmt, methods)
    except np.linalg.LinAlgError as exc:
        raise RoundingError(f"layer {name}: {exc}") from None


def _planned_bytes(graph: ir.Graph, planned: Mapping[str, tuple[BlockFormat, int, int]]) -> int:
    """The model's weights once the ``planned`` tensors (by name: their format, ``K``, ``N``) are blocks: every
    other initializer as it is, plus each one's blocks (:func:`~requant.llm.budget.stored_bytes`)."""
    others = sum(v.const_value.nbytes for v in graph.initializers.values()
                 if v.const_value is not None and str(v.name) not in planned)  # fmt: skip
    return others + sum(stored_bytes(f, k, n) for f, k, n in planned.values())


def _plan(layers: Mapping[str, tuple[ir.Node, ir.Value]], formats: Mapping[str, BlockFormat],
          tables: Mapping[str, tuple[ir.Value, list[ir.Node]]],
          embedding_format: BlockFormat | None) -> dict[str, tuple[BlockFormat, int, int]]:  # fmt: skip
    """The tensors that become blocks, by name: each layer's weight in its format, each untied embedding's table
    (``[V, H]``: ``K`` is ``H``) in ``embedding_format`` when it is at least a block long."""
    planned = {str(layers[name][1].name): (f, *weight_dims(layers[name][1])) for name, f in formats.items()}
    if embedding_format is None:
        return planned
    for table, _ in tables.values():
        n, k = weight_dims(table)  # ([V, H]: a row per token)
        if k >= embedding_format.block_size:
            planned[str(table.name)] = (embedding_format, k, n)
    return planned


def _fit(layers: Mapping[str, tuple[ir.Node, ir.Value]], rounded: dict[str, tuple[Packed, BlockFormat]],
         records: Mapping[str, dict[str, Any]], moments: Mapping[str, Array], room: int,
         methods: tuple[str, ...], folder: Path | None) -> None:  # fmt: skip
    """Give 8 bits to the 4-bit layers that leave the most output error per byte, within ``room`` more bytes
    (:mod:`requant.llm.budget`): rounded again at 8 bits by ``methods``, their records saying so (their blocks
    kept in ``folder`` as :meth:`Packed.kept` says)."""
    formats = {name: fmt for name, (_, fmt) in rounded.items()}
    candidates = []
    for name, fmt in formats.items():
        error, (k, n) = records[name]["rounding"].get("output_error"), (records[name]["k"], records[name]["n"])
        if fmt.bits == 4 and error is not None:
            wider = BlockFormat(8, fmt.block_size, fmt.symmetric)
            candidates.append(Candidate(name, float(error), stored_bytes(wider, k, n) - stored_bytes(fmt, k, n)))
    for name in promoted(candidates, room):
        fmt = BlockFormat(8, formats[name].block_size, formats[name].symmetric)
        w = np.asarray(layers[name][1].const_value.numpy(), np.float32)  # type: ignore[union-attr]
        record = records[name]
        record["budget"] = {"bits": 4, "output_error": record["rounding"]["output_error"],
                            "why": "8 bits within --max-size: among the most 4-bit output error per byte"}  # fmt: skip
        blocked, record["rounding"] = _round(name, w, moments.get(name), fmt, methods)
        rounded[name], record["bits"] = (Packed.of(blocked).kept(folder, f"{list(layers).index(name)}-8"), fmt), 8


def to_matmul_nbits(model: ir.Model, fmt: BlockFormat, moments: Mapping[str, Array] | None = None,
                    methods: tuple[str, ...] = METHODS, progress: Callable[[int, float], None] | None = None,
                    tied_format: BlockFormat | None = None, max_bytes: int | None = None,
                    framing: int = 0, folder: Path | None = None,
                    embedding_format: BlockFormat | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Rewrite ``model``'s linear layers (in place) as ``MatMulNBits`` in ``fmt`` (a layer tied to an embedding:
    in ``tied_format`` when given); with ``max_bytes``, the 4-bit layers that cost the most get 8 bits within it
    (:mod:`requant.llm.budget`; the model's tensors and ``framing``, what its file holds beyond them; a
    :class:`BudgetError` before any rounding when even ``fmt`` does not fit). A record per layer (its name, ``K``,
    ``N``, bits, the rounding chosen and each one's output SQNR, how its tied embedding reads it, or why it
    stayed float). ``folder``: where each layer's blocks are kept as soon as they are rounded
    (:meth:`Packed.kept`), for as long as the model is used. Each embedding with a table of its own
    (:func:`untied_embeddings`) is recorded after the layers (a record with ``table`` and ``gathers``:
    :func:`block_table`): with ``embedding_format``, a ``GatherBlockQuantized`` of blocks in it, else kept float."""
    graph, moments = model.graph, moments or {}
    ties, started = tied_gathers(graph), time.perf_counter()
    layers = linear_weights(graph, ties)
    formats = {name: tied_format if tied_format is not None and str(w.name) in ties else fmt
               for name, (_, w) in layers.items() if weight_dims(w)[0] >= fmt.block_size}  # fmt: skip
    tables = untied_embeddings(graph)
    room = None
    if max_bytes is not None:
        planned = _plan(layers, formats, tables, embedding_format)
        room = max_bytes - framing - _planned_bytes(graph, planned)
        if room < 0:
            raise BudgetError(f"the model is {(max_bytes - room) / 1e6:.1f} MB with every layer in {fmt.bits}-bit "
                              f"blocks of {fmt.block_size}: more than --max-size {max_bytes / 1e6:.1f} MB")  # fmt: skip
    records: dict[str, dict[str, Any]] = {}
    rounded: dict[str, tuple[Packed, BlockFormat]] = {}
    for index, (name, (_, weight)) in enumerate(layers.items()):
        if progress is not None:
            progress(len(records), time.perf_counter() - started)
        (k, n), layer_fmt = weight_dims(weight), formats.get(name, fmt)
        record = records[name] = {"node": name, "k": k, "n": n, "bits": layer_fmt.bits}
        if name not in formats:
            record["float"] = f"K = {k} is less than one block of {layer_fmt.block_size}"
            continue
        h = moments.get(name)  # first: asking may run the layer's section, whose scales may change its weight
        w = np.asarray(weight.const_value.numpy(), np.float32)  # type: ignore[union-attr]
        blocked, record["rounding"] = _round(name, w, h, layer_fmt, methods)
        rounded[name] = (Packed.of(blocked).kept(folder, str(index)), layer_fmt)
    if room is not None:
        _fit(layers, rounded, records, moments, room, methods, folder)
    for name, (packed, layer_fmt) in rounded.items():
        node, weight = layers[name]
        stored = _replace(graph, node, weight, layer_fmt, packed)
        tied = ties.get(str(weight.name), [])
        if tied:
            records[name]["tied"] = {_label(g): _tie(graph, t, g, stored, packed) for t, g in tied}
        if not weight.uses():
            graph.initializers.pop(str(weight.name))
    untied = [block_table(graph, table, gathers, embedding_format) for table, gathers in tables.values()]
    if rounded or any("float" not in r for r in untied):
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return [*records.values(), *untied]
