"""Golden propagation tests: a model in ONNX text, a target and a quantizer whose requests are fixed
(no calibration: the types are the configs'), the printed IR after propagation and its notes.

A file holds ``# target: <name>`` and ``# quantize: <expression>`` (evaluated with requant.quantizers'
names), the model, then ``# expected ir:`` and ``# expected notes:`` sections. ``pytest --update-golden``
rewrites the expected sections (review the diff).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import requant.quantizers as q
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.passes import get_passes, run_passes
from requant.propagation.propagate import propagate
from requant.targets.registry import get_target
from tests.golden_file import check_sections, header_value, model_text

CASES = sorted((Path(__file__).parent / "golden" / "propagate").glob("*.test"))
IR, NOTES = "# expected ir:\n", "# expected notes:\n"


def run(path: Path) -> tuple[str, str, str]:
    head = path.read_text().split(IR)[0]
    target = get_target(header_value(head, "target"))
    model, _ = run_passes(load_onnx_text(model_text(head), path.name), get_passes("canonicalize"))
    quantizer = eval(header_value(head, "quantize"), {k: getattr(q, k) for k in q.__all__})
    quantizer.for_table(target.table).quantize(model)
    done = propagate(model, target.kernels, None, target.table.same_scale)
    notes = "".join(f"{n.value}: {n.why}\n" for n in done.notes)
    return head, print_model(model), notes


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_propagate_golden(path: Path, update_golden: bool) -> None:
    head, ir_text, notes = run(path)
    check_sections(path, head, [(IR, "IR", ir_text), (NOTES, "notes", notes)], update_golden)
