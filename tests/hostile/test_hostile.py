"""Every bad input of ``tests/hostile/cases.py``: one clear error, no traceback, no output, inputs untouched.

Through the command line (in-process, so the ~100 cases take seconds) and, where a case has one,
through the API.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

import requant.api
from requant.cli.main import main
from requant.errors import RequantError
from tests.hostile.cases import Case, all_cases, workspace

CASES = all_cases()


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def test_there_are_many_cases_in_every_group() -> None:
    groups = {c.group for c in CASES}
    assert groups == {"model", "data", "evaluation data", "options", "config", "api", "opt", "lint", "type", "compare"}
    assert len(CASES) >= 150 and len({(c.group, c.name) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.group}: {c.name}" for c in CASES])
def test_a_bad_input_gets_one_clear_error_and_loses_nothing(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace(tmp_path)
    message = case.message.replace("{tmp}", str(tmp_path))
    if case.argv is not None:
        argv = case.argv(tmp_path)  # builds the case's files
        before = _snapshot(tmp_path)
        started = time.perf_counter()
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        assert code == case.code, err
        assert message in err, err
        assert "Traceback" not in err and err.count("error:") == 1
        assert err.startswith(f"requant {argv[0]}: error: " if case.code == 1 else f"usage: requant {argv[0]}")
        assert _snapshot(tmp_path) == before  # no output, no temporary file, every input unchanged
        assert time.perf_counter() - started < 30
    if case.api is not None:
        arguments = case.api(tmp_path)
        before = _snapshot(tmp_path)
        with pytest.raises(RequantError) as raised:
            requant.api.quantize(**arguments)
        assert message in str(raised.value)
        assert _snapshot(tmp_path) == before
