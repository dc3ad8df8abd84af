"""What the sub-commands share: their parsers' help, and writing outputs whole or not at all."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from requant.errors import RequantError

__all__ = ["documented", "write_all"]


def documented(commands: Any, name: str, summary: str, doc: str | None, **extra: Any) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` shows its module's docstring as written."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **extra
    )
    return parser


def write_all(texts: Mapping[str, str | bytes], save: Callable[[], None] | None = None) -> None:
    """Write the text outputs (reports, pages) and the model (``save``), if any, whole or not at all: the
    texts go to temporary files in their folders first, then the model is saved (itself temporary files
    and renames), then the texts are renamed into place. A failure on the way leaves no output."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in texts.items():
            target = Path(path)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            if isinstance(text, bytes):  # a file copied as it is (a tokenizer's model)
                with open(partial, "xb") as binary:
                    staged.append((partial, target))
                    binary.write(text)
                continue
            with open(partial, "x", encoding="utf-8") as f:  # the user's umask, unlike mkstemp's 0600
                staged.append((partial, target))
                f.write(text)
        if save is not None:
            save()
        for partial, target in staged:
            partial.replace(target)
    except OSError as exc:
        raise RequantError(f"could not write {exc.filename or 'the outputs'}: {exc.strerror or exc}") from None
    finally:
        for partial, _ in staged:
            partial.unlink(missing_ok=True)
