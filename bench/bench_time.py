"""Quantization time of requant against its peers, alternated: the way to compare seconds on a shared machine.

``bench_quantize.py`` times each tool once, one after the other; on this machine a later run can be
slower by a third for reasons of its own. Here each model's runs (``--runs``, as in
``bench_quantize.py``) take turns, ``--repeats`` times, each quantization in a fresh process
(``run_tool``: start-up included, as a user pays it), and the medians are printed with their ratio
to the first run's.

    .venv/bin/python bench/bench_time.py --models ocrdet --calib 32 --runs requant:auto,nncf:default/folded
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_time.py ...   # AVX2 kernels (bench/ort_without_vnni.py)
"""

from __future__ import annotations

import argparse
import compileall
import json
import pickle
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v2,efficientnet_lite0")
    parser.add_argument("--calib", type=int, default=200)
    parser.add_argument("--runs", default="requant:auto,nncf:default/folded", help="tool:method, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from bench_quantize import ROOT, export, run_tool
    from requant.frontends import load_onnx, save_onnx
    from requant.passes import get_passes, run_passes

    compileall.compile_dir(str(ROOT / "src"), quiet=1)  # as pip compiles a package at install
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models.split(","):
            path, calib, _, _ = export(name, folder, args.calib, 1)
            data = folder / f"{name}.calib.pkl"
            data.write_bytes(pickle.dumps(calib))
            folded, _ = run_passes(load_onnx(path), get_passes("canonicalize"))
            folded_path = folder / f"{name}.folded.onnx"
            save_onnx(folded, folded_path)
            runs = [tuple(r.split(":", 1)) for r in args.runs.split(",")]
            seconds: dict[str, list[float]] = {f"{t}:{m}": [] for t, m in runs}
            for _ in range(args.repeats):
                for tool, method in runs:
                    source = folded_path if method.endswith("/folded") else path
                    given = ("transformer" if name == "minilm" else "default") if tool == "nncf" else method
                    measured = run_tool(tool, given, source, data, folder / "out.onnx", repeat_below=0.0)
                    if "error" in measured:
                        raise SystemExit(f"{name} {tool}:{method}: {measured['error']}")
                    seconds[f"{tool}:{method}"].append(measured["seconds"])
            first = statistics.median(next(iter(seconds.values())))
            for run, times in seconds.items():
                median = statistics.median(times)
                print(f"{name:20} {run:32} {' '.join(f'{t:6.2f}' for t in times)}  median {median:6.2f} s "
                      f"({median / first:.2f}x)", flush=True)  # fmt: skip
            results[name] = seconds
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
