"""Sound in, for a Hugging Face folder whose model takes audio: its feature extractor's example inputs, and
``.wav`` files read, resampled and made into samples the way the folder's users feed the model.

A folder is an audio model's when its ``preprocessor_config.json`` loads as a ``transformers`` feature extractor
with a ``sampling_rate`` (Wav2Vec2, HuBERT, AST, Whisper...). Its example inputs are the extractor's features of
two clips of noise (:data:`EXAMPLE_SECONDS`); an axis whose size differs between a short and a long clip (a raw
waveform's length) is exported dynamic, the others (Whisper's 3000 frames, AST's 1024) are not.

Data: a ``.wav`` file, a folder of them (sorted by name) or a list of their paths; each is a sample: read by
SciPy (PCM of 8, 16, 24 or 32 bits, or float), its channels averaged to one, resampled to the extractor's rate
(``resample_poly``), at most :data:`MAX_SECONDS` long, then the extractor's features of it.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.frontends.onnx_loader import LoadError
from requant.frontends.paths import named_files

__all__ = ["EXAMPLE_SECONDS", "MAX_SECONDS", "audio_examples", "audio_samples", "feature_extractor", "read_wav"]

log = logging.getLogger("requant")

EXAMPLE_SECONDS = (1.0, 1.5)  # the example clips: an axis whose size differs between them is dynamic
MAX_SECONDS = 30.0  # a calibration clip's length at most (Whisper's window; longer ones are cut)


def feature_extractor(transformers: Any, folder: Path) -> Any:
    """The folder's audio feature extractor, or None (no ``preprocessor_config.json``, or not an audio one)."""
    if not (folder / "preprocessor_config.json").is_file():
        return None
    try:
        extractor = transformers.AutoFeatureExtractor.from_pretrained(folder)
    except Exception:  # an image processor's settings, or a kind transformers does not know: not audio
        return None
    return extractor if isinstance(getattr(extractor, "sampling_rate", None), int) else None


def _noise(seconds: float, rate: int) -> npt.NDArray[np.float32]:
    return np.random.default_rng(0).normal(0.0, 0.1, int(seconds * rate)).astype(np.float32)


def audio_examples(extractor: Any, inputs: list[str]) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """Example inputs (a batch of two clips of noise, as tensors) for the forward parameters ``inputs``, and
    their dynamic axes: the batch, and the axes whose size the clip's length changes."""
    import torch

    rate = extractor.sampling_rate
    clip, longer = (_noise(seconds, rate) for seconds in EXAMPLE_SECONDS)
    short, long = (extractor(sound, sampling_rate=rate, return_tensors="np") for sound in (clip, longer))
    both = extractor([clip, clip], sampling_rate=rate, return_tensors="np")
    examples = {k: torch.from_numpy(np.asarray(v)) for k, v in both.items() if k in inputs}
    if not examples:
        raise LoadError(f"the feature extractor {type(extractor).__name__} makes {', '.join(both)}, which the "
                        f"model's forward does not take ({', '.join(inputs)})")  # fmt: skip
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    dynamic = {}
    for name in examples:
        axes: dict[int, Any] = {0: batch}
        sizes = zip(np.shape(short[name]), np.shape(long[name]), strict=True)
        changed = [i for i, (a, b) in enumerate(sizes) if a != b]
        axes.update({i: length for i in changed[:1] if i > 0})
        dynamic[name] = axes
    return examples, dynamic


def read_wav(path: Path, rate: int) -> npt.NDArray[np.float32]:
    """One ``.wav`` file as mono float32 samples in [-1, 1] at ``rate`` Hz, at most ``MAX_SECONDS`` long."""
    try:
        from scipy.io import wavfile  # type: ignore[import-untyped]
        from scipy.signal import resample_poly  # type: ignore[import-untyped]
    except ImportError:
        raise LoadError(f"reading the sound file '{path}' needs SciPy: pip install scipy") from None

    try:
        given, data = wavfile.read(path)
    except (OSError, ValueError) as exc:
        raise LoadError(f"cannot read the sound file '{path}': {exc} (PCM or float .wav files are read)") from None
    sound = np.asarray(data)
    if sound.dtype == np.uint8:
        sound = (sound.astype(np.float32) - 128.0) / 128.0
    elif sound.dtype.kind == "i":
        sound = sound.astype(np.float32) / float(2 ** (8 * sound.dtype.itemsize - 1))
    sound = sound.astype(np.float32)
    if sound.ndim == 2:
        sound = sound.mean(axis=1)
    if sound.size == 0:
        raise LoadError(f"the sound file '{path}' holds no samples")
    if given != rate:
        common = math.gcd(int(given), rate)
        sound = resample_poly(sound, rate // common, int(given) // common).astype(np.float32)
    if sound.size > MAX_SECONDS * rate:
        log.info("%s: its first %g s of %.1f", path, MAX_SECONDS, sound.size / rate)
        sound = sound[: int(MAX_SECONDS * rate)]
    return sound


def _typed(given: Any) -> npt.NDArray[Any]:
    """Features as float32, masks as int64 (as the exported model's inputs are typed)."""
    array: npt.NDArray[Any] = np.asarray(given)
    return array.astype(np.int64) if array.dtype.kind in "iub" else array.astype(np.float32)


def audio_samples(extractor: Any, data: Any, inputs: set[str], what: str) -> list[dict[str, Any]] | None:
    """``data`` as samples of the model's ``inputs`` (a clip each, through the extractor), or None when it is
    not sound files."""
    files = named_files(data, (".wav",))
    if files is None:
        if isinstance(data, str | os.PathLike) and Path(data).is_dir():
            raise LoadError(f"the {what} folder '{data}' holds no .wav files (an audio model's data: .wav files, "
                            "which its feature extractor makes into inputs)")  # fmt: skip
        return None
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise LoadError(f"the {what} sound file '{missing[0]}' does not exist")
    rate = extractor.sampling_rate
    samples = []
    for path in files:
        features = extractor(read_wav(path, rate), sampling_rate=rate, return_tensors="np")
        samples.append({k: _typed(v) for k, v in features.items() if k in inputs})
    return samples
