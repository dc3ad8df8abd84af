"""An int8 embedding table that only float ops read after its Gather becomes ``GatherBlockQuantized`` rows.

The int8 annotation gives an embedding table one scale (the Gather moves its bytes, so its output shares
the table's scale). Where no int8 kernel reads the gathered rows (LAC's tagger: the rows go through a
Transpose to a float GRU), that one scale buys nothing over rows with scales of their own, and costs
accuracy: LAC's 58,224 x 128 table on one scale left its output at 45.0 dB against float, 1 tag in 500
changed; in 8-bit blocks of 32 along each row (ONNX Runtime's ``GatherBlockQuantized``, ``com.microsoft``,
which gathers the rows and dequantizes only them) 47.1 dB, no tag changed, the same latency and 10.1 MB
instead of 9.2 (the float table: 30.4 MB, 47.8 dB). The blocks are the weight-only flow's
(:func:`requant.llm.nbits.block_table`: each block's range clipped for the least error on its rows).

Rewritten: a 2-d constant table with an 8-bit type read only by ``Gather`` nodes on axis 0, whose
gathered values (and the data movement after them that shares the table's type) are read by no int8
kernel. Their types are cleared (they are float now: no QuantizeLinear, DequantizeLinear pairs between
them). Run before the QDQ model is written, for targets that run ONNX Runtime's contrib ops (not an
integer-only one).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from requant.backends.dynamic_lstm import MS_DOMAIN
from requant.ir.annotations import quant_type, set_quant_type
from requant.ir.provenance import RESCALE_KEY
from requant.ir.queries import is_op
from requant.llm.blocks import BlockFormat
from requant.llm.nbits import block_table
from requant.quantizers.pattern_quantizer import ANNOTATED_KEY, asks_for_int8
from requant.quantizers.shared import SharedSpecQuantizer
from requant.types import UniformQuantizedType

__all__ = ["BLOCK", "write_embedding_rows"]

BLOCK = 32  # values per scale along a row (LAC: 47.1 dB at 32, 46.7 at 128, one scale a row)


def _gathers(table: ir.Value) -> list[ir.Node] | None:
    """The Gathers reading ``table`` as their data on axis 0, when nothing else reads it."""
    uses = list(table.uses())
    if not uses or table.is_graph_output() or table.is_graph_input():
        return None
    for use in uses:
        node = use.node
        if not is_op(node, "Gather") or use.idx != 0 or node.attributes.get_int("axis", 0) != 0:
            return None
    return [u.node for u in uses]


def _float_rows(gather: ir.Node, t: Any, shared: str) -> list[ir.Value] | None:
    """The gathered values and the data movement after them sharing the table's type ``t``, when no int8
    kernel reads any of them; None when one does."""
    found, stack = [], [gather.outputs[0]]
    while stack:
        value = stack.pop()
        found.append(value)
        for use in value.uses():
            node = use.node
            marked = node.metadata_props.get(ANNOTATED_KEY, "")
            if marked == shared and all(quant_type(o) == t for o in node.outputs):
                stack += [o for o in node.outputs if o not in found]
            elif asks_for_int8(marked) or RESCALE_KEY in node.metadata_props:
                return None  # an int8 kernel (or a rescale before one) reads the rows
    return found


def write_embedding_rows(model: ir.Model) -> list[dict[str, Any]]:
    """Rewrite each such table of the main graph (see the module's docstring); the records of what was done."""
    graph, shared = model.graph, SharedSpecQuantizer().describe()
    records = []
    for table in list(graph.initializers.values()):
        t = quant_type(table)
        shape = table.const_value.shape.numpy() if table.const_value is not None else ()
        if not isinstance(t, UniformQuantizedType) or len(shape) != 2 or shape[1] < BLOCK:
            continue
        gathers = _gathers(table)
        rows = [_float_rows(g, t, shared) for g in gathers or []]
        if not gathers or any(r is None for r in rows):
            continue
        record = block_table(graph, table, gathers, BlockFormat(bits=8, block_size=BLOCK, symmetric=False))
        for value in (v for r in rows if r is not None for v in r):
            set_quant_type(value, None)
        records.append(record)
    if records:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return records
