"""The front door of language models: a causal decoder, as an ONNX model that maps ``input_ids`` to
``logits`` (with or without past key values), from whichever form it comes in.

- an ONNX file (``.onnx``): ``input_ids -> logits``, optionally ``attention_mask``, ``position_ids`` and
  ``past_key_values.*`` inputs (``torch.onnx.export`` of a causal LM, or onnxruntime-genai's builder);
- an onnxruntime-genai folder (``genai_config.json``, the model it names, a tokenizer): the output is the
  same folder, its model quantized, so that onnxruntime-genai loads and generates with it;
- a Hugging Face folder (``config.json``, safetensors weights, ``tokenizer.json``): exported in float32
  by onnxruntime-genai's model builder (the ``llm`` extra) into such a folder first;
- a GGUF file: its weights dequantized to float32 by ``transformers``' GGUF loader into a Hugging Face
  folder, then as above.

Past key values are fed empty (``[batch, heads, 0, head_size]``): a whole sequence is one prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.errors import RequantError
from requant.frontends import load_onnx

__all__ = ["Decoder", "DecoderError", "Past", "export_genai", "gguf_to_hf", "model_bytes", "open_decoder"]

Array = npt.NDArray[Any]
GENAI_CONFIG = "genai_config.json"
_NUMPY = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


class DecoderError(RequantError):
    """A language model requant cannot open, or one that is not a causal decoder."""


@dataclass(frozen=True)
class Past:
    """A past key or value input: its name, heads, head size and element type."""

    name: str
    heads: int
    head_size: int
    dtype: Any

    def empty(self, batch: int) -> Array:
        return np.zeros((batch, self.heads, 0, self.head_size), self.dtype)


@dataclass
class Decoder:
    """A causal decoder: its ONNX model (``path``), the folder it came in (an onnxruntime-genai folder:
    its other files travel with the quantized model), where its tokenizer is, and its inputs."""

    path: Path
    model: ir.Model
    folder: Path | None = None
    tokenizer: Path | None = None
    inputs: tuple[str, ...] = ()
    pasts: tuple[Past, ...] = ()
    exported: str | None = None  # how requant made the ONNX model, when it did
    _scratch: Any = field(default=None, repr=False)  # the exported model's temporary folder

    def feeds(self, ids: Array, pasts: dict[str, Array] | None = None) -> dict[str, Array]:
        """The model's inputs for the token ids ``ids`` (``[batch, tokens]``) after ``pasts`` (the
        present key values of a previous run; none: an empty past)."""
        batch, tokens = ids.shape
        past = 0 if not pasts else next(iter(pasts.values())).shape[2]
        given = {"input_ids": ids.astype(np.int64)}
        if "attention_mask" in self.inputs:
            given["attention_mask"] = np.ones((batch, past + tokens), np.int64)
        if "position_ids" in self.inputs:
            given["position_ids"] = np.broadcast_to(np.arange(past, past + tokens, dtype=np.int64), (batch, tokens))
        for p in self.pasts:
            given[p.name] = pasts[p.name] if pasts else p.empty(batch)
        return given

    def presents(self, outputs: dict[str, Array]) -> dict[str, Array]:
        """A run's present key values as the next run's pasts (by the past inputs' names)."""
        found = {}
        for p in self.pasts:
            present = p.name.replace("past_key_values", "present")
            if present in outputs:
                found[p.name] = outputs[present]
        return found


def model_bytes(path: Path) -> int:
    """An ONNX model's bytes: its file and the external data files beside it named after it."""
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name))


def _genai_sizes(config: dict[str, Any] | None) -> tuple[int | None, int | None]:
    decoder = (config or {}).get("model", {}).get("decoder", {})
    return decoder.get("num_key_value_heads"), decoder.get("head_size")


def _pasts(model: ir.Model, config: dict[str, Any] | None) -> tuple[Past, ...]:
    heads, head_size = _genai_sizes(config)
    found = []
    for value in model.graph.inputs:
        name = str(value.name)
        if not name.startswith("past_key_values"):
            continue
        dims = list(value.shape or [])
        n = dims[1] if len(dims) == 4 and isinstance(dims[1], int) else heads
        d = dims[3] if len(dims) == 4 and isinstance(dims[3], int) else head_size
        if n is None or d is None:
            raise DecoderError(f"past input {name!r} has shape {dims}: its heads and head size must be numbers "
                               f"(or given by {GENAI_CONFIG})")  # fmt: skip
        found.append(Past(name, int(n), int(d), _NUMPY.get(value.dtype, np.float32)))  # type: ignore[arg-type]
    return tuple(found)


def _check_decoder(model: ir.Model, where: str) -> None:
    inputs = {str(v.name) for v in model.graph.inputs}
    outputs = {str(v.name) for v in model.graph.outputs}
    if "input_ids" not in inputs or "logits" not in outputs:
        raise DecoderError(f"{where} is not a causal language model: expected an input 'input_ids' and an output "
                           f"'logits'; it has inputs {sorted(inputs)} and outputs {sorted(outputs)} (the weight-block "
                           "preset is for decoder language models; another model's linear layers are quantized "
                           "by the default presets, without --preset)")  # fmt: skip
    unknown = inputs - {"input_ids", "attention_mask", "position_ids"}
    unknown = {n for n in unknown if not n.startswith("past_key_values")}
    if unknown:
        raise DecoderError(f"{where}: requant feeds input_ids, attention_mask, position_ids and past_key_values.*; "
                           f"it does not know what to give {sorted(unknown)}")  # fmt: skip


def _tokenizer_beside(folder: Path) -> Path | None:
    return folder if (folder / "tokenizer.json").is_file() else None


def _from_onnx(path: Path, folder: Path | None, config: dict[str, Any] | None) -> Decoder:
    model = load_onnx(path, checker=False)  # ONNX Runtime's session is its check (llm.runs)
    _check_decoder(model, f"'{path}'")
    inputs = tuple(str(v.name) for v in model.graph.inputs)
    return Decoder(path, model, folder, _tokenizer_beside(path.parent), inputs, _pasts(model, config))


def _from_genai(folder: Path) -> Decoder:
    try:
        config = json.loads((folder / GENAI_CONFIG).read_text())
        filename = config["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        where = folder / GENAI_CONFIG
        raise DecoderError(f"'{where}' names no decoder model (model.decoder.filename): {exc}") from None
    return _from_onnx(folder / filename, folder, config)


def export_genai(hf_folder: Path, out: Path, cache: Path) -> None:
    """onnxruntime-genai's model builder, float32 for the CPU (in its own process: it imports torch and
    transformers, and prints as it goes)."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
               "-p", "fp32", "-e", "cpu", "-c", str(cache)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / GENAI_CONFIG).is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise DecoderError(f"onnxruntime-genai's model builder could not export '{hf_folder}' "
                           f"(pip install 'requant[llm]' installs it):\n{tail}")  # fmt: skip


def gguf_to_hf(path: Path, out: Path) -> None:
    """A GGUF file's model as a float32 Hugging Face folder (transformers' GGUF loader)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise DecoderError(f"reading '{path}' needs transformers and gguf: pip install 'requant[llm]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises many kinds for a file it cannot read
        raise DecoderError(f"could not read the GGUF file '{path}': {exc}") from None
    config = loaded.config
    config.quantization_config = None  # dequantized: a plain float model, which save_pretrained writes
    delattr(config, "quantization_config")
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _exported(source: Path) -> Decoder:
    scratch = tempfile.TemporaryDirectory(prefix="requant-llm-")
    root = Path(scratch.name)
    hf_folder = source
    how = f"exported from the Hugging Face folder '{source}' by onnxruntime-genai's builder (float32)"
    if source.suffix == ".gguf":
        hf_folder = root / "hf"
        gguf_to_hf(source, hf_folder)
        how = f"GGUF '{source.name}' dequantized to float32 (transformers), exported by onnxruntime-genai's builder"
    export_genai(hf_folder, root / "genai", root / "cache")
    decoder = _from_genai(root / "genai")
    decoder.exported, decoder._scratch = how, scratch
    return decoder


def open_decoder(source: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None = None) -> Decoder:
    """The causal decoder at ``source`` (see the module's docstring for what it may be); ``tokenizer``: a
    folder with ``tokenizer.json`` (default: the one beside the model, when there is one)."""
    path = Path(source)
    if path.is_dir() and (path / GENAI_CONFIG).is_file():
        decoder = _from_genai(path)
    elif (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf"):
        decoder = _exported(path)
    elif path.is_file():
        decoder = _from_onnx(path, None, None)
    else:
        raise DecoderError(f"'{path}' is not a language model requant reads: expected an ONNX file, a folder with "
                           f"{GENAI_CONFIG} or a Hugging Face config.json, or a .gguf file")  # fmt: skip
    if tokenizer is not None:
        decoder.tokenizer = Path(tokenizer)
    return decoder
