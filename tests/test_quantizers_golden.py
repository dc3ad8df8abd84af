"""Golden quantizer tests: a model in ONNX text, a quantizer, the printed IR and the report.

A file holds ``# quantize: <expression>`` (evaluated with requant.quantizers' names), the model,
then ``# expected ir:`` and ``# expected report:`` sections. ``pytest --update-golden`` rewrites
the expected sections (review the diff).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import requant.quantizers as q
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.passes import get_passes, run_passes
from tests.golden_file import check_sections, header_value, model_text

CASES = sorted((Path(__file__).parent / "golden" / "quantizers").glob("*.test"))
IR, REPORT = "# expected ir:\n", "# expected report:\n"


def run(path: Path) -> tuple[str, str, str]:
    head = path.read_text().split(IR)[0]
    model, _ = run_passes(load_onnx_text(model_text(head), path.name), get_passes("canonicalize"))
    quantizer = eval(header_value(head, "quantize"), {k: getattr(q, k) for k in q.__all__})
    report = quantizer.quantize(model)
    return head, print_model(model), report.summary() + "\n" + report.details() + "\n"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_quantizer_golden(path: Path, update_golden: bool) -> None:
    head, ir_text, report_text = run(path)
    check_sections(path, head, [(IR, "IR", ir_text), (REPORT, "report", report_text)], update_golden)
