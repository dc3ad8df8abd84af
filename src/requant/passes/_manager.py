"""Running passes: optional verification before and after each, timing, and the IR after each."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import onnx
import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.printer import print_model
from requant.ir.verifier import VerifyError, verify_problems
from requant.passes._base import Pass

__all__ = ["PassInvariantError", "PassOptions", "PassRecord", "run_passes"]


class PassInvariantError(RequantError):
    """A pass's declared precondition or postcondition did not hold."""


def _cause(exc: BaseException) -> str:
    inner = exc.__cause__ or exc
    return str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__


@dataclass(frozen=True)
class PassOptions:
    """How to run a pipeline (the switches of ``requant opt``)."""

    verify_each: bool = True
    check_onnx: bool = False  # also ONNX's checker after every pass (requant opt --verify-each)
    time_passes: bool = False
    print_ir_after_all: bool = False


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, its time, whether it changed the model."""

    name: str
    seconds: float
    modified: bool


def _verify(model: ir.Model, when: str) -> None:
    problems = verify_problems(model)
    if problems:
        raise VerifyError(f"the IR is not well formed {when} ({len(problems)} problems):\n  " + "\n  ".join(problems))


def _check_onnx(model: ir.Model, name: str) -> None:
    """ONNX's own checker on the model a pass left (what ONNX Runtime will be given)."""
    try:
        onnx.checker.check_model(ir.to_proto(model), full_check=False)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise VerifyError(f"after pass '{name}', ONNX's checker rejects the model: {first}") from None


def run_passes(
    model: ir.Model, passes: Sequence[Pass], options: PassOptions = PassOptions(), out: TextIO | None = None
) -> tuple[ir.Model, list[PassRecord]]:
    """Run ``passes`` in order on ``model`` (in place); returns the model and a record per pass.

    With ``verify_each`` the IR is verified before the first pass and after
    every pass, and a failure names the pass that broke it. Printed IR and the
    timing table go to ``out`` (standard error by default).
    """
    stream = out if out is not None else sys.stderr
    records: list[PassRecord] = []
    if options.verify_each:
        _verify(model, "before the first pass")
    for p in passes:
        start = time.perf_counter()
        try:
            result = p(model)
        except ir.passes.PreconditionError as exc:
            raise PassInvariantError(f"pass '{p.name}': its precondition does not hold: {_cause(exc)}") from exc
        except ir.passes.PostconditionError as exc:
            raise PassInvariantError(f"pass '{p.name}' broke what it ensures: {_cause(exc)}") from exc
        records.append(PassRecord(p.name, time.perf_counter() - start, result.modified))
        model = result.model
        if options.verify_each:
            _verify(model, f"after pass '{p.name}'")
        if options.check_onnx:
            _check_onnx(model, p.name)
        if options.print_ir_after_all:
            stream.write(f"// ----- IR after {p.name} -----\n{print_model(model)}")
    if options.time_passes:
        total = sum(r.seconds for r in records) or 1e-12
        stream.write("// ----- pass timing -----\n")
        for r in records:
            mark = "changed" if r.modified else "no change"
            stream.write(f"//   {r.seconds * 1e3:9.2f} ms  {100 * r.seconds / total:5.1f}%  {r.name} ({mark})\n")
        stream.write(f"//   {total * 1e3:9.2f} ms  total\n")
    return model, records
