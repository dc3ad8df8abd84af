"""Golden files: cases of ``input`` then ``=> expected output`` or ``!! expected error``.

A case is one input line followed by one expectation line; cases are separated
by blank lines, and ``#`` lines are comments. ``pytest --update-golden``
rewrites the expectations with what the code produces now (review the diff).

Sectioned files (``check_sections``) hold a head instead, ``# key: value`` lines and a model in ONNX
text, then sections each opened by a marker line (``# expected ir:``): what the code printed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from requant.errors import RequantError

__all__ = ["GoldenCase", "check_golden", "check_sections", "header_value", "model_text", "read_golden"]


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


def header_value(head: str, key: str) -> str:
    """The value of the ``# key: value`` line of a golden file's head."""
    return next(line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith(f"# {key}:"))


def model_text(head: str) -> str:
    """A golden file's head without its ``#`` lines: the model."""
    return "".join(line + "\n" for line in head.splitlines() if not line.startswith("#"))


def check_sections(path: Path, head: str, sections: Sequence[tuple[str, str, str]], update: bool) -> None:
    """``path`` is ``head`` then, for each (marker, what, text), the marker line and the text: with
    ``update`` it is written so, otherwise each text must equal its section's (``what`` names it)."""
    if update:
        path.write_text(head + "".join(marker + text for marker, _, text in sections))
        return
    rest = path.read_text()
    for i, (marker, what, text) in enumerate(sections):
        rest = rest.split(marker, 1)[1]
        expected = rest.split(sections[i + 1][0], 1)[0] if i + 1 < len(sections) else rest
        assert text == expected, f"{path.name}: {what} differs (pytest --update-golden to accept)"
