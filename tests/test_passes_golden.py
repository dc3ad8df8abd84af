"""Every file in tests/golden/passes: the printed IR after its pipeline, and the same numbers in ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pass_harness import EXPECTED, check_numerics, read_case, run_case

CASES = sorted((Path(__file__).parent / "golden" / "passes").glob("*.test"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_pass_golden(path: Path, update_golden: bool) -> None:
    case = read_case(path)
    got, model = run_case(case)
    if update_golden:
        separator = "" if got.startswith("# expected error:") else EXPECTED + "\n"
        path.write_text(case.header + separator + got)
        return
    assert got == case.expected, f"{path.name}: printed IR differs (pytest --update-golden to accept)"
    if model is not None:
        check_numerics(case, model)


def test_every_pass_has_a_golden_test() -> None:
    from requant.passes import pass_names

    tested = {name.strip() for p in CASES for name in read_case(p).pipeline.split(",")}
    assert set(pass_names()) <= tested, f"passes without a golden test: {set(pass_names()) - tested}"
