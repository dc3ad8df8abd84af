"""Golden parse/print and error-message tests for the type syntax (tests/golden/*.txt)."""

from __future__ import annotations

from pathlib import Path

from requant.types import parse_tensor_type, parse_type
from tests.golden_file import check_golden

GOLDEN = Path(__file__).parent / "golden"


def test_types(update_golden: bool) -> None:
    check_golden(GOLDEN / "types.txt", lambda text: str(parse_type(text)), update_golden)


def test_tensor_types(update_golden: bool) -> None:
    check_golden(GOLDEN / "tensors.txt", lambda text: str(parse_tensor_type(text)), update_golden)
