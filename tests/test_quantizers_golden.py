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

CASES = sorted((Path(__file__).parent / "golden" / "quantizers").glob("*.test"))
IR, REPORT = "# expected ir:\n", "# expected report:\n"


def run(path: Path) -> tuple[str, str, str]:
    text = path.read_text()
    head = text.split(IR)[0]
    expression = next(line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("# quantize:"))
    model_text = "".join(line + "\n" for line in head.splitlines() if not line.startswith("#"))
    model, _ = run_passes(load_onnx_text(model_text, path.name), get_passes("canonicalize"))
    quantizer = eval(expression, {k: getattr(q, k) for k in q.__all__})
    report = quantizer.quantize(model)
    return head, print_model(model), report.summary() + "\n" + report.details() + "\n"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_quantizer_golden(path: Path, update_golden: bool) -> None:
    head, ir_text, report_text = run(path)
    if update_golden:
        path.write_text(head + IR + ir_text + REPORT + report_text)
        return
    expected_ir, expected_report = path.read_text().split(IR)[1].split(REPORT)
    assert ir_text == expected_ir, f"{path.name}: IR differs (pytest --update-golden to accept)"
    assert report_text == expected_report, f"{path.name}: report differs (pytest --update-golden to accept)"
