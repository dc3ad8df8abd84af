"""Smoothing's alpha on the executorch-xnnpack target: all-MiniLM-L6-v2 quantized with each alpha (0: off),
its ``.pte``'s embeddings compared with the float model's (128 calibration sentences, 256 others); the
target's default (0.5) comes from this sweep::

    .venv/bin/python bench/try_pt2e_smoothing.py --alphas 0,0.3,0.5,0.65,0.8
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alphas", default="0,0.5,0.8")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from bench.bench_executorch import _model, _renamed, quality

    import requant
    from requant.backends.executorch import ModuleSession, PteSession
    from requant.stages.pt2e import signature

    torch.set_num_threads(2)
    net, example, samples = _model("minilm", 128 + 256)
    names, _ = signature(torch.export.export(net, example))
    samples = _renamed(samples, names)
    calib, evals = samples[:128], samples[128:]
    eager = ModuleSession(net, names)
    reference = [eager.run(None, s)[0] for s in evals]
    for alpha in args.alphas.split(","):
        started = time.perf_counter()
        result = requant.quantize(net, calib, target="executorch-xnnpack", example_inputs=example, measure=False,
                                  smoothing=float(alpha))  # fmt: skip
        pte = PteSession(result.pte or b"", names)
        row = quality(reference, [pte.run(None, x)[0] for x in evals], classifier=False)
        smoothed = sum(1 for r in result.report["smoothing"]["inputs"] if r["applied"])
        print(f"alpha {alpha:5s} cosine {row['cosine']:.5f} SQNR {row['sqnr_db']:.1f} dB, {smoothed} inputs smoothed "
              f"({time.perf_counter() - started:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
