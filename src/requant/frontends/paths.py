"""Where outputs may go: never onto an input, never twice onto one file, never into a missing folder.

Checked before any work starts, so a refused run writes nothing and leaves every input as it was. Also which files
of a kind data names (:func:`named_files`: sound files, images).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from requant.frontends.onnx_loader import SaveError

__all__ = ["check_outputs", "named_files"]

PathLike = str | os.PathLike[str]


def named_files(data: object, suffixes: Collection[str]) -> list[Path] | None:
    """The files with one of ``suffixes`` (lower case) that ``data`` names: a list of their paths, one file, or a
    folder's (sorted by name); None when it names none (data of another kind: left to the other readers)."""
    if isinstance(data, list | tuple) and data and all(isinstance(p, str | os.PathLike) for p in data):
        paths = [Path(p) for p in data]
        return paths if all(p.suffix.lower() in suffixes for p in paths) else None
    if not isinstance(data, str | os.PathLike):
        return None
    path = Path(data)
    if path.suffix.lower() in suffixes:
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix.lower() in suffixes) or None
    return None


def _same(a: Path, b: Path) -> bool:
    """The same file: the same resolved path, or (both existing) the same file by identity (a hard
    link, a symbolic link the resolution missed)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(
    outputs: Mapping[str, PathLike | None], inputs: Mapping[str, object], folders: Collection[str] = ()
) -> None:
    """Raise :class:`SaveError` naming the option when an output (``{"-o": path, ...}``) is an
    input's file (``{"the model": path, ...}``; values that are not paths are skipped), the same
    file as another output, a folder (unless its name is in ``folders``: a language model's folder), or
    in a folder that does not exist or is not writable."""
    given = [(name, os.fspath(path), Path(path)) for name, path in outputs.items() if path is not None]
    files = [(name, Path(path)) for name, path in inputs.items() if isinstance(path, str | os.PathLike)]
    for i, (name, text, path) in enumerate(given):  # messages show the path as the user gave it
        for what, source in files:
            if _same(path, source):
                raise SaveError(f"{name} '{text}' is {what}: refusing to overwrite it (give another path)")
        for other, _, earlier in given[:i]:
            if _same(path, earlier):
                raise SaveError(f"{name} '{text}' is also {other}: give each output its own file")
        if not path.parent.is_dir():
            raise SaveError(f"{name} '{text}': the folder '{path.parent}' does not exist")
        try:
            is_folder = path.is_dir()
        except OSError as exc:  # a name too long, a loop of links
            raise SaveError(f"{name} '{text}': {exc.strerror or exc}") from None
        if is_folder and name not in folders:
            raise SaveError(f"{name} '{text}' is a folder: give a file name")
        if not os.access(path.parent, os.W_OK):
            raise SaveError(f"{name} '{text}': the folder '{path.parent}' is not writable")
