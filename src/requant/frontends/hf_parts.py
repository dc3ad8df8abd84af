"""A Hugging Face folder of a model made of parts, each exported (and then quantized) as its own ONNX model, named as
Optimum names its files:

- Whisper (``WhisperForConditionalGeneration``): ``encoder_model`` (``input_features`` in, ``last_hidden_state``
  out) and ``decoder_model`` (``input_ids`` and ``encoder_hidden_states`` in, ``logits`` out; no cache: each step
  reads the whole prefix);
- CLIP (``CLIPModel``): ``text_model`` (``input_ids`` and ``attention_mask`` in, ``text_embeds`` out) and
  ``vision_model`` (``pixel_values`` in, ``image_embeds`` out), as ``CLIPTextModelWithProjection`` and
  ``CLIPVisionModelWithProjection`` compute and name them.

Each part is exported once, in float32 and eval mode, by the PyTorch front door
(:func:`~requant.frontends.torch_loader.load_torch`), batch dynamic and, for token inputs, the sequence too.

Data for a model of parts is one source that each part reads what it can of, or a dict of sources by part name
(:meth:`Part.samples`): Whisper's encoder reads ``.wav`` files through the folder's feature extractor, and its
decoder is calibrated on what it reads when it transcribes them: each clip's features through the float encoder,
then the float model's greedy tokens (at most ``DECODE_TOKENS``), the whole sequence one sample. CLIP's text part
reads text (as an encoder's folder does: :func:`~requant.frontends.hf_folder.text_rows`) through the folder's
tokenizer, its vision part image files through the folder's image processor: a folder holding both images and a
``.txt`` of captions serves both. Anything else (arrays, ``.npz`` files) is given to a part as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.frontends.audio import audio_examples, audio_samples, feature_extractor
from requant.frontends.hf_folder import (
    DEFAULT_FIELD,
    EXAMPLE_TEXT,
    MAX_TOKENS,
    folder_tokenizer,
    is_hf_folder,
    loaded,
    text_rows,
)
from requant.frontends.onnx_loader import LoadError
from requant.frontends.paths import named_files
from requant.frontends.torch_loader import load_torch
from requant.report.detections import POOR_SHARE

__all__ = ["CHECK_SAMPLES", "DECODE_TOKENS", "PARTED", "PART_NAMES", "Part", "Parted", "by_part", "check_lines",
           "edits", "load_parts", "parts_of"]  # fmt: skip

DECODE_TOKENS = 32  # a Whisper decoder's calibration sequence: the start token and at most this many more
CHECK_SAMPLES = 16  # the check of the parts together runs at most this many clips, images and captions
# the parts together are poor (the summary's NOT USABLE AS IS) as a detector is (its POOR_SHARE, 0.8): when the int8
# Whisper's transcripts change more than one token in five of float's (edits over float's tokens), or the int8
# CLIP's best caption is float's for fewer than four images in five

Samples = Callable[[Any, str, str], Any]  # (data, "calibration" or "evaluation", text field) -> the part's samples


@dataclass
class Part:
    """One part of the model: its file's stem (``name``), the exported model, what the report says of it, and how
    it reads data (``reader``: see :meth:`samples`)."""

    name: str
    model: ir.Model
    said: str
    reader: Samples

    def samples(self, data: Any, what: str, parts: tuple[str, ...], field: str = DEFAULT_FIELD) -> Any:
        """``data`` as this part's samples: a dict by part name (:func:`by_part`; ``parts``: the names of the
        model's parts) gives this part its own entry; other data is read by the part (see the module's docstring)."""
        if data is None:
            return None
        if by_part(data, parts, what):
            data = data[self.name]
        return self.reader(data, what, field)


def by_part(data: Any, names: tuple[str, ...], what: str) -> bool:
    """Whether ``data`` gives each of the parts ``names`` its own data: a dict whose keys are part names (those of
    ``names``, or others ending in ``_model``, as every part's file is named). A part it leaves out, or a key that is
    no part of this model, is a :class:`LoadError` naming it and the model's parts: checked before any work
    (:func:`requant.options.preflight`), as every part is exported first."""
    if not isinstance(data, Mapping) or not data:
        return False
    if not all(isinstance(k, str) and (k in names or k.endswith("_model")) for k in data):
        return False
    parts = ", ".join(names)
    unknown = [k for k in data if k not in names]
    if unknown:
        raise LoadError(f"the {what} data names parts ({', '.join(data)}) and '{unknown[0]}' is not one of the "
                        f"model's (its parts: {parts})")  # fmt: skip
    missing = [n for n in names if n not in data]
    if missing:
        raise LoadError(f"the {what} data names parts ({', '.join(data)}) but not '{missing[0]}' (the model's parts: "
                        f"{parts})")  # fmt: skip
    return True


@dataclass
class Parted:
    """The parts, and the check of them together as their users run them (``check(models, data, what)``: the
    quantized parts by name, data to read, what it is; the report's section, empty when the data cannot serve)."""

    parts: list[Part]
    check: Callable[[Mapping[str, ir.Model], Any, str], dict[str, Any]]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.parts)


def _architecture(folder: Path) -> str:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str((config.get("architectures") or [""])[0])


def parts_of(source: Any) -> tuple[str, ...]:
    """The names of the parts of the model in ``source`` when it is a Hugging Face folder of a model requant
    quantizes as parts (:data:`PARTED`); else none."""
    if not is_hf_folder(source):
        return ()
    return PART_NAMES.get(_architecture(Path(source)), ())


def load_parts(source: str | os.PathLike[str]) -> Parted:
    """The parts of the model in the Hugging Face folder ``source``, exported (see the module's docstring)."""
    folder = Path(source)
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        raise LoadError(f"reading the Hugging Face folder '{folder}' needs torch and transformers: pip install "
                        "'requant[torch]' transformers") from None  # fmt: skip
    architecture = _architecture(folder)
    whole = loaded(transformers, folder, lambda: getattr(transformers, architecture).from_pretrained(folder))
    return PARTED[architecture](whole.float().eval(), folder, transformers)


def _said(folder: Path, architecture: str, part: str, inputs: str) -> str:
    return (f"the Hugging Face folder '{folder}': {architecture}, its {part} (inputs {inputs}), exported by "
            "torch.onnx.export (dynamo) in float32")  # fmt: skip


def _named(model: ir.Model, names: list[str]) -> ir.Model:
    for value, name in zip(model.graph.outputs, names, strict=True):
        value.name = name
    return model


# ----------------------------------------------------------------------------- Whisper
def _whisper_modules(whole: Any) -> tuple[Any, Any]:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = whole.get_encoder()

        def forward(self, input_features: Any) -> Any:
            return self.encoder(input_features=input_features).last_hidden_state

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder, self.proj_out = whole.get_decoder(), whole.proj_out

        def forward(self, input_ids: Any, encoder_hidden_states: Any) -> Any:
            hidden = self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, use_cache=False)
            return self.proj_out(hidden.last_hidden_state)

    return Encoder().eval(), Decoder().eval()


def _greedy(step: Callable[[Any], Any], config: Any) -> Any:
    """Greedy tokens (``[1, T]`` int64): the start token, then at most ``DECODE_TOKENS`` more, up to and with the
    end token; ``step(ids)`` is the next token's logits (``[1, vocabulary]``) after ``ids``."""
    ids = np.array([[config.decoder_start_token_id]], np.int64)
    limit = min(DECODE_TOKENS + 1, config.max_target_positions)
    while ids.shape[1] < limit:
        token = int(np.argmax(step(ids)[0]))
        ids = np.concatenate([ids, [[token]]], 1)
        if token == config.eos_token_id:
            break
    return ids


def _session(model: ir.Model) -> Any:
    import onnxruntime as ort  # type: ignore[import-untyped]

    from requant.runtime import cpu_session

    return cpu_session(ir.to_proto(model).SerializeToString(), ort.SessionOptions(), "the parts' check")


def _transcribed(encoding: Any, decoding: Any, sample: Mapping[str, Any], config: Any) -> list[int]:
    """A clip's greedy tokens by the quantized encoder and decoder (ONNX Runtime sessions)."""
    (hidden,) = encoding.run(None, dict(sample))

    def step(ids: Any) -> Any:
        return decoding.run(None, {"input_ids": ids, "encoder_hidden_states": hidden})[0][:, -1]

    tokens: list[int] = _greedy(step, config)[0].tolist()
    return tokens


def edits(floats: list[int], ints: list[int]) -> int:
    """The fewest tokens inserted, deleted or replaced that turn ``floats`` into ``ints`` (Levenshtein)."""
    row = list(range(len(ints) + 1))
    for i, a in enumerate(floats, 1):
        previous, row[0] = row[0], i
        for j, b in enumerate(ints, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (a != b))
    return row[-1]


def _transcripts(pairs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """Float's and int8's greedy tokens of each clip, compared: how many identical, float's tokens kept up to the
    first difference, and changed (edits over float's tokens; poor past ``POOR_SHARE``)."""
    rate = sum(edits(f, q) for f, q in pairs) / max(sum(len(f) for f, _ in pairs), 1)
    return {"samples": len(pairs), "identical": sum(f == q for f, q in pairs),
            "tokens_kept": round(float(np.mean([_kept(f, q) for f, q in pairs])), 4),
            "max_tokens": max(len(f) for f, _ in pairs), "token_error_rate": round(rate, 4),
            "poor": rate > 1 - POOR_SHARE}  # fmt: skip


def _kept(floats: list[int], ints: list[int]) -> float:
    """The share of float's tokens the int8 model's give, up to their first difference."""
    same = next((i for i, (a, b) in enumerate(zip(floats, ints, strict=False)) if a != b), min(len(floats), len(ints)))
    return same / len(floats)


def _whisper_exports(encoder: Any, decoder: Any, extractor: Any, config: Any) -> tuple[ir.Model, ir.Model]:
    """Whisper's encoder (batch dynamic; its frames are fixed) and decoder (batch and sequence dynamic), exported."""
    import torch

    sound, dynamic = audio_examples(extractor, ["input_features"])
    encoder_model = _named(load_torch(encoder, sound, dynamic), ["last_hidden_state"])
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", max=config.max_target_positions)
    with torch.no_grad():
        hidden = encoder(sound["input_features"])
    ids = torch.tensor([[config.decoder_start_token_id, 3, 4, 5]] * 2, dtype=torch.int64)
    decoder_model = _named(load_torch(decoder, {"input_ids": ids, "encoder_hidden_states": hidden},
                                      {"input_ids": {0: batch, 1: sequence}, "encoder_hidden_states": {0: batch}}),
                           ["logits"])  # fmt: skip
    return encoder_model, decoder_model


def _whisper(whole: Any, folder: Path, transformers: Any) -> Parted:
    import torch

    extractor = feature_extractor(transformers, folder)
    if extractor is None:
        raise LoadError(f"'{folder}': a Whisper folder needs its feature extractor's settings "
                        "(preprocessor_config.json) to read sound")  # fmt: skip
    encoder, decoder = _whisper_modules(whole)
    config = whole.config
    encoder_model, decoder_model = _whisper_exports(encoder, decoder, extractor, config)

    def features(data: Any, what: str, field: str) -> Any:
        sound = audio_samples(extractor, data, {"input_features"}, what)
        return data if sound is None else sound

    done: dict[bytes, tuple[Any, Any]] = {}  # by the features' digest: the decoder's samples and the check share clips

    def transcribed(features: Any) -> tuple[Any, Any]:  # the float model's encoder output and greedy tokens
        key = hashlib.sha256(np.ascontiguousarray(features).tobytes()).digest()
        if key not in done:
            with torch.no_grad():
                hidden = encoder(torch.from_numpy(features))
                ids = _greedy(lambda ids: decoder(torch.from_numpy(ids), hidden)[:, -1].numpy(), config)
            done[key] = (hidden.numpy(), ids)
        return done[key]

    def decoded(data: Any, what: str, field: str) -> Any:
        sound = audio_samples(extractor, data, {"input_features"}, what)
        if sound is None:
            return data
        samples = []
        for sample in sound:
            hidden, ids = transcribed(sample["input_features"])
            samples.append({"input_ids": ids, "encoder_hidden_states": hidden})
        return samples

    def check(models: Mapping[str, ir.Model], data: Any, what: str) -> dict[str, Any]:
        sound = audio_samples(extractor, data, {"input_features"}, what)
        if not sound:
            return {}
        encoding, decoding = _session(models["encoder_model"]), _session(models["decoder_model"])
        clips = sound[:CHECK_SAMPLES]
        floats = [transcribed(clip["input_features"])[1][0].tolist() for clip in clips]
        ints = [_transcribed(encoding, decoding, clip, config) for clip in clips]
        return {"check": "greedy transcripts", "data": what, **_transcripts(list(zip(floats, ints, strict=True)))}

    architecture, rate = type(whole).__name__, extractor.sampling_rate
    encoder_said = _said(folder, architecture, "encoder, feature extraction", "input_features")
    decoder_said = _said(folder, architecture, "decoder without a cache", "input_ids, encoder_hidden_states")
    return Parted([
        Part("encoder_model", encoder_model, f"{encoder_said}, batch dynamic; sound through its "
             f"{type(extractor).__name__} at {rate} Hz", features),
        Part("decoder_model", decoder_model, f"{decoder_said}, batch and sequence dynamic; calibrated on the float "
             f"model's greedy tokens (at most {DECODE_TOKENS}) for each clip", decoded),
    ], check)  # fmt: skip


# ----------------------------------------------------------------------------- CLIP
def _clip_modules(whole: Any) -> tuple[Any, Any]:
    import torch

    class Text(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text_model, self.text_projection = whole.text_model, whole.text_projection

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            pooled = self.text_model(input_ids=input_ids, attention_mask=attention_mask).pooler_output
            return self.text_projection(pooled)

    class Vision(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_model, self.visual_projection = whole.vision_model, whole.visual_projection

        def forward(self, pixel_values: Any) -> Any:
            return self.visual_projection(self.vision_model(pixel_values=pixel_values).pooler_output)

    return Text().eval(), Vision().eval()


def _processor(transformers: Any, folder: Path) -> Any:
    """The folder's image processor, or None; quietly (without torchvision, which the registry's builds do not give
    beside torch 2.13, transformers 5.23 says on each load that it falls back to its PIL processor)."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return transformers.AutoImageProcessor.from_pretrained(folder)
    except Exception:  # transformers raises many kinds for files it cannot read (or that are not there)
        return None
    finally:
        logging.set_verbosity(level)


def _clip_exports(text: Any, vision: Any, tokenizer: Any, config: Any) -> tuple[ir.Model, ir.Model]:
    """CLIP's towers exported: the text one with batch and sequence dynamic (its example from the tokenizer, else ids
    ending in the end token, where CLIP pools), the vision one with the batch dynamic."""
    import torch

    if tokenizer is not None:
        encoded = tokenizer(EXAMPLE_TEXT, padding=True, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
    else:
        ids = torch.randint(3, config.text_config.vocab_size, (2, 7))
        ids[:, -1] = config.text_config.eos_token_id
        mask = torch.ones_like(ids)
    sequence = torch.export.Dim("sequence", max=config.text_config.max_position_embeddings)
    batch = torch.export.Dim("batch")
    text_model = _named(load_torch(text, {"input_ids": ids, "attention_mask": mask},
                                   {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}}),
                        ["text_embeds"])  # fmt: skip
    size = config.vision_config.image_size
    pixels = torch.rand(2, config.vision_config.num_channels, size, size)
    vision_model = _named(load_torch(vision, {"pixel_values": pixels}, {"pixel_values": {0: batch}}), ["image_embeds"])
    return text_model, vision_model


def _clip(whole: Any, folder: Path, transformers: Any) -> Parted:
    import torch

    text, vision = _clip_modules(whole)
    tokenizer = folder_tokenizer(transformers, folder)
    processor = _processor(transformers, folder)
    config = whole.config
    text_model, vision_model = _clip_exports(text, vision, tokenizer, config)
    size = config.vision_config.image_size

    def tokenized(data: Any, what: str, field: str) -> Any:
        rows = text_rows(data, field, what)
        if rows is None:
            return data
        if tokenizer is None:
            raise LoadError(f"the {what} text cannot be read: '{folder}' has no tokenizer")
        rows = [row for row in rows if row.strip()]
        if not rows:
            raise LoadError(f"the {what} data has no text for CLIP's text model")
        return [{k: np.asarray(v, np.int64) for k, v in tokenizer(row, truncation=True, return_tensors="np",
                 max_length=min(MAX_TOKENS, config.text_config.max_position_embeddings)).items()
                 if k in ("input_ids", "attention_mask")} for row in rows]  # fmt: skip

    def pictures(data: Any, what: str, field: str) -> Any:
        from requant.calibration.images import IMAGE_SUFFIXES

        files = named_files(data, IMAGE_SUFFIXES)
        if files is None:
            return data
        if processor is None:
            raise LoadError(f"the {what} images cannot be read: '{folder}' has no image processor settings "
                            "(preprocessor_config.json)")  # fmt: skip
        from PIL import Image

        return [{"pixel_values": np.asarray(processor(images=Image.open(path).convert("RGB"), return_tensors="np")
                                            ["pixel_values"], np.float32)} for path in files]  # fmt: skip

    def check(models: Mapping[str, ir.Model], data: Any, what: str) -> dict[str, Any]:
        texts, images = tokenized(data, what, DEFAULT_FIELD), pictures(data, what, DEFAULT_FIELD)
        if texts is data or images is data or not texts or not images:  # not both captions and images
            return {}
        texts, images = texts[:CHECK_SAMPLES], images[:CHECK_SAMPLES]
        with torch.no_grad():
            f_text = [text(**{k: torch.from_numpy(v) for k, v in t.items()}).numpy() for t in texts]
            f_image = [vision(torch.from_numpy(i["pixel_values"])).numpy() for i in images]
        reading, seeing = _session(models["text_model"]), _session(models["vision_model"])
        q_text = [reading.run(None, t)[0] for t in texts]
        q_image = [seeing.run(None, i)[0] for i in images]
        identical = int(np.sum(_best(f_image, f_text) == _best(q_image, q_text)))  # poor: under POOR_SHARE of them
        return {"check": "zero-shot matches", "data": what, "samples": len(images), "captions": len(texts),
                "identical": identical, "poor": identical < POOR_SHARE * len(images)}  # fmt: skip

    architecture = type(whole).__name__
    inputs = "input_ids, attention_mask"
    text_said = _said(folder, architecture, "text tower and projection, feature extraction", inputs)
    vision_said = _said(folder, architecture, "vision tower and projection, feature extraction", "pixel_values")
    return Parted([
        Part("text_model", text_model, f"{text_said}, batch and sequence dynamic", tokenized),
        Part("vision_model", vision_model, f"{vision_said}, batch dynamic, {size}x{size} images", pictures),
    ], check)  # fmt: skip


def _best(images: list[Any], texts: list[Any]) -> Any:
    """For each image, the caption whose embedding is the most similar (cosine)."""
    a, b = np.concatenate(images), np.concatenate(texts)
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.argmax(a @ b.T, axis=1)


PART_NAMES = {"WhisperForConditionalGeneration": ("encoder_model", "decoder_model"),
              "CLIPModel": ("text_model", "vision_model")}  # fmt: skip
PARTED: dict[str, Callable[[Any, Path, Any], Parted]] = {
    "WhisperForConditionalGeneration": _whisper,
    "CLIPModel": _clip,
}


def check_lines(section: Mapping[str, Any]) -> list[str]:
    """The check of the parts together, in words (the summary's line; ``NOT USABLE AS IS`` first when poor)."""
    if not section:
        return []
    alarm = "NOT USABLE AS IS: the parts together, " if section.get("poor") else ""
    if section["check"] == "greedy transcripts":
        clips = section["samples"]
        return [f"{alarm}greedy transcripts ({section['data']} data, {clips} clips, up to {section['max_tokens']} "
                f"tokens): {section['identical']} of {clips} identical to float's; float's tokens kept up to the first "
                f"difference: {section['tokens_kept']:.0%} on average{_changed(section)}"]  # fmt: skip
    return [f"{alarm}zero-shot matches ({section['data']} data): the caption (of {section['captions']}) each of "
            f"{section['samples']} images matches best is float's for {section['identical']}"]  # fmt: skip


def _changed(section: Mapping[str, Any]) -> str:
    """The share of float's tokens changed, in words (a report read back from before it was counted has none)."""
    rate = section.get("token_error_rate")
    return "" if rate is None else f"; {rate:.0%} of float's tokens changed (edits)"
