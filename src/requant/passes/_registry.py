"""The lazy pass registry: pass name -> pass, importing a pass's module only when asked for it.

A pass module defines ``PASS`` (a :class:`Pass` subclass), or ``PIPELINE`` (a
list of pass names run in that order, such as ``canonicalize``).
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil

import requant.passes
from requant.errors import RequantError
from requant.passes._base import Pass

__all__ = ["UnknownPassError", "get_passes", "parse_pipeline", "pass_names"]


class UnknownPassError(RequantError):
    """A pass name that no module defines."""


def pass_names() -> list[str]:
    """Every pass and pipeline name, sorted; nothing is imported to list them."""
    return sorted(
        info.name.replace("_", "-")
        for info in pkgutil.iter_modules(requant.passes.__path__)
        if not info.name.startswith("_")
    )


def get_passes(name: str) -> list[Pass]:
    """The passes ``name`` stands for: one pass, or a pipeline's passes in order."""
    known = pass_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UnknownPassError(f"unknown pass '{name}'{hint}; the known passes are: {', '.join(known)}")
    module = importlib.import_module(f"requant.passes.{name.replace('-', '_')}")
    pipeline: list[str] | None = getattr(module, "PIPELINE", None)
    if pipeline is not None:
        return [p for step in pipeline for p in get_passes(step)]
    pass_class: type[Pass] = module.PASS
    return [pass_class()]


def parse_pipeline(text: str) -> list[Pass]:
    """``"canonicalize,fold-batchnorm"`` -> the passes, in order."""
    names = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise UnknownPassError(f"empty pass name in pipeline {text!r}; known passes: {', '.join(pass_names())}")
    return [p for n in names for p in get_passes(n)]
