"""The pattern matcher: partition selected nodes into the target's patterns, longest match first."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

from requant.ir.queries import DEFAULT_DOMAINS
from requant.targets.table import Match, Pattern, SupportTable

__all__ = ["PatternMatcher"]


@dataclass(frozen=True)
class PatternMatcher:
    """Matches chains of ops against a support table; each node is in at most one match."""

    table: SupportTable

    def _extend(self, pattern: Pattern, first: ir.Node, allowed: set[ir.Node]) -> tuple[ir.Node, ...] | None:
        nodes = [first]
        for op in pattern.ops[1:]:
            out = nodes[-1].outputs[0] if nodes[-1].outputs else None
            if out is None or out.is_graph_output() or len(out.uses()) != 1:
                return None
            (use,) = tuple(out.uses())
            nxt = use.node
            if nxt.op_type != op or nxt.domain not in DEFAULT_DOMAINS or nxt not in allowed:
                return None
            nodes.append(nxt)
        return tuple(nodes)

    def match(
        self,
        nodes: Iterable[ir.Node],
        taken: set[ir.Node] = frozenset(),  # type: ignore[assignment]
        followers: Iterable[ir.Node] = (),
    ) -> tuple[list[Match], list[ir.Node]]:
        """(matches, nodes no pattern covers), in graph order. Nodes in ``taken`` are left out of new matches.

        A match starts at one of ``nodes``; its later nodes may also be ``followers``: a Conv selected
        by name still forms Conv+Relu with the Relu after it, as ONNX Runtime fuses them.
        """
        candidates = [n for n in nodes if n not in taken]
        allowed = set(candidates) | (set(followers) - set(taken))
        covered: set[ir.Node] = set()
        matches: list[Match] = []
        unmatched: list[ir.Node] = []
        for node in candidates:
            if node in covered:
                continue
            found = None
            if node.domain in DEFAULT_DOMAINS:
                for pattern in self.table.starting_with(node.op_type):
                    chain = self._extend(pattern, node, allowed - covered)
                    if chain is not None:
                        found = Match(pattern, chain)
                        break
            if found is None:
                unmatched.append(node)
                continue
            matches.append(found)
            covered.update(found.nodes)
        return matches, unmatched
