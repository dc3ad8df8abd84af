"""Decision records of the quantizers: what each one accepted and rejected, and why. Renders text and JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeDecision", "QuantizerRecord", "QuantizerReport"]


@dataclass
class NodeDecision:
    """One pattern (or one node) and what a quantizer decided for it."""

    nodes: list[str]
    pattern: str
    status: str  # "accepted", "rejected", "already annotated"
    reason: str = ""
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class QuantizerRecord:
    """Everything one quantizer did."""

    kind: str
    finder: str
    config: str
    table: str
    selected: int = 0
    decisions: list[NodeDecision] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for d in self.decisions if d.status == status)

    def to_json(self) -> dict[str, Any]:
        return {
            "quantizer": self.kind,
            "finder": self.finder,
            "config": self.config,
            "support_table": self.table,
            "selected_nodes": self.selected,
            "accepted": self.count("accepted"),
            "rejected": self.count("rejected"),
            "rejected_already_annotated": self.count("already annotated"),
            "decisions": [d.to_json() for d in self.decisions],
        }


@dataclass
class QuantizerReport:
    """The records of all quantizers of one run, and the nodes nobody annotated."""

    records: list[QuantizerRecord] = field(default_factory=list)
    unannotated: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decomposed: list[dict[str, str]] = field(default_factory=list)
    not_decomposed: list[dict[str, str]] = field(default_factory=list)
    preset_choice: str = ""  # why the global preset is the one it is, when requant chose it
    compute: str = ""  # a change of the model's float type before quantizing, and why
    random_seeded: list[str] = field(default_factory=list)  # random ops seeded while requant works (ir.random_ops)
    # groups of int8 ops between kernels, where they run and their modelled costs (quantizers.placement)
    placements: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "preset_choice": self.preset_choice,
            "compute": self.compute,
            "random_seeded": self.random_seeded,
            "decomposed": self.decomposed,
            "not_decomposed": self.not_decomposed,
            "placements": self.placements,
            "quantizers": [r.to_json() for r in self.records],
            "unannotated_nodes": self.unannotated,
            "warnings": self.warnings,
        }

    def summary(self) -> str:
        """The INFO-level text: one block per quantizer, then the nodes nobody annotated."""
        rule = "-" * 100
        lines = [rule, "QUANTIZATION REPORT".center(100), rule]
        if self.preset_choice:
            lines.append(f"Preset: {self.preset_choice}")
        if self.compute:
            lines.append(f"Compute: {self.compute}")
        for d in self.decomposed:
            lines.append(f"Decomposed {d['node']} into {d['into']} ({d['why']})")
        for d in self.not_decomposed:
            lines.append(f"Kept {d['node']}: {d['reason']}")
        for p in self.placements:
            if p["placed"] == "float":
                lines.append(f"Kept float {', '.join(p['nodes'])}: {p['why']}")
        if self.decomposed or self.not_decomposed or any(p["placed"] == "float" for p in self.placements):
            lines.append(rule)
        for r in self.records:
            lines.append(f"{r.kind} using {r.finder}")
            lines.append(f"Annotating with {r.config}")
            lines.append(f"Supported operators and patterns defined by {r.table}")
            lines.append(f"   Selected nodes: {r.selected}")
            lines.append(f"   Accepted patterns: {r.count('accepted')}")
            lines.append(f"   Rejected due to previous annotation: {r.count('already annotated')}")
            lines.append(f"   Rejected patterns: {r.count('rejected')}")
            lines.append(rule)
        lines.append("Non annotated nodes:")
        lines += [f"    {n}" for n in self.unannotated] or ["    None"]
        for w in self.warnings:
            lines.append(f"Warning: {w}")
        lines.append(rule)
        return "\n".join(lines)

    def details(self) -> str:
        """The DEBUG-level text: every decision with its input and output request maps, or its reason."""
        lines = []
        for r in self.records:
            lines.append(f"{r.kind} using {r.finder} ({r.config})")
            header = f"   {'NODES':<30} {'STATUS':<18} {'INPUT REQUESTS':<48} OUTPUT REQUESTS / REASON"
            lines.append(header)
            for d in r.decisions:
                ins = [f"{k}: {v}" for k, v in d.inputs.items()] or [""]
                if d.status == "accepted":
                    outs = [f"{k}: {v}" for k, v in d.outputs.items()] + ([f"note: {d.reason}"] if d.reason else [])
                else:
                    outs = [d.reason]
                for i in range(max(len(ins), len(outs))):
                    nodes = ", ".join(d.nodes) if i == 0 else ""
                    status = d.status if i == 0 else ""
                    left = ins[i] if i < len(ins) else ""
                    right = outs[i] if i < len(outs) else ""
                    lines.append(f"   {nodes:<30} {status:<18} {left:<48} {right}")
        return "\n".join(lines)
