"""requant's accuracy budget (``max_drop``) against NNCF's ``quantize_with_accuracy_control``, same model and data.

The bench's MobileNetV2 and its data (``bench_quantize.export``: 200 calibration and 300 evaluation
crops of the photos that ship with scikit-image and scikit-learn); the metric is top-1 agreement
with the float model on the evaluation crops, the drop absolute, the same for both tools. For each
budget: requant's ``quantize(..., eval_data=..., max_drop=B, metric="top1")`` and, with ``--nncf``,
NNCF's ``quantize_with_accuracy_control`` on the model with batch norm folded (its ONNX backend
needs it: see bench_quantize.py) with the same validation function. Then every output and the float
model run interleaved in one process (``bench_quantize.interleaved_latency``). Each tool quantizes in a
process of its own (NNCF's sessions take their own threads; the latency's share one pool).

    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_budget.py --budgets 0.08,0.05          # ~4 min
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_budget.py --budgets 0.08 --nncf       # NNCF: 10-25 min a budget
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_quantize import export, interleaved_latency, outputs


def top1_agreement(reference: np.ndarray, path: Path, samples: list[dict[str, np.ndarray]]) -> float:
    return float(np.mean(outputs(path, samples).argmax(1) == reference))


def run_requant(model: Path, calib: list[Any], evaluation: list[Any], budget: float, out: Path) -> dict[str, Any]:
    import requant

    start = time.perf_counter()
    result = requant.quantize(model, calib, eval_data=evaluation, max_drop=budget, metric="top1", measure=False)
    seconds = time.perf_counter() - start
    result.save(out)
    record = result.report["accuracy_budget"]
    return {
        "seconds": seconds,
        "kept_float": len(record["kept_float"]),
        "of": record["candidates"],
        "family": record["family"],
        "met": record["met"],
        "tries": len(record["tries"]) - 1,
    }


def run_nncf(folded: Path, calib: list[Any], evaluation: list[Any], budget: float, out: Path) -> dict[str, Any]:
    import nncf
    import onnx
    import onnxruntime as ort

    def top1(model: Any, data: Any) -> np.ndarray:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.concatenate([session.run(None, x)[0] for x in data]).argmax(1)

    reference = top1(onnx.load(folded), evaluation)
    validations = 0

    def validate(model: Any, data: Any) -> float:
        nonlocal validations
        validations += 1
        got = top1(model, data)
        return float(np.mean(got == reference[: len(got)]))

    start = time.perf_counter()
    quantized = nncf.quantize_with_accuracy_control(
        onnx.load(folded), nncf.Dataset(calib), nncf.Dataset(evaluation), validate,
        max_drop=budget, drop_type=nncf.DropType.ABSOLUTE, subset_size=len(calib),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    onnx.save(quantized, out)
    quantizers = sum(1 for n in quantized.graph.node if n.op_type == "QuantizeLinear")
    return {"seconds": seconds, "validations": validations, "quantize_linear_left": quantizers}


def child(tool: str, budget: float, model: Path, data: Path, out: Path) -> None:
    calib, evaluation = pickle.loads(data.read_bytes())
    run = run_requant if tool == "requant" else run_nncf
    print(json.dumps(run(model, calib, evaluation, budget, out)))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        tool, budget, model, data, out = sys.argv[2:7]
        child(tool, float(budget), Path(model), Path(data), Path(out))
        return
    import onnxruntime

    from requant.frontends import load_onnx, save_onnx
    from requant.passes import get_passes, run_passes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.08,0.05", help="absolute top-1 disagreements, comma-separated")
    parser.add_argument("--nncf", action="store_true", help="also NNCF's quantize_with_accuracy_control (slow)")
    parser.add_argument("--rounds", type=int, default=30, help="latency: rounds of blocks of every model")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path, calib, evaluation, _ = export("mobilenet_v2", folder, 200, 300)
        folded = folder / "folded.onnx"
        save_onnx(run_passes(load_onnx(path), get_passes("canonicalize"))[0], folded)
        data = folder / "data.pkl"
        data.write_bytes(pickle.dumps((calib, evaluation)))
        rows: list[dict[str, Any]] = []
        for budget in (float(b) for b in args.budgets.split(",")):
            tools = [("requant", path)] + ([("nncf", folded)] if args.nncf else [])
            for tool, source in tools:
                out = folder / f"{tool}_{budget}.onnx"
                command = [sys.executable, __file__, "--child", tool, str(budget), str(source), str(data), str(out)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                row = {"budget": budget, "tool": tool, **json.loads(done.stdout.splitlines()[-1]), "path": out}
                rows.append(row)
        onnxruntime.set_global_thread_pool_sizes(2, 1)  # one pool for the sessions timed together
        reference = outputs(path, evaluation).argmax(1)
        for row in rows:
            row["drop"] = 1.0 - top1_agreement(reference, row["path"], evaluation)
            shown = {k: v for k, v in row.items() if k != "path"}
            print(f"budget {row['budget']} {row['tool']}: {shown}", flush=True)
        times = interleaved_latency([folded, *(r["path"] for r in rows)], evaluation[0], args.rounds)
        print(f"\nfloat (batch norm folded): {times[0]:.3f} ms; batch 1, 2 threads, interleaved")
        print("| budget | tool | kept float | drop | latency / float | seconds |\n|---|---|---|---:|---:|---:|")
        for row, ms in zip(rows, times[1:], strict=True):
            row["latency_over_float"] = ms / times[0]
            kept = (f"{row['family']} {row['kept_float']} of {row['of']}" if row["tool"] == "requant"
                    else f"{row['quantize_linear_left']} QuantizeLinear left")  # fmt: skip
            print(f"| {row['budget']} | {row['tool']} | {kept} | {row['drop']:.3f} | {ms / times[0]:.2f} "
                  f"| {row['seconds']:.0f} |")  # fmt: skip
        if args.json:
            kept_rows = [{k: v for k, v in r.items() if k != "path"} for r in rows]
            Path(args.json).write_text(json.dumps(kept_rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
