"""The Hugging Face front door: a local folder (``config.json``, safetensors or ``pytorch_model.bin``, a tokenizer
or an image processor's settings) of a model ``transformers`` loads and torch exports, as one ONNX model.

The task comes from the config's ``architectures``: a head the folder names (``...ForSequenceClassification``,
``...ForImageClassification``, ...) is exported with the model; a masked-LM or pre-training head, which
sentence encoders' folders name though their users read the hidden states, is left out as Optimum's
``feature-extraction`` export does (``AutoModel``: ``last_hidden_state``); a causal LM is refused here (its
path is the weight-only blocks: ``--preset INT4_BLOCKWISE_WEIGHTS``, docs/llm.md). The model is exported
once, in float32 and eval mode, by requant's PyTorch front door (:func:`~requant.frontends.torch_loader.load_torch`)
with batch and sequence dynamic; its outputs are named as ``transformers`` names them.

Text given as data is tokenized with the folder's tokenizer, a sample a row, at most ``MAX_TOKENS`` tokens
(:meth:`HfModel.samples`): a ``.txt`` file or a folder of them (a row a line), a list of strings, a JSON-lines
file, a Parquet file, a dataset ``datasets`` saved or one in memory (a row each: the ``text_field`` column,
``"text"`` unless given).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.frontends.audio import audio_examples, audio_samples, feature_extractor
from requant.frontends.onnx_loader import LoadError
from requant.frontends.torch_loader import Examples, forward_inputs, load_torch, quiet_torch

__all__ = [
    "DEFAULT_FIELD",
    "EXAMPLE_TEXT",
    "MAX_TOKENS",
    "HfModel",
    "folder_tokenizer",
    "is_causal_folder",
    "is_hf_folder",
    "load_hf_folder",
    "loaded",
    "text_rows",
]  # fmt: skip

log = logging.getLogger("requant")

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
HEADLESS = ("ForMaskedLM", "ForPreTraining")  # heads a sentence encoder's folder names, left out (AutoModel)
# what loading a model imports says on every run (transformers' torchao integration: torchao's CUDA kernels
# missing on a CPU machine, two lines; torch's pytree on torchao's enums), silenced while the folder loads
IMPORT_NOISE = ("torchao", "torch.utils._pytree")
MAX_TOKENS = 128  # a calibration row's tokens at most (truncated)
DEFAULT_FIELD = "text"  # the column (or JSON field) of a dataset's rows that holds the text
SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")  # what datasets' save_to_disk writes
# a tokenizer's own files (one of them): a folder without any has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")  # fmt: skip
EXAMPLE_TEXT = ["A sentence to export the model with.", "Another, longer sentence to export the encoder with."]


def is_hf_folder(source: Any) -> bool:
    """Whether ``source`` is a path to a Hugging Face model folder (a config and weights)."""
    if not isinstance(source, str | os.PathLike) or not Path(source).is_dir():
        return False
    folder = Path(source)
    return (folder / "config.json").is_file() and any((folder / name).is_file() for name in WEIGHTS)


def is_causal_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether a Hugging Face folder's ``config.json`` names a causal language model (``...ForCausalLM``)."""
    architectures = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [""]
    return str(architectures[0]).endswith("ForCausalLM")


@dataclass
class HfModel:
    """The exported model, how it was made (``said``), and the tokenizer its text data is read with (None
    for a model that takes no text)."""

    model: ir.Model
    said: str
    tokenizer: Any = None
    extractor: Any = None  # an audio model's feature extractor (requant.frontends.audio)

    def samples(self, data: Any, what: str, field: str = DEFAULT_FIELD) -> Any:
        """``data`` as samples: text (see :func:`text_rows`) tokenized, a row a sample; sound files through the
        feature extractor (:func:`~requant.frontends.audio.audio_samples`), a file a sample; anything else as it is."""
        names = {str(v.name) for v in self.model.graph.inputs}
        if self.extractor is not None:
            sound = audio_samples(self.extractor, data, names, what)
            return data if sound is None else sound
        rows = text_rows(data, field, what) if self.tokenizer is not None else None
        if rows is None:
            return data
        rows = [row for row in rows if row.strip()]
        if not rows:
            raise LoadError(f"the {what} text has no rows to tokenize")
        samples = []
        for row in rows:
            encoded = self.tokenizer(row, truncation=True, max_length=MAX_TOKENS, return_tensors="np")
            samples.append({k: np.asarray(v, np.int64) for k, v in encoded.items() if k in names})
        return samples


def text_rows(data: Any, field: str, what: str) -> list[str] | None:
    """The texts of ``data``, a sample each, or None when ``data`` is not text: a ``.txt`` file or a folder of
    them (a line each), a list of strings, a JSON-lines file, a Parquet file, a dataset saved by ``datasets``
    (``save_to_disk``) or one in memory (a row each: its ``field`` column)."""
    if hasattr(data, "column_names") and hasattr(data, "__getitem__"):  # a datasets.Dataset
        return _column(data, field, what)
    if isinstance(data, list | tuple):
        return list(data) if data and all(isinstance(s, str) for s in data) else None
    if not isinstance(data, str | os.PathLike):
        return None
    path = Path(data)
    if path.suffix == ".jsonl":
        return _json_lines(path, field, what)
    if path.suffix == ".parquet" or (path.is_dir() and any((path / n).is_file() for n in SAVED_DATASET)):
        return _column(_dataset(path, what), field, what)
    if path.suffix == ".txt" or (path.is_dir() and any(path.glob("*.txt"))):
        from requant.llm.text import read_text

        return read_text(data, what).splitlines()
    return None


def _json_lines(path: Path, field: str, what: str) -> list[str]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadError(f"the {what} text: cannot read '{path}': {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise LoadError(f"the {what} text: '{path}' line {number} is not JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise LoadError(f"the {what} text: '{path}' line {number} has no text field '{field}' (give --text-field)")
        rows.append(row[field])
    return rows


def _dataset(path: Path, what: str) -> Any:
    """A Parquet file or a folder ``datasets`` saved, read by ``datasets``."""
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise LoadError(f"the {what} data '{path}' is read by the datasets package: pip install datasets") from None
    try:
        if path.suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path))
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many kinds for a folder it cannot read
        raise LoadError(f"the {what} data '{path}': datasets could not read it: {type(exc).__name__}: {exc}") from None


def _column(dataset: Any, field: str, what: str) -> list[str]:
    if isinstance(dataset.column_names, dict):  # a DatasetDict: its splits
        raise LoadError(f"the {what} dataset holds splits ({', '.join(dataset.column_names)}): give one split's "
                        "folder or dataset")  # fmt: skip
    if field not in dataset.column_names:
        raise LoadError(f"the {what} dataset has no column '{field}' (its columns: "
                        f"{', '.join(dataset.column_names)}): give --text-field")  # fmt: skip
    values = dataset[field]
    if not all(isinstance(v, str) for v in values):
        raise LoadError(f"the {what} dataset's column '{field}' does not hold text")
    return list(values)


def _module(transformers: Any, folder: Path) -> tuple[Any, str]:
    """The ``transformers`` module of the folder's task, and what the report says of it."""
    config = transformers.AutoConfig.from_pretrained(folder)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture is not None and architecture.endswith("ForCausalLM"):
        raise LoadError(f"'{folder}' holds a causal language model ({architecture}): quantize it with --preset "
                        "INT4_BLOCKWISE_WEIGHTS (weight blocks for onnxruntime-genai, docs/llm.md)")  # fmt: skip
    named = getattr(transformers, architecture, None) if architecture else None
    if named is None or architecture.endswith(HEADLESS):
        left_out = f", its {architecture} head left out" if architecture else ""
        return transformers.AutoModel.from_pretrained(folder), f"{config.model_type}, feature extraction{left_out}"
    headless = architecture.endswith("Model")  # BertModel: the hidden states, as feature extraction reads them
    return named.from_pretrained(folder), architecture + (", feature extraction" if headless else "")


def folder_tokenizer(transformers: Any, folder: Path) -> Any:
    """The folder's tokenizer, or None (no tokenizer files, or none transformers reads). Without the files
    transformers 5.23 still makes one from the config alone, with a vocabulary of 2: every text would become unknown
    tokens."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception:  # transformers raises many kinds for files it cannot read
        return None


def _examples(module: Any, folder: Path, transformers: Any) -> tuple[Examples, dict[str, Any], Any, Any]:
    """Example inputs (a batch of two), their dynamic axes, and the folder's tokenizer and audio feature extractor
    (None without one): text for a forward that takes ``input_ids``, else sound where the folder has a feature
    extractor, else an image of the config's size."""
    import torch

    positional, _ = forward_inputs(module)
    tokenizer = folder_tokenizer(transformers, folder) if "input_ids" in positional else None
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    if tokenizer is not None:
        try:
            encoded = tokenizer(EXAMPLE_TEXT, padding=True, return_tensors="pt")
        except Exception as exc:  # a tokenizer without a padding token, ...
            raise LoadError(f"'{folder}': its tokenizer cannot make example inputs: {type(exc).__name__}: "
                            f"{exc}") from None  # fmt: skip
        examples = Examples({k: v for k, v in encoded.items() if k in positional})
        return examples, {k: {0: batch, 1: sequence} for k in examples}, tokenizer, None
    extractor = feature_extractor(transformers, folder)
    if extractor is not None:
        sound, dynamic = audio_examples(extractor, list(positional))
        return Examples(sound), dynamic, None, extractor
    config = module.config
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if "pixel_values" in positional and isinstance(size, int) and isinstance(channels, int):
        examples = Examples(pixel_values=torch.rand(2, channels, size, size))
        return examples, {"pixel_values": {0: batch}}, None, None
    raise LoadError(f"'{folder}': requant cannot make example inputs for {type(module).__name__} (no tokenizer, no "
                    "audio feature extractor, no image size in its config): export it to ONNX yourself, or give the "
                    "module with example_inputs=")  # fmt: skip


_LAST: dict[tuple[Any, ...], HfModel] = {}  # the last folder exported, by its files' paths, sizes and times


def _stamp(folder: Path) -> tuple[Any, ...]:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return (str(folder.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def load_hf_folder(source: str | os.PathLike[str]) -> HfModel:
    """The model of the Hugging Face folder ``source``, exported (see the module's docstring); the last folder's
    export is kept for the process and given again (a copy) while none of its files changed: a notebook trying
    options on one folder exports it once (MiniLM: 15 s)."""
    folder = Path(source)
    stamp = _stamp(folder)
    if stamp in _LAST:
        kept = _LAST[stamp]
        log.info("%s: the export of an earlier run, its files unchanged", folder)
        return HfModel(kept.model.clone(), kept.said, kept.tokenizer, kept.extractor)
    exported = _export(folder)
    _LAST.clear()
    _LAST[stamp] = exported
    return HfModel(exported.model.clone(), exported.said, exported.tokenizer, exported.extractor)


def loaded(transformers: Any, folder: Path, load: Callable[[], Any]) -> Any:
    """What ``load`` returns, with transformers' loading bars and what importing a model says silenced; what
    transformers raises for a folder it cannot read as a LoadError."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # its loading bars
    quiet = quiet_torch(IMPORT_NOISE)
    try:
        return load()
    except LoadError:
        raise
    except Exception as exc:  # transformers raises many kinds for a folder it cannot read
        raise LoadError(f"transformers could not load the model in '{folder}': {type(exc).__name__}: {exc}") from None
    finally:
        quiet.close()
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _export(folder: Path) -> HfModel:
    try:
        import torch
        import transformers
    except ImportError:
        raise LoadError(f"reading the Hugging Face folder '{folder}' needs torch and transformers: pip install "
                        "'requant[torch]' transformers") from None  # fmt: skip
    module, task = loaded(transformers, folder, lambda: _module(transformers, folder))
    module = module.float().eval()
    examples, dynamic, tokenizer, extractor = _examples(module, folder, transformers)
    model = load_torch(module, examples, dynamic)
    with torch.no_grad():
        returned = module(**examples)
    names = list(returned.keys()) if hasattr(returned, "keys") else []
    if len(names) == len(model.graph.outputs):  # as transformers (and Optimum's exports) name them
        for value, name in zip(model.graph.outputs, names, strict=True):
            value.name = name
    inputs = ", ".join(str(v.name) for v in model.graph.inputs)
    axes = list(dict.fromkeys(getattr(d, "__name__", str(d)) for named in dynamic.values() for d in named.values()))
    said = (f"the Hugging Face folder '{folder}': {task}, exported by torch.onnx.export (dynamo) in float32 with "
            f"{' and '.join(axes)} dynamic (inputs {inputs})")  # fmt: skip
    if extractor is not None:
        said += f"; sound through its {type(extractor).__name__} at {extractor.sampling_rate} Hz"
    return HfModel(model, said, tokenizer, extractor)
