"""Support tables: the patterns of ops that form one quantized kernel on a target, with their checks.

A check looks at graph facts (constant weights, group, layout) and config facts (dtypes,
granularities) and returns :class:`Accept` or :class:`Reject` with a reason, never a bare bool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import onnx_ir as ir

from requant.ir.annotations import element_name
from requant.ir.queries import constant
from requant.types import FLOAT_FORMATS

if TYPE_CHECKING:
    from requant.ir.requests import QuantizationSpec
    from requant.quantizers.config import QuantizationConfig
    from requant.targets.constraints import Join, SameScale
    from requant.targets.decompose import Decomposition

__all__ = [
    "Accept",
    "Check",
    "Match",
    "Pattern",
    "Reject",
    "SupportTable",
    "Verdict",
    "WeightRule",
    "non_float",
    "sums_activations",
]


@dataclass(frozen=True)
class Accept:
    """The pattern can be quantized with the config."""

    @property
    def accepted(self) -> bool:
        return True

    def __str__(self) -> str:
        return "accepted"


@dataclass(frozen=True)
class Reject:
    """The pattern cannot be quantized with the config, for ``reason`` (at ``at``, if one node is to blame)."""

    reason: str
    at: ir.Node | None = None

    @property
    def accepted(self) -> bool:
        return False

    def __str__(self) -> str:
        where = f" (at {self.at.name or self.at.op_type})" if self.at is not None else ""
        return f"{self.reason}{where}"


Verdict: TypeAlias = Accept | Reject


@dataclass(frozen=True)
class Match:
    """Nodes that matched a pattern, in pattern order."""

    pattern: Pattern
    nodes: tuple[ir.Node, ...]

    @property
    def name(self) -> str:
        return " -> ".join(n.name or n.op_type for n in self.nodes)


Check: TypeAlias = Callable[[Match, "QuantizationConfig"], Verdict]


@dataclass(frozen=True)
class Pattern:
    """A chain of op types, each consuming the previous one's only output, run as one kernel.

    ``dynamic``: the kernel quantizes its activations itself, from each run's values (ONNX
    Runtime's ``DynamicQuantizeLSTM``): only its weights get requests; its activation ports get
    none, and read whatever their producers and consumers make of them.
    """

    ops: tuple[str, ...]
    check: Check
    dynamic: bool = False

    @property
    def name(self) -> str:
        return "->".join(self.ops)


WeightRule: TypeAlias = "Callable[[ir.Node, ir.Value, QuantizationSpec], tuple[QuantizationSpec, str]]"


@dataclass(frozen=True)
class SupportTable:
    """A target's patterns, longest first (the matcher tries them in this order).

    ``weight_rule``: the target's adjustment of a weight's spec for one node and weight, with the note the
    report shows (``""`` when it changed nothing). ``decompositions``: ops the target has no int8
    kernel for, rewritten into ops it has before the quantizers annotate (by op type).
    ``same_scale``: the ops whose data inputs and output must carry one type, by op type, and what
    the target does where they differ (:mod:`requant.targets.constraints`; propagation resolves them).
    ``float_results``: the kernels the target computes in int8 with a float output (ONNX Runtime's QGemm
    and MatMulIntegerToFloat); one whose output only the model's caller reads (a classifier's logits)
    keeps it float: no reader needs it rounded to 8 bits. None: every output is quantized (TOSA).
    ``joins``: the ops that join inputs into one type (a Concat), by op type, and what the target does
    where an input would lose what it says there (:class:`~requant.targets.constraints.Join`).
    ``float_kernels``: ops the target keeps float whole, their inputs too (as a node named float), with the
    reason: a YOLO box decode's expectation over bins on ONNX Runtime (:mod:`requant.targets.bins`).
    ``float_ops``: ops the target computes in float where they stand, asking nothing of their ports (the int8
    kernels around them keep theirs, as placement's float groups), by name, with the reason: a GELU written out
    with erf on ONNX Runtime, which fuses it into one float kernel (:mod:`requant.passes.order_gelu`).
    """

    name: str
    patterns: tuple[Pattern, ...]
    weight_rule: WeightRule | None = None
    decompositions: tuple[Decomposition, ...] = ()
    same_scale: Mapping[str, SameScale] = field(default_factory=dict)
    float_results: Callable[[ir.Node], bool] | None = None
    joins: Mapping[str, Join] = field(default_factory=dict)
    float_kernels: Callable[[ir.Node], str | None] | None = None
    float_ops: Callable[[ir.Graph], Mapping[str, str]] | None = None

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.patterns, key=lambda p: -len(p.ops)))
        object.__setattr__(self, "patterns", ordered)

    def starting_with(self, op_type: str) -> list[Pattern]:
        return [p for p in self.patterns if p.ops[0] == op_type]

    def __str__(self) -> str:
        return self.name


def non_float(match: Match) -> str | None:
    """The first value crossing the pattern's boundary that is not a float tensor, if any."""
    inside = {id(o) for n in match.nodes for o in n.outputs}
    for node in match.nodes:
        for value in [*node.inputs, *node.outputs]:
            if value is None or (id(value) in inside and value not in match.nodes[-1].outputs):
                continue
            dtype = element_name(value.dtype)
            if dtype is not None and dtype not in FLOAT_FORMATS and value.const_value is None:
                return f"'{value.name}' ({dtype})"
    return None


def sums_activations(match: Match) -> bool:
    """The pattern starts with an Add of two activations: a residual connection."""
    first = match.nodes[0]
    return first.op_type == "Add" and all(v is not None and constant(v) is None for v in first.inputs)
