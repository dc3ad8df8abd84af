"""The ``executorch-xnnpack`` target's report section as tables (title, header, rows), which the Markdown and
HTML pages both draw: what XNNPACK took, what it left and why, the ``.pte`` against its program, and the
PT2E quantizer's decision for each node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["executorch_tables"]

Table = tuple[str, tuple[str, ...], list[tuple[Any, ...]]]


def executorch_tables(report: Mapping[str, Any]) -> list[Table]:
    """The section's tables; none for another target's report."""
    section = report.get("executorch")
    if not section:
        return []
    against = section["against_program"]
    ops = section["ops_delegated"] + section["ops_not_delegated"]
    figures: list[tuple[Any, ...]] = [
        ("ops delegated to XNNPACK",
         f"{section['ops_delegated']} of {ops} ({section['coverage']:.0%}) in {section['delegates']} delegate(s)"),
        (".pte", f"{section['pte_bytes'] / 1e6:.2f} MB"),
        (".pte against float",
         f"{against['pte_sqnr_db']:.1f} dB, top-1 {against['pte_top1']:.3f} ({against['samples']} samples)"),
        ("its program against float", f"{against['program_sqnr_db']:.1f} dB, top-1 {against['program_top1']:.3f}"),
    ]  # fmt: skip
    tables: list[Table] = [("ExecuTorch program", ("figure", "value"), figures)]
    delegated: list[tuple[Any, ...]] = [(op, n) for op, n in section["delegated"].items()]
    tables.append(("Ops inside XNNPACK delegates", ("op", "count"), delegated))
    if section["why_not"]:
        left: list[tuple[Any, ...]] = [(node, why) for node, why in section["why_not"].items()]
        tables.append(("Ops left to ExecuTorch's portable kernels", ("node", "why (the partitioner's words)"), left))
    nodes = report.get("pt2e", {}).get("nodes", [])
    if nodes:
        decided: list[tuple[Any, ...]] = [(r["node"], r["op"], r["role"], r["config"], r["decision"]) for r in nodes]
        tables.append(("The PT2E quantizer's decisions", ("node", "op", "role", "config", "decision"), decided))
    return tables
