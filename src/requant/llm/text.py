"""Text for a language model: calibration and evaluation text, read from a ``.txt`` file, a folder of them
or a list of strings, tokenized with the model's own tokenizer (``tokenizer.json``, the ``tokenizers``
library) and cut into windows of consecutive tokens.

Defaults (documented in docs/llm.md): calibration takes the first :data:`CALIBRATION_WINDOWS` windows of
:data:`WINDOW` tokens; evaluation (perplexity) the first :data:`EVALUATION_WINDOWS`. Files of a folder are
read in name order and joined by a blank line. A text shorter than one window gives one shorter window.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.errors import RequantError

__all__ = ["CALIBRATION_WINDOWS", "EVALUATION_WINDOWS", "WINDOW", "TextError", "read_text", "token_windows"]

WINDOW = 512  # tokens per window (the perplexity windows; GPTQ's papers use 2048 on GPUs)
CALIBRATION_WINDOWS = 32  # 16,384 tokens: each layer's H from 16k inputs
EVALUATION_WINDOWS = 16
MIN_TOKENS = 16

Array = npt.NDArray[Any]


class TextError(RequantError):
    """Text that cannot be read or tokenized, or that is too short."""


def read_text(source: str | os.PathLike[str] | Sequence[str], what: str) -> str:
    """The text of ``source``: a ``.txt`` file, a folder of ``.txt`` files, or a list of strings."""
    if isinstance(source, list | tuple):
        if not all(isinstance(s, str) for s in source):
            raise TextError(f"the {what} text: a list of strings was expected")
        return "\n\n".join(source)
    path = Path(source)  # type: ignore[arg-type]
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise TextError(f"the {what} text: the folder '{path}' has no .txt files")
    try:
        return "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    except FileNotFoundError:
        raise TextError(f"the {what} text: '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TextError(f"the {what} text: cannot read '{path}' as UTF-8 text: {exc}") from None


def load_tokenizer(folder: Path | None) -> Any:
    """The ``tokenizers.Tokenizer`` of ``folder/tokenizer.json``."""
    if folder is None:
        raise TextError("no tokenizer: the model has no tokenizer.json beside it; give --tokenizer DIR")
    path = folder / "tokenizer.json" if folder.is_dir() else folder
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except ImportError:
        raise TextError("tokenizing text needs the tokenizers package: pip install 'requant[llm]'") from None
    except Exception as exc:  # tokenizers raises its own Exception for a missing or bad file
        raise TextError(f"cannot read the tokenizer '{path}': {exc}") from None


def token_windows(text: str, tokenizer: Any, count: int, what: str, length: int = WINDOW) -> list[Array]:
    """The first ``count`` windows of ``length`` consecutive tokens of ``text`` (each ``[1, length]``)."""
    ids = np.asarray(tokenizer.encode(text).ids, np.int64)
    if ids.size < MIN_TOKENS:
        raise TextError(f"the {what} text has {ids.size} tokens; at least {MIN_TOKENS} are needed")
    whole = ids.size // length
    if whole == 0:
        return [ids[None]]
    return [ids[i * length : (i + 1) * length][None] for i in range(min(count, whole))]
