"""requant against ONNX Runtime's ``quantize_static`` on real models, the same data, the same machine.

For each model: the float ONNX (exported once), calibration and evaluation samples (disjoint),
then each tool and method in a fresh process (its wall time and peak memory, ``VmHWM``; the
median of five runs when one takes under two seconds, where start-up is most of it), then
quality against the float model, int8/fp32 latency (batch 1, 2 threads; median over 200 blocks of
runs of about 10 ms each) and output size.
ONNX Runtime gets its recommended flow: ``quant_pre_process`` then ``quantize_static`` (QDQ,
per-channel weights, uint8 activations, int8 weights), with MinMax, Entropy and Percentile,
on the exported model; and MinMax again on the model with batch norm folded into the convs
(requant's ``canonicalize``: ONNX Runtime's pre-processing does not fold the exporter's batch
norms, so on the exported model it leaves every conv in float: "/folded" is the like-for-like run).

    .venv/bin/python bench/bench_quantize.py [--models digits,mobilenet_v2,efficientnet_lite0,minilm]
                                             [--calib 200] [--eval 100]
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
import time
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
    method, _, preset = method.partition("+")  # "mse+full": a method and a preset; "mse+keep29": keep_float_below
    keep = float(preset[4:]) if preset.startswith("keep") else None
    preset = {"reduced": "INT8_REDUCED_RANGE_WEIGHTS", "full": "INT8_PER_CHANNEL_WEIGHTS",
              "floatout": "UINT8_FLOAT_OUTPUTS"}.get(preset, preset)  # fmt: skip
    quantizer = Quantizer().set_global(PRESETS[preset]) if preset and keep is None else None
    requant.api.quantize(model, samples, method=method, quantizer=quantizer, output=out,
                         progress=lambda done, elapsed: None, measure=False, keep_float_below=keep)
else:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    class Reader(CalibrationDataReader):
        def __init__(self): self.it = iter(samples)
        def get_next(self): return next(self.it, None)
    method = method.partition("/")[0]  # "MinMax/folded": the parent passes the folded model
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
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def outputs(path: Path, samples: list[dict[str, np.ndarray]]) -> np.ndarray:
    s = session(path)
    return np.concatenate([np.asarray(s.run(None, x)[0], np.float64).reshape(1, -1) for x in samples])


def latency_ms(path: Path, sample: dict[str, np.ndarray], blocks: int = 200) -> float:
    """Median time of one run (batch 1), over ``blocks`` blocks of runs of about 10 ms each: a
    model that runs in 30 us is timed over many runs at once, not one perf_counter pair each."""
    s = session(path)
    start, warm = time.perf_counter(), 0
    while warm < 10 or time.perf_counter() - start < 0.2:
        s.run(None, sample)
        warm += 1
    block = max(1, int(0.01 / ((time.perf_counter() - start) / warm)))
    times = []
    for _ in range(blocks):
        begin = time.perf_counter()
        for _ in range(block):
            s.run(None, sample)
        times.append((time.perf_counter() - begin) / block)
    return float(np.median(times) * 1e3)


def quality(name: str, f: np.ndarray, q: np.ndarray, labels: np.ndarray | None) -> dict[str, float]:
    if name == "minilm":
        cos = np.sum(f * q, 1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1))
        return {"cosine": float(cos.mean())}
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


def main() -> None:
    import pickle

    import onnxruntime

    from requant.frontends import load_onnx, save_onnx
    from requant.passes import get_passes, run_passes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,mobilenet_v2,efficientnet_lite0,minilm")
    parser.add_argument("--calib", type=int, default=200)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(f"onnxruntime {onnxruntime.__version__}; {os.cpu_count()} cores; latency: batch 1, 2 threads, median")
    # requant's sources byte-compiled, as pip compiles onnxruntime's at install (start-up is timed)
    compileall.compile_dir(str(ROOT / "src"), quiet=1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models.split(","):
            path, calib, evaluation, labels = export(name, folder, args.calib, args.eval)
            data = folder / f"{name}.calib.pkl"
            data.write_bytes(pickle.dumps(calib))
            reference = outputs(path, evaluation)
            base_latency = latency_ms(path, evaluation[0])
            rows = []
            folded, _ = run_passes(load_onnx(path), get_passes("canonicalize"))
            folded_path = folder / f"{name}.folded.onnx"
            save_onnx(folded, folded_path)
            runs = [
                ("requant", m) for m in ("minmax", "percentile", "mse", "entropy", "percentile+reduced", "mse+full")
            ]
            if name == "minilm":  # linear layers feeding float LayerNorm/GELU/residuals: float outputs
                runs += [("requant", m) for m in ("minmax+floatout", "mse+floatout")]
            else:  # conv nets: the convs whose int8 output is below 29 dB SQNR kept float
                runs += [("requant", "mse+keep29")]
            runs += [("onnxruntime", m) for m in ("MinMax", "Entropy", "Percentile", "MinMax/folded")]
            for tool, method in runs:
                out = folder / f"{name}.{tool}.{method.replace('/', '_')}.onnx"
                source = folded_path if method.endswith("/folded") else path
                measured = run_tool(tool, method, source, data, out)
                row: dict[str, Any] = {"tool": tool, "method": method, **measured}
                if "error" not in measured:
                    row.update(quality(name, reference, outputs(out, evaluation), labels))
                    row["latency_ratio"] = latency_ms(out, evaluation[0]) / base_latency
                    row["size_mb"] = out.stat().st_size / 1e6
                rows.append(row)
            results[name] = {
                "float_latency_ms": base_latency,
                "calib": len(calib),
                "eval": len(evaluation),
                "runs": rows,
            }
            report(name, results[name])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(name: str, result: dict[str, Any]) -> None:
    metric = "cosine" if name == "minilm" else "accuracy" if name == "digits" else "top1_agreement"
    print(
        f"\n{name}: {result['calib']} calibration / {result['eval']} evaluation samples; float {result['float_latency_ms']:.2f} ms"
    )
    print(
        f"  {'tool':<12} {'method':<14} {metric:>15} {'top5/KL':>14} {'int8/fp32':>10} {'seconds':>8} {'peak MB':>8} {'MB':>6}"
    )
    for r in result["runs"]:
        if "error" in r:
            print(f"  {r['tool']:<12} {r['method']:<14} failed: {r['error'][:80]}")
            continue
        extra = f"{r.get('top5_overlap', 0):.3f}/{r.get('kl', 0):.4f}" if "kl" in r else ""
        print(
            f"  {r['tool']:<12} {r['method']:<14} {r[metric]:>15.4f} {extra:>14} {r['latency_ratio']:>10.2f} "
            f"{r['seconds']:>8.{2 if r['seconds'] < 10 else 1}f} {r['peak_mb']:>8.0f} {r['size_mb']:>6.2f}"
        )


if __name__ == "__main__":
    main()
