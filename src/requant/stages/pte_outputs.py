"""Stage outputs of the ``executorch-xnnpack`` target: every output of the ``.pte`` against float, and a
remedy where one is far from it, as on ONNX targets (:mod:`requant.stages.outputs`).

Each output the program returns is measured part by part (:mod:`requant.report.outputs`: an output a
``cat`` writes is split into the cat's inputs, scores and values apart) on the samples the method was
chosen on (held out from calibration when there were enough), the ``.pte`` run by ExecuTorch's runtime
against the float program run eagerly. Where a part is poor, the ops feeding that output (up to the
kernels before it) are annotated float in another quantization, lowered, measured again, and the
closer of the two kept. A part still poor is the summary's first line (``NOT USABLE AS IS``), and
``--strict`` exits 3.

Reads: the exported float program, the ``.pte``, the samples. Records: ``outputs`` (every part's
figures, what was tried, what is poor), in the shape the ONNX targets' stage records it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from requant.pt2e.quantizer import role
from requant.report.outputs import Split, compare_outputs, describe, poor_parts
from requant.stages.outputs import MAX_REGION, remedy_record

if TYPE_CHECKING:
    from torch.fx import Node

    from requant.calibration.samples import Samples
    from requant.options import Options
    from requant.stages.pt2e import Exported, Quantized

__all__ = ["check_outputs", "feeding", "measure", "output_nodes", "splits"]

log = logging.getLogger("requant")


def output_nodes(program: Any) -> list[Node]:
    """The nodes the program returns, in order."""
    out = next(n for n in program.graph.nodes if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def splits(program: Any) -> dict[str, Split]:
    """The outputs a ``cat`` writes: its axis and its inputs' names and sizes along it."""
    found: dict[str, Split] = {}
    for node in output_nodes(program):
        if getattr(node, "op", None) != "call_function" or "cat" not in str(node.target):
            continue
        args: list[Any] = list(node.args)
        inputs, axis = args[0], int(args[1]) if len(args) > 1 else int(node.kwargs.get("dim", 0))  # type: ignore[arg-type]
        rank = len(node.meta["val"].shape)
        found[node.name] = (axis, [(str(i.name), int(i.meta["val"].shape[axis % rank])) for i in inputs])
    return found


def measure(exported: Exported, pte: Any, samples: Sequence[Any], floats: list[list[Any]]) -> list[dict[str, Any]]:
    """Every part of every output of ``pte`` against ``floats`` (the float program's outputs on
    ``samples``, each a list of outputs)."""
    names = [n.name for n in output_nodes(exported.program)]
    ints = [pte.run(None, s) for s in samples]
    return compare_outputs(names, floats, ints, splits(exported.program))


def feeding(program: Any, outputs: set[str]) -> list[str]:
    """The ops between each of ``outputs`` and the kernels before it (the kernel itself when one writes
    the output), at most ``MAX_REGION``, by node name."""
    region: dict[str, None] = {}
    for node in output_nodes(program):
        if node.name not in outputs or node.op != "call_function":
            continue
        if role(node) == "kernel":
            region[node.name] = None
            continue
        stack = [node]
        while stack and len(region) < MAX_REGION:
            current = stack.pop()
            if current.op != "call_function" or current.name in region or role(current) == "kernel":
                continue
            region[current.name] = None
            stack += [a for a in current.all_input_nodes if a.op == "call_function"]
    return list(region)


def check_outputs(
    exported: Exported, run: Quantized, samples: Samples, options: Options
) -> tuple[Quantized, dict[str, Any]]:
    """The quantization kept (the remedied one when it is closer to float), and the ``outputs`` record."""
    from requant.backends.executorch import PteSession
    from requant.stages.pt2e import CHOICE_SAMPLES, quantize_once

    held = int(run.choice.get("held_out", 0))
    compared = samples.head(exported.signature, held or CHOICE_SAMPLES)
    floats = exported.float_outputs(compared)  # run once: the method choice compared the same samples
    parts = measure(exported, PteSession(run.lowered.pte, exported.names), compared, floats)
    found: dict[str, Any] = {"samples": len(compared), "held_out": bool(held), "parts": parts}
    poor = poor_parts(parts)
    region = feeding(exported.program, {p["output"] for p in poor}) if poor else []
    if region:
        log.warning("%s; keeping the %d ops feeding it float and quantizing again", describe(poor[0]), len(region))
        why = {n: "it feeds an output far from float (the outputs' remedy)" for n in region}
        other = quantize_once(exported, samples, options, why, run.choice.get("chosen"))
        tried = measure(exported, PteSession(other.lowered.pte, exported.names), compared, floats)
        found["remedy"] = remedy_record(parts, region, tried)
        log.warning(
            "the %d ops feeding it kept float: %s", len(region), "closer" if found["remedy"]["kept"] else "no closer"
        )
        if found["remedy"]["kept"]:
            other.records["method_choice"] = run.choice
            run, poor = other, poor_parts(tried)
    found["poor"] = [describe(p) for p in poor]
    return run, {"outputs": found}
