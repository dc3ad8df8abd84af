"""Golden files: cases of ``input`` then ``=> expected output`` or ``!! expected error``.

A case is one input line followed by one expectation line; cases are separated
by blank lines, and ``#`` lines are comments. ``pytest --update-golden``
rewrites the expectations with what the code produces now (review the diff).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from requant.errors import RequantError

__all__ = ["GoldenCase", "check_golden", "read_golden"]


@dataclass
class GoldenCase:
    comments: list[str]
    text: str
    expected: str  # "=> ..." or "!! ..."
    line: int


def read_golden(path: Path) -> list[GoldenCase]:
    cases: list[GoldenCase] = []
    comments: list[str] = []
    pending: tuple[str, int] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("#"):
            comments.append(line)
        elif line.startswith(("=> ", "!! ")):
            assert pending is not None, f"{path}:{number}: expectation without an input"
            cases.append(GoldenCase(comments, pending[0], line, pending[1]))
            comments, pending = [], None
        else:
            assert pending is None, f"{path}:{number}: input without an expectation"
            pending = (line, number)
    assert pending is None, f"{path}: last input has no expectation"
    return cases


def actual(run: Callable[[str], str], text: str) -> str:
    try:
        return "=> " + run(text)
    except RequantError as exc:
        return "!! " + str(exc).splitlines()[0]


def check_golden(path: Path, run: Callable[[str], str], update: bool) -> None:
    cases = read_golden(path)
    got = [actual(run, case.text) for case in cases]
    if update:
        blocks = ["\n".join([*c.comments, c.text, g]) for c, g in zip(cases, got, strict=True)]
        path.write_text("\n\n".join(blocks) + "\n")
        return
    failures = [
        f"{path.name}:{c.line}: {c.text}\n  expected {c.expected}\n  got      {g}"
        for c, g in zip(cases, got, strict=True)
        if g != c.expected
    ]
    assert not failures, "\n".join(failures)
