"""Where a ``.pte`` departs from the program it was lowered from: the first op whose output, computed by
the lowered prefix of the program that ends there, is further from float than the program's own.

The converted PT2E module is cut after an op (its graph's output set to that op's value, what nothing
then reads removed), exported from the same examples and lowered as the whole was; ExecuTorch's runtime
runs the cut ``.pte``, the cut module runs eagerly, and both are compared with the float model's value
of that op (the float program's node of the same name, run by an FX interpreter). The op *departs*
when the ``.pte``'s SQNR against float is more than ``GAP_DB`` under the module's, and under
``FLOAT_DB`` (the whole program's rule, :func:`requant.stages.pte.same`). The ops are bisected in graph
order (a departure is taken to stay in what reads it): about log2(ops) lowerings, only when the whole
``.pte`` was found departing. Equalization's channel factors are divided out of a scaled value first.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from requant.pt2e.equalize import unscaled
from requant.pt2e.quantizer import aten_name, folded_activation, look_at_outputs, role
from requant.report.outputs import sqnr

if TYPE_CHECKING:
    from requant.stages.pt2e import Exported

__all__ = ["cut_point", "departing_op", "float_name", "written_by"]


def _cut(module: Any, name: str) -> Any:
    """A copy of ``module`` (a GraphModule) that returns the value of its node ``name``."""
    cut = copy.deepcopy(module)
    graph = cut.graph
    node = next(n for n in graph.nodes if n.name == name)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((node,),)
    graph.eliminate_dead_code()
    cut.recompile()
    return cut


def float_name(graph: Any, name: str) -> str:
    """The float program's node whose value the converted program's node ``name`` computes: a conv whose
    batch norm ``prepare_pt2e`` folded into it computes the batch norm's output."""
    node = next((n for n in graph.nodes if n.name == name), None)
    users = list(node.users) if node is not None else []
    if len(users) == 1 and "batch_norm" in str(users[0].target):  # aten.batch_norm, or a variant's item 0
        first = next((u for u in users[0].users if "getitem" in str(u.target) and u.args[1] == 0), None)
        return str(first.name if first is not None else users[0].name)
    return name


def _float_values(exported: Exported, name: str, samples: Sequence[Any]) -> np.ndarray:
    from requant.backends.executorch.runtime import contiguous

    found: list[np.ndarray] = []
    module = exported.module
    name = float_name(module.graph, name)

    def keep(node: Any, out: Any) -> None:
        if node.name == name:
            found.append(out.detach().numpy().copy())

    look_at_outputs(module, [tuple(contiguous(s[n]) for n in exported.names) for s in samples], keep)
    return np.concatenate([f.reshape(-1) for f in found])


def cut_point(node: Any) -> str | None:
    """Where to cut after ``node``: the dequantize reading its output's quantize (the int8 op whole), the
    node itself when its output stays float, None when an activation folded into it follows."""
    users = list(node.users)
    quantize = next((u for u in users if "quantize_per_tensor" in str(u.target)), None)
    if quantize is not None:
        return next((u.name for u in quantize.users if "dequantize" in str(u.target)), None)
    tensor = node.meta.get("val")
    return None if folded_activation(node) is not None or not hasattr(tensor, "dtype") else node.name


def _named(op: Any) -> tuple[str, str]:
    """The op's name and ATen op, an activation named by the kernel or binary op it is folded into."""
    before: Any = op.args[0] if op.args else None
    if role(op) == "activation" and hasattr(before, "users") and len(before.users) == 1:
        return before.name, f"{aten_name(before)} with {aten_name(op)} {op.name} folded"
    return op.name, str(aten_name(op))


def written_by(converted: Any, cut: str) -> str:
    """The node whose value the cut ``cut`` gives: before its quantize and dequantize, if any."""
    node = next(n for n in converted.graph.nodes if n.name == cut)
    return str(node.args[0].args[0].name) if "dequantize" in str(node.target) else cut


def _departs(exported: Exported, converted: Any, name: str, at: str, samples: Sequence[Any],
             example: tuple[Any, ...]) -> tuple[bool, float, float]:  # fmt: skip
    """Whether the lowered prefix ending at ``at`` (the value of op ``name``) departs; its SQNR against
    float, and the module's."""
    import torch

    from requant.backends.executorch import ModuleSession, PteSession, lower_to_pte

    cut = _cut(converted, at)
    pte = PteSession(lower_to_pte(torch.export.export(cut, example)).pte, exported.names)
    program = ModuleSession(cut, exported.names)
    f = _float_values(exported, name, samples)
    written = written_by(converted, at)  # equalization scaled its channels: divided out to compare with float
    p = np.concatenate([unscaled(converted, written, program.run(None, s)[0]).reshape(-1) for s in samples])
    q = np.concatenate([unscaled(converted, written, pte.run(None, s)[0]).reshape(-1) for s in samples])
    program_db, pte_db = sqnr(f, p), sqnr(f, q)
    from requant.stages.pte import same

    return not same(pte_db, program_db), pte_db, program_db


def departing_op(
    exported: Exported, converted: Any, samples: Sequence[Any], example: tuple[Any, ...]
) -> tuple[str, str, float, float] | None:
    """The first op (name, ATen op) whose lowered prefix departs from the program, with its SQNR against
    float as lowered and as the program computes it; None when no prefix departs (the departure is
    then in what follows the last op: the program's outputs)."""
    in_float = {n.name for n in exported.module.graph.nodes}
    ops = [n for n in converted.graph.nodes if role(n) is not None and n.name in in_float]
    cuts = [(n, at) for n in ops if (at := cut_point(n)) is not None]
    low, high, found = 0, len(cuts) - 1, None
    while low <= high:
        mid = (low + high) // 2
        op, at = cuts[mid]
        departs, pte_db, program_db = _departs(exported, converted, op.name, at, samples, example)
        if departs:
            found, high = (*_named(op), pte_db, program_db), mid - 1
        else:
            low = mid + 1
    return found
