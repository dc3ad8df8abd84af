"""``requant quantize IN -o DIR``: a folder out, as Optimum and Olive write theirs.

``DIR`` (a path without a suffix, or an existing folder) gets the model (``model.onnx``; ``model.mlir``
for ``tosa-int8``, ``model.pte`` for ``executorch-xnnpack``), ``requant.toml`` (the run's effective
options and quantizer settings: ``requant quantize IN --config DIR/requant.toml -o OUT`` replays the
run, the same bytes), ``report.json`` and ``report.md``, and the files beside ``IN`` that its users' loaders
read (a Hugging Face or Optimum folder's ``config.json``, tokenizer and preprocessor files), so that
``optimum``'s ``ORTModel*.from_pretrained(DIR)`` or ``transformers``' ``AutoTokenizer.from_pretrained(DIR)``
open it. Everything is written whole or not at all, with the CLI's other outputs
(:func:`requant.cli.parser.write_all`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from requant.options import OPTIONS, Options
from requant.targets.registry import DEFAULT_TARGET, get_target

__all__ = ["MODEL_NAMES", "SIDE_FILES", "folder_of", "recipe", "side_files"]

MODEL_NAMES = {"executorch": "model.pte", "tosa": "model.mlir"}  # by backend; the others write model.onnx

# what Hugging Face's and Optimum's loaders read beside a model: configuration, tokenizers, preprocessors
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt",
              "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "preprocessor_config.json",
              "feature_extractor_config.json", "image_processor_config.json", "processor_config.json",
              "chat_template.jinja")  # fmt: skip


def folder_of(output: str | None, target: str | None) -> tuple[Path, Path] | None:
    """``(folder, model path in it)`` when ``-o`` names a folder (an existing one, or a path without a
    suffix); None when it names a file."""
    if output is None:
        return None
    path = Path(output)
    try:
        folder = path.suffix == "" or path.is_dir()
    except OSError:  # a name too long: the check of the outputs says so
        folder = False
    if not folder:
        return None
    backend = get_target(target or DEFAULT_TARGET).backend
    return path, path / MODEL_NAMES.get(backend, "model.onnx")


def side_files(model: str) -> dict[Path, bytes]:
    """The files of :data:`SIDE_FILES` beside ``model`` (a file path), or in it (a Hugging Face folder), read."""
    folder = Path(model) if Path(model).is_dir() else Path(model).parent
    return {Path(name): (folder / name).read_bytes() for name in SIDE_FILES if (folder / name).is_file()}


def _value(value: Any) -> str:
    """``value`` as a TOML value (strings, numbers, booleans, arrays, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if hasattr(value, "tolist"):
        return _value(value.tolist())
    return "[" + ", ".join(_value(v) for v in value) + "]"


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def _tables(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``data`` as TOML: its values first, then its tables (``[a.b]``) and arrays of tables (``[[a]]``)."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not _is_table(v) and not _is_tables(v)]
    for k, v in data.items():
        name = f"{prefix}{_key(k)}"
        if _is_table(v):
            lines += ["", f"[{name}]", *_tables(v, f"{name}.")]
        elif _is_tables(v):
            for entry in v:
                lines += ["", f"[[{name}]]", *_tables(entry, f"{name}.")]
    return lines


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def recipe(options: Options, given: Mapping[str, Any], settings: Any, config: str | None) -> str:
    """``requant.toml``: every option a config file takes at its effective value (paths absolute), the
    calibration data, the preset and the image preprocessing, and the ``[configs]``, ``[[override]]`` and
    ``[module_params]`` of the ``config`` file the run read, if any."""
    data: dict[str, Any] = {}
    for option in OPTIONS:
        value = given.get(option.name) if option.path else getattr(options, option.name)
        if option.key is None or option.name == "output" or value is None:
            continue
        data[option.key] = os.path.abspath(value) if option.path else value
    if settings.calib is not None:
        data["calib"] = os.path.abspath(settings.calib)
    if settings.preset is not None:
        data["preset"] = settings.preset
    if settings.images is not None:
        data["images"] = {k: v for k, v in dataclasses.asdict(settings.images).items() if v is not None}
    if config is not None:
        with open(config, "rb") as f:
            source = tomllib.load(f)
        data.update({k: source[k] for k in ("configs", "override", "module_params") if k in source})
    head = "# requant quantize's settings for this run: replay it with requant quantize IN --config requant.toml -o OUT"
    return "\n".join([head, *_tables(data)]) + "\n"
