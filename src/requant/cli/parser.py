"""What the sub-commands' parsers share."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["documented"]


def documented(commands: Any, name: str, summary: str, doc: str | None, **extra: Any) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` shows its module's docstring as written."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **extra
    )
    return parser
