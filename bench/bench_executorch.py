"""requant against ExecuTorch's own ``XNNPACKQuantizer`` on the ``executorch-xnnpack`` target: same models, same
data, same machine, one process.

For each model: calibration and evaluation samples (disjoint: the bench's photo crops for the classifiers,
its docstring sentences padded to 64 tokens for MiniLM); then

- "xnnpack": ExecuTorch's flow as its docs give it: ``torch.export``, ``prepare_pt2e`` with
  ``XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))``, the
  calibration samples, ``convert_pt2e``, ``to_edge_transform_and_lower`` with ``XnnpackPartitioner``,
  ``to_executorch``;
- "requant": ``requant.quantize(model, samples, target="executorch-xnnpack", measure=False)`` (its
  defaults: method auto; every check of the ``.pte`` it writes included in its time);

each timed (wall seconds, this process; the two tools alternate ``--repeats`` times, 2 by default, and the
fastest run of each is compared: after the float program's own lowering has warmed export and lowering up);
both ``.pte`` and the float model's ``.pte`` are then run by
ExecuTorch's runtime on the evaluation samples: top-1 agreement with the float model (eager PyTorch), KL
divergence of the softmax (classifiers), cosine and SQNR of the first output; and timed interleaved
(batch 1: alternating blocks of runs of every ``.pte``, medians; ``requant.report.latency``).

    .venv/bin/python bench/bench_executorch.py [--models mobilenet_v2,efficientnet_lite0,minilm]
                                               [--calib 128] [--eval 256] [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results" / "bench_executorch.json"


def _model(name: str, count: int) -> tuple[Any, tuple[Any, ...], list[dict[str, np.ndarray]]]:
    import torch
    from bench.bench_quantize import crops, sentences

    if name == "minilm":
        from tests.models.minilm import make_minilm, tokenize

        ids, mask = tokenize(sentences(count))
        samples = [{"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]} for i in range(count)]
        return make_minilm().eval(), (torch.from_numpy(ids[:1]), torch.from_numpy(mask[:1])), samples
    from tests.models.efficientnet import make_efficientnet_lite0
    from tests.models.mobilenet import make_mobilenet_v2

    net = {"mobilenet_v2": make_mobilenet_v2, "efficientnet_lite0": make_efficientnet_lite0}[name]().eval()
    images = np.ascontiguousarray(crops(count, seed=3))
    return net, (torch.from_numpy(images[:1]),), [{"x": images[i : i + 1]} for i in range(count)]


def _renamed(samples: list[dict[str, np.ndarray]], names: list[str]) -> list[dict[str, np.ndarray]]:
    return [dict(zip(names, s.values(), strict=True)) for s in samples]


def xnnpack_flow(net: Any, example: tuple[Any, ...], calib: list[dict[str, np.ndarray]]) -> bytes:
    import torch
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from requant.backends.executorch import lower_to_pte

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(torch.export.export(net, example).module(), quantizer)
    with torch.no_grad():
        for sample in calib:
            prepared(*[torch.from_numpy(np.ascontiguousarray(a)) for a in sample.values()])
    converted = convert_pt2e(prepared)
    return lower_to_pte(torch.export.export(converted, example)).pte


def quality(float_outs: list[np.ndarray], outs: list[np.ndarray], classifier: bool) -> dict[str, float]:
    f = np.concatenate(float_outs).reshape(len(float_outs), -1).astype(np.float64)
    q = np.concatenate(outs).reshape(len(outs), -1).astype(np.float64)
    cos = np.einsum("ij,ij->i", f, q) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1) + 1e-12)
    row = {"top1_agreement": float(np.mean(f.argmax(1) == q.argmax(1))), "cosine": float(cos.mean()),
           "sqnr_db": float(10 * np.log10((f**2).sum() / ((f - q) ** 2).sum()))}  # fmt: skip
    if classifier:
        pf = np.exp(f - f.max(1, keepdims=True))
        pf /= pf.sum(1, keepdims=True)
        pq = np.exp(q - q.max(1, keepdims=True))
        pq /= pq.sum(1, keepdims=True)
        row["kl"] = float(np.mean(np.sum(pf * (np.log(pf + 1e-12) - np.log(pq + 1e-12)), axis=1)))
    return row


def bench_model(name: str, calib_count: int, eval_count: int, repeats: int = 2) -> dict[str, Any]:
    import torch

    import requant
    from requant.backends.executorch import ModuleSession, PteSession, lower_to_pte
    from requant.report.latency import interleaved_latency_ms
    from requant.stages.pt2e import signature

    net, example, samples = _model(name, calib_count + eval_count)
    names, _ = signature(torch.export.export(net, example))
    samples = _renamed(samples, names)
    calib, evals = samples[:calib_count], samples[calib_count:]
    # the float program lowered first: export and lowering warmed up (their first call's setup, seconds) before
    # either tool is timed, not inside the first one's time
    float_pte = lower_to_pte(torch.export.export(net, example)).pte
    times: dict[str, list[float]] = {"xnnpack": [], "requant": []}
    for _ in range(repeats):  # alternating, as latency is measured: this machine's load moves between runs
        started = time.perf_counter()
        peer = xnnpack_flow(net, example, calib)
        times["xnnpack"].append(time.perf_counter() - started)
        started = time.perf_counter()
        ours = requant.quantize(net, calib, target="executorch-xnnpack", example_inputs=example, measure=False)
        times["requant"].append(time.perf_counter() - started)
    peer_s, ours_s = min(times["xnnpack"]), min(times["requant"])
    eager = ModuleSession(net, names)
    sessions = {"float": PteSession(float_pte, names), "xnnpack": PteSession(peer, names),
                "requant": PteSession(ours.pte or b"", names)}  # fmt: skip
    reference = [eager.run(None, s)[0] for s in evals]
    rows: dict[str, Any] = {}
    for tool, s in sessions.items():
        rows[tool] = quality(reference, [s.run(None, x)[0] for x in evals], classifier=name != "minilm")
        rows[tool]["pte_bytes"] = len(s.pte)
    latency = interleaved_latency_ms(list(sessions.values()), evals[0], budget_s=6.0, max_rounds=60)
    for tool, ms in zip(sessions, latency, strict=True):
        rows[tool]["latency_ms"] = ms
        rows[tool]["latency_vs_float"] = ms / latency[0]
    rows["xnnpack"]["quantize_s"], rows["requant"]["quantize_s"] = peer_s, ours_s
    rows["xnnpack"]["quantize_runs_s"], rows["requant"]["quantize_runs_s"] = times["xnnpack"], times["requant"]
    rows["requant"]["method"] = ours.report.get("method_choice", {}).get("chosen")
    rows["requant"]["coverage"] = ours.report["executorch"]["coverage"]
    return {"calibration": calib_count, "evaluation": eval_count, "tools": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mobilenet_v2,efficientnet_lite0,minilm")
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--eval", type=int, default=256)
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--repeats", type=int, default=2, help="times each tool quantizes, alternating (the "
                        "fastest of each is compared)")  # fmt: skip
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(2)
    results = {"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "models": {}}  # fmt: skip
    for name in args.models.split(","):
        results["models"][name] = row = bench_model(name, args.calib, args.eval, args.repeats)
        print(f"\n{name} ({args.calib} calibration, {args.eval} evaluation samples)")
        for tool, r in row["tools"].items():
            extra = f" KL {r['kl']:.4f}" if "kl" in r else ""
            took = f" quantize {r['quantize_s']:.1f} s" if "quantize_s" in r else ""
            print(f"  {tool:8s} top-1 {r['top1_agreement']:.4f} cosine {r['cosine']:.5f} SQNR {r['sqnr_db']:.1f} dB"
                  f"{extra} latency {r['latency_ms']:.2f} ms ({r['latency_vs_float']:.2f}x float){took}")  # fmt: skip
        t = row["tools"]
        print(f"  requant / xnnpack: latency {t['requant']['latency_ms'] / t['xnnpack']['latency_ms']:.3f}x, "
              f"quantize time {t['requant']['quantize_s'] / t['xnnpack']['quantize_s']:.2f}x")  # fmt: skip
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
