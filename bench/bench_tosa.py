"""The tosa-int8 target against requant's ONNX Runtime output, on the same models and data.

For each model: quantize for ``tosa-int8`` (time), validate the MLIR with ``mlir-opt``, compile it
with IREE for this CPU (``--iree-llvmcpu-target-cpu=host``: time, size), check IREE's outputs bit
for bit against requant's interpreter on the first samples, and measure quality (top-1 agreement
and KL with the float model on the evaluation samples, through the interpreter; requant's default
ONNX Runtime output beside it) and latency (batch 1, 2 threads: the float model with batch norm
folded in ONNX Runtime, requant's ONNX Runtime output and the IREE module, interleaved in one
process: alternating blocks, medians). Quality is ``bench_quantize.quality``'s for the model: top-1
agreement, top-5 overlap and KL for the classifiers, text IoU and SQNR for PP-OCRv4's detector
(``ocrdet``: full 736x992 photos; the interpreter takes seconds a photo there).

    .venv/bin/python bench/bench_tosa.py --models digits,mobilenet_v2,efficientnet_lite0 --eval 100
    .venv/bin/python bench/bench_tosa.py --models ocrdet --calib 32 --eval 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import requant  # noqa: E402
from bench_quantize import export, quality  # noqa: E402
from requant.backends.tosa.interpreter import run_tosa  # noqa: E402
from requant.backends.tosa.tools import IreeModule, compile_iree, validate_tosa  # noqa: E402
from requant.frontends import load_onnx, save_onnx  # noqa: E402
from requant.passes import get_passes, run_passes  # noqa: E402
from requant.report.latency import interleaved_latency_ms, session  # noqa: E402


class _Iree:
    """An IREE module behind ONNX Runtime's ``run(None, feeds)``, for the interleaved measurement."""

    def __init__(self, module: IreeModule, quantize: Any) -> None:
        self.module, self.quantize = module, quantize

    def run(self, _: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.module.run(self.quantize(feeds))


def _metrics(measured: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in measured.items())


def one(name: str, folder: Path, calib_count: int, eval_count: int, rounds: int) -> dict[str, Any]:
    path, calib, evaluation, _ = export(name, folder, calib_count, eval_count)
    start = time.perf_counter()
    tosa = requant.quantize(path, calib, target="tosa-int8", measure=False)
    seconds = time.perf_counter() - start
    default = requant.quantize(path, calib, measure=False)
    program = tosa.tosa
    assert program is not None
    text = tosa.mlir()
    validate_tosa(text)
    start = time.perf_counter()
    module = IreeModule(compile_iree(text, cpu="host"))
    compile_seconds = time.perf_counter() - start
    edges = program.inputs

    def quantize(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [e.quantize(feeds[e.name]) for e in edges]

    out = program.outputs[0]
    folded, _ = run_passes(load_onnx(path), get_passes("canonicalize"))  # the fastest float model: BN folded
    save_onnx(folded, folder / f"{name}.folded.onnx")
    float_session = session(str(folder / f"{name}.folded.onnx"))
    default_path = folder / f"{name}.requant.onnx"
    default.save(default_path)
    int8_session = session(str(default_path))
    floats, defaults, ints, mismatches = [], [], [], 0
    for i, sample in enumerate(evaluation):
        inputs = quantize(sample)
        (expected,) = run_tosa(program, dict(zip([e.name for e in edges], inputs, strict=True)))
        if i < 8:
            mismatches += int(np.count_nonzero(module.run(inputs)[0] != expected))
        floats.append(np.asarray(float_session.run(None, sample)[0], np.float64).reshape(-1))
        defaults.append(np.asarray(int8_session.run(None, sample)[0], np.float64).reshape(-1))
        ints.append(out.dequantize(expected).astype(np.float64).reshape(-1))
    f, d, t = (np.array(a) for a in (floats, defaults, ints))
    times = interleaved_latency_ms([float_session, int8_session, _Iree(module, quantize)], evaluation[0],
                                   budget_s=0.0, block_ms=20.0, min_rounds=rounds, max_rounds=rounds)  # fmt: skip
    return {
        "quantize_seconds": seconds,
        "mlir_bytes": len(text.encode()),
        "iree_compile_seconds": compile_seconds,
        "iree_mismatches_first_8": mismatches,
        "evaluation_samples": len(evaluation),
        "tosa": quality(name, f, t, None),
        "onnxruntime": quality(name, f, d, None),
        "latency_ms": {"float": times[0], "onnxruntime_int8": times[1], "iree_tosa": times[2]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,mobilenet_v2,efficientnet_lite0")
    parser.add_argument("--calib", type=int, default=64)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            r = results[name] = one(name, Path(folder), args.calib, args.eval, args.rounds)
            lat = r["latency_ms"]
            print(f"{name}: TOSA {_metrics(r['tosa'])} | ONNX Runtime int8 {_metrics(r['onnxruntime'])} | IREE mismatches "
                  f"{r['iree_mismatches_first_8']} | ms float {lat['float']:.3f}, ORT int8 {lat['onnxruntime_int8']:.3f} "
                  f"({lat['onnxruntime_int8'] / lat['float']:.2f}x), IREE {lat['iree_tosa']:.3f} "
                  f"({lat['iree_tosa'] / lat['float']:.2f}x) | quantize {r['quantize_seconds']:.1f} s, "
                  f"iree-compile {r['iree_compile_seconds']:.1f} s, MLIR {r['mlir_bytes'] / 1e6:.1f} MB", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
