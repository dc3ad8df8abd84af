"""Lower an exported program to ExecuTorch with the XNNPACK partitioner, and say what was delegated.

``to_edge_transform_and_lower`` with ``XnnpackPartitioner`` hands XNNPACK every region it takes (int8
where the ops sit between dequantize and quantize nodes, float elsewhere); ``to_executorch`` writes the
program. :class:`Lowered` keeps the ``.pte``'s bytes and the coverage: the ops inside delegates, the ops
left to ExecuTorch's portable kernels, and for those the partitioner's reason where it logged one (its
``WhyNoPartition`` messages, read from its loggers while it runs).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from requant.errors import RequantError

__all__ = ["Lowered", "LoweringError", "lower_to_pte"]

_PARTITIONER_LOG = "executorch.backends.xnnpack.partition"
_PLUMBING = ("executorch_call_delegate", "getitem", "alloc", "output")


class LoweringError(RequantError):
    """ExecuTorch could not lower or write the program; names the step and what it said."""


@dataclass
class Lowered:
    """A ``.pte`` and what its delegates hold: ``delegated`` and ``portable`` ops by ATen name (counts),
    the portable ones by node with the partitioner's reason (``reasons``), and the delegates' count."""

    pte: bytes
    delegates: int
    delegated: dict[str, int] = field(default_factory=dict)
    portable: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def section(self) -> dict[str, Any]:
        inside, outside = sum(self.delegated.values()), sum(self.portable.values())
        return {"delegates": self.delegates, "ops_delegated": inside, "ops_not_delegated": outside,
                "coverage": inside / max(inside + outside, 1), "delegated": self.delegated,
                "not_delegated": self.portable, "why_not": self.reasons, "pte_bytes": len(self.pte)}  # fmt: skip


class _Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        node, reason = getattr(record.msg, "node", None), getattr(record.msg, "reason", None)
        if node is not None and reason:
            self.found.setdefault(str(node.name), str(reason))


@contextlib.contextmanager
def _partitioner_reasons() -> Iterator[_Reasons]:
    logger = logging.getLogger(_PARTITIONER_LOG)
    handler, level, propagate = _Reasons(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # its debug messages are the report's, not the user's console
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


_NAMESPACES = ("aten", "dim_order_ops", "quantized_decomposed", "higher_order")


def _op(node: Any) -> str:
    """``convolution`` for ``aten.convolution.default`` (an edge op's name), ``getitem`` for a function."""
    name = str(getattr(node.target, "__name__", node.target)).replace("::", ".")
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] in _NAMESPACES else parts[0]


def _coverage(program: Any) -> tuple[int, dict[str, int], list[Any]]:
    graph = program.graph_module.graph
    delegated: collections.Counter[str] = collections.Counter()
    delegates = 0
    for node in graph.nodes:
        if node.op == "get_attr" and node.target.startswith("lowered_module"):
            delegates += 1
            inner = getattr(program.graph_module, node.target).original_module.graph
            delegated.update(_op(n) for n in inner.nodes if n.op == "call_function")
    outside = [n for n in graph.nodes if n.op == "call_function" and not any(p in _op(n) for p in _PLUMBING)]
    return delegates, dict(sorted(delegated.items())), outside


def lower_to_pte(program: Any) -> Lowered:
    """``program`` (a ``torch.export.ExportedProgram``) lowered to XNNPACK and written as a ``.pte``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with _partitioner_reasons() as reasons:
        try:
            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
            raise LoweringError(f"ExecuTorch could not lower the program to XNNPACK: {said}") from exc
    delegates, delegated, outside = _coverage(edge.exported_program())
    try:
        pte = bytes(edge.to_executorch().buffer)
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
        raise LoweringError(f"ExecuTorch could not write the program (to_executorch): {said}") from exc
    portable = dict(sorted(collections.Counter(_op(n) for n in outside).items()))
    why = {n.name: reasons.found.get(n.name, "no XNNPACK config takes it") for n in outside}
    return Lowered(pte, delegates, delegated, portable, why)
