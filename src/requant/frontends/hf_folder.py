"""The Hugging Face front door: a local folder (``config.json``, safetensors or ``pytorch_model.bin``, a tokenizer
or an image processor's settings) of a model ``transformers`` loads and torch exports, as one ONNX model.

The task comes from the config's ``architectures``: a head the folder names (``...ForSequenceClassification``,
``...ForImageClassification``, ...) is exported with the model; a masked-LM or pre-training head, which
sentence encoders' folders name though their users read the hidden states, is left out as Optimum's
``feature-extraction`` export does (``AutoModel``: ``last_hidden_state``); a causal LM is refused here (its
path is the weight-only blocks: ``--preset INT4_BLOCKWISE_WEIGHTS``, docs/llm.md). The model is exported
once, in float32 and eval mode, by requant's PyTorch front door (:func:`~requant.frontends.torch_loader.load_torch`)
with batch and sequence dynamic; its outputs are named as ``transformers`` names them.

Text given as data (a ``.txt`` file, a folder of them, a list of strings) is tokenized with the folder's
tokenizer: each non-empty line one sample, at most ``MAX_TOKENS`` tokens (:meth:`HfModel.samples`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.frontends.onnx_loader import LoadError
from requant.frontends.torch_loader import Examples, forward_inputs, load_torch

__all__ = ["MAX_TOKENS", "HfModel", "is_hf_folder", "load_hf_folder"]

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
HEADLESS = ("ForMaskedLM", "ForPreTraining")  # heads a sentence encoder's folder names, left out (AutoModel)
MAX_TOKENS = 128  # a calibration line's tokens at most (truncated)
EXAMPLE_TEXT = ["A sentence to export the model with.", "Another, longer sentence to export the encoder with."]


def is_hf_folder(source: Any) -> bool:
    """Whether ``source`` is a path to a Hugging Face model folder (a config and weights)."""
    if not isinstance(source, str | os.PathLike) or not Path(source).is_dir():
        return False
    folder = Path(source)
    return (folder / "config.json").is_file() and any((folder / name).is_file() for name in WEIGHTS)


@dataclass
class HfModel:
    """The exported model, how it was made (``said``), and the tokenizer its text data is read with (None
    for a model that takes no text)."""

    model: ir.Model
    said: str
    tokenizer: Any = None

    def samples(self, data: Any, what: str) -> Any:
        """``data`` as samples: text (a ``.txt`` file, a folder of them, a list of strings) tokenized, a line
        a sample; anything else as it is."""
        if self.tokenizer is None or not _is_text(data):
            return data
        from requant.llm.text import read_text

        lines = [line.strip() for line in read_text(data, what).splitlines() if line.strip()]
        if not lines:
            raise LoadError(f"the {what} text has no lines to tokenize")
        names = {str(v.name) for v in self.model.graph.inputs}
        samples = []
        for line in lines:
            encoded = self.tokenizer(line, truncation=True, max_length=MAX_TOKENS, return_tensors="np")
            samples.append({k: np.asarray(v, np.int64) for k, v in encoded.items() if k in names})
        return samples


def _is_text(data: Any) -> bool:
    if isinstance(data, list | tuple):
        return bool(data) and all(isinstance(s, str) for s in data)
    if not isinstance(data, str | os.PathLike):
        return False
    path = Path(data)
    return path.suffix == ".txt" or (path.is_dir() and any(path.glob("*.txt")))


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
    return named.from_pretrained(folder), architecture


def _examples(module: Any, folder: Path, transformers: Any) -> tuple[Examples, dict[str, Any], Any]:
    """Example inputs (a batch of two), their dynamic axes, and the folder's tokenizer (None without one)."""
    import torch

    positional, _ = forward_inputs(module)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception:  # no tokenizer files, or none transformers reads: an image or audio model
        tokenizer = None
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    if tokenizer is not None:
        encoded = tokenizer(EXAMPLE_TEXT, padding=True, return_tensors="pt")
        examples = Examples({k: v for k, v in encoded.items() if k in positional})
        return examples, {k: {0: batch, 1: sequence} for k in examples}, tokenizer
    config = module.config
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if "pixel_values" in positional and isinstance(size, int) and isinstance(channels, int):
        examples = Examples(pixel_values=torch.rand(2, channels, size, size))
        return examples, {"pixel_values": {0: batch}}, None
    raise LoadError(f"'{folder}': requant cannot make example inputs for {type(module).__name__} (no tokenizer, no "
                    "image size in its config): export it to ONNX yourself, or give the module with example_inputs=")


def load_hf_folder(source: str | os.PathLike[str]) -> HfModel:
    """The model of the Hugging Face folder ``source``, exported (see the module's docstring)."""
    folder = Path(source)
    try:
        import torch
        import transformers
    except ImportError:
        raise LoadError(f"reading the Hugging Face folder '{folder}' needs torch and transformers: pip install "
                        "'requant[torch]' transformers") from None  # fmt: skip
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # its loading bars
    try:
        module, task = _module(transformers, folder)
    except LoadError:
        raise
    except Exception as exc:  # transformers raises many kinds for a folder it cannot read
        raise LoadError(f"transformers could not load the model in '{folder}': {type(exc).__name__}: {exc}") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    module = module.float().eval()
    examples, dynamic, tokenizer = _examples(module, folder, transformers)
    model = load_torch(module, examples, dynamic)
    with torch.no_grad():
        returned = module(**examples)
    names = list(returned.keys()) if hasattr(returned, "keys") else []
    if len(names) == len(model.graph.outputs):  # as transformers (and Optimum's exports) name them
        for value, name in zip(model.graph.outputs, names, strict=True):
            value.name = name
    inputs = ", ".join(str(v.name) for v in model.graph.inputs)
    said = (f"the Hugging Face folder '{folder}': {task}, exported by torch.onnx.export (dynamo) in float32 with "
            f"batch{' and sequence' if tokenizer is not None else ''} dynamic (inputs {inputs})")  # fmt: skip
    return HfModel(model, said, tokenizer)
