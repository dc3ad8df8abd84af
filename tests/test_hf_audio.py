"""An audio model's Hugging Face folder in (a config, safetensors and a feature extractor's settings), ``.wav``
files as its calibration and evaluation data (read, mixed to mono, resampled to the extractor's rate, made
into features by the folder's own extractor); a folder out that ONNX Runtime runs on features of any length."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import requant
from requant.cli import main
from requant.frontends import LoadError
from requant.frontends.audio import read_wav

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
wavfile = pytest.importorskip("scipy.io.wavfile")


def _clips(folder: Path, count: int, seed: int) -> list[Path]:
    """Tones in noise as users' files come: 16, 8 and 44.1 kHz, 16-bit PCM or float, some in stereo."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        rate = (16000, 8000, 44100)[i % 3]
        t = np.arange(int(rate * rng.uniform(0.6, 1.6))) / rate
        sound = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) + 0.05 * rng.normal(size=t.size)
        if i % 4 == 1:
            sound = np.stack([sound, 0.5 * sound], 1)
        data = (sound * 32767).astype(np.int16) if i % 2 == 0 else sound.astype(np.float32)
        paths.append(folder / f"clip{i:02d}.wav")
        wavfile.write(paths[-1], rate, data)
    return paths


@pytest.fixture(scope="module")
def wav2vec2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wav2Vec2 sound classifier (4 classes, random weights, seeded) with its feature extractor, saved."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        num_labels=4, architectures=["Wav2Vec2ForSequenceClassification"],
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("wav2vec2")
    transformers.Wav2Vec2ForSequenceClassification(config).save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000, do_normalize=True).save_pretrained(folder)
    return folder


def test_a_sound_classifiers_folder_and_wav_files_give_a_folder_onnx_runtime_runs(
    wav2vec2: Path, tmp_path: Path
) -> None:
    """Exported with batch and length dynamic (a raw waveform's), calibrated on 12 clips its extractor made
    features of, judged on 8 others; the folder out runs a clip of a length no sample had, within 0.99 cosine of
    the float model's logits (measured: top-1 1.0000, cosine 0.99996 on the 8)."""
    _clips(tmp_path / "calib", 12, 1)
    _clips(tmp_path / "eval", 8, 2)
    out, printed = tmp_path / "int8", io.StringIO()
    with redirect_stdout(printed):
        code = main(["quantize", str(wav2vec2), "-o", str(out), "--calib", str(tmp_path / "calib"),
                     "--eval", str(tmp_path / "eval"), "--no-measure"])  # fmt: skip
    assert code == 0, printed.getvalue()
    report = json.loads((out / "report.json").read_text())
    assert "Wav2Vec2ForSequenceClassification" in report["model_source"]
    assert "batch and length dynamic" in report["model_source"]
    assert "sound through its Wav2Vec2FeatureExtractor at 16000 Hz" in report["model_source"]
    assert report["evaluation"]["samples"] == 8 and report["evaluation"]["top1_agreement"] >= 0.875
    assert (out / "preprocessor_config.json").is_file()
    extractor = transformers.AutoFeatureExtractor.from_pretrained(out)
    sound = read_wav(_clips(tmp_path / "other", 1, 3)[0], 16000)[:11111]  # a length no sample had
    features = extractor(sound, sampling_rate=16000, return_tensors="np")["input_values"].astype(np.float32)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input_values": features})
    net = transformers.Wav2Vec2ForSequenceClassification.from_pretrained(wav2vec2).eval()
    with torch.no_grad():
        expected = net(torch.from_numpy(features)).logits.numpy()
    assert logits.shape == expected.shape == (1, 4)
    cosine = float((logits * expected).sum() / np.linalg.norm(logits) / np.linalg.norm(expected))
    assert cosine > 0.99, (logits, expected)


def test_a_spectrogram_classifier_is_exported_with_its_fixed_frames(tmp_path: Path) -> None:
    """AST's extractor pads or cuts every clip to its frames (here 128): only the batch is dynamic."""
    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    max_length=128, num_mel_bins=32, num_labels=5,
                                    architectures=["ASTForAudioClassification"])  # fmt: skip
    folder = tmp_path / "ast"
    transformers.ASTForAudioClassification(config).save_pretrained(folder)
    transformers.ASTFeatureExtractor(num_mel_bins=32, max_length=128).save_pretrained(folder)
    files = _clips(tmp_path / "calib", 6, 4)
    result = requant.quantize(str(folder), [str(p) for p in files], measure=False)  # a list of paths
    assert "with batch dynamic (inputs input_values)" in result.report["model_source"]
    (given,) = result.model.graph.inputs
    assert list(given.shape)[1:] == [128, 32]


def test_wav_files_are_read_as_mono_float_at_the_extractors_rate_and_bad_ones_named(tmp_path: Path) -> None:
    rate, seconds = 8000, 0.5
    t = np.arange(int(rate * seconds)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    wavfile.write(tmp_path / "stereo.wav", rate, (np.stack([tone, tone], 1) * 32767).astype(np.int16))
    wavfile.write(tmp_path / "bytes.wav", rate, ((tone + 1) * 127.5).astype(np.uint8))
    for name in ("stereo.wav", "bytes.wav"):
        sound = read_wav(tmp_path / name, 16000)
        assert sound.dtype == np.float32 and sound.shape == (16000 * seconds,)
        assert 0.45 < np.abs(sound).max() <= 0.51  # the tone's amplitude, resampled
    (tmp_path / "broken.wav").write_bytes(b"RIFF not a wave file")
    with pytest.raises(LoadError, match="cannot read the sound file '.*broken.wav'"):
        read_wav(tmp_path / "broken.wav", 16000)
    (tmp_path / "none").mkdir()
    from requant.frontends.audio import audio_samples

    extractor = transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000)
    with pytest.raises(LoadError, match="the calibration folder '.*none' holds no .wav files"):
        audio_samples(extractor, str(tmp_path / "none"), {"input_values"}, "calibration")
    assert audio_samples(extractor, {"input_values": np.zeros((1, 100), np.float32)}, {"input_values"}, "x") is None
