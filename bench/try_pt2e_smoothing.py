"""SmoothQuant by hand before the executorch-xnnpack target: does smoothing help its linear layers?

Each ``nn.Linear`` of all-MiniLM-L6-v2 reads ``x / s`` with its weight's columns times ``s``
(``s_k = max|x_k| ** alpha / max|W_k| ** (1 - alpha)``, ``max|x_k|`` over 64 calibration sentences): the float
model computes the same. Both models are quantized with requant's defaults for the target (128 sentences)
and their ``.pte`` compared with the float model on 256 others. The PT2E path does not smooth yet
(docs/targets.md); this measures what it would gain::

    .venv/bin/python bench/try_pt2e_smoothing.py --alphas 0.5,0.8
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Smoothed:
    """Builds ``lin(x / s)`` modules (a class made once torch is imported)."""

    @staticmethod
    def wrap(lin: Any, s: Any) -> Any:
        import torch

        class _Smoothed(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = lin
                self.register_buffer("s", s)

            def forward(self, x: Any) -> Any:
                return self.lin(x / self.s)

        return _Smoothed()


def input_maxima(net: Any, session: Any, samples: list[dict[str, Any]]) -> dict[Any, Any]:
    import torch

    maxima: dict[Any, Any] = {}

    def hook(module: Any, args: Any, _out: Any) -> None:
        m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
        maxima[module] = torch.maximum(maxima[module], m) if module in maxima else m

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, torch.nn.Linear)]
    for sample in samples:
        session.run(None, sample)
    for handle in handles:
        handle.remove()
    return maxima


def smoothed(net: Any, maxima: dict[Any, Any], alpha: float) -> Any:
    import torch

    copied = copy.deepcopy(net)

    def replace(parent: Any, original: Any) -> None:
        for name, child in list(parent.named_children()):
            source = getattr(original, name)
            if isinstance(child, torch.nn.Linear) and source in maxima:
                x = maxima[source].clamp(min=1e-5)
                w = child.weight.detach().abs().amax(0).clamp(min=1e-5)
                s = (x**alpha / w ** (1 - alpha)).clamp(min=1e-5)
                with torch.no_grad():
                    child.weight.mul_(s)
                setattr(parent, name, Smoothed.wrap(child, s))
            else:
                replace(child, source)

    replace(copied, net)
    return copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alphas", default="0.5,0.8")
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
    maxima = input_maxima(net, eager, calib[:64])
    models = [("plain", net)] + [(f"alpha {a}", smoothed(net, maxima, float(a))) for a in args.alphas.split(",")]
    for label, model in models:
        started = time.perf_counter()
        result = requant.quantize(model, calib, target="executorch-xnnpack", example_inputs=example, measure=False)
        pte = PteSession(result.pte or b"", names)
        row = quality(reference, [pte.run(None, x)[0] for x in evals], classifier=False)
        print(f"{label:10s} cosine {row['cosine']:.5f} SQNR {row['sqnr_db']:.1f} dB "
              f"({time.perf_counter() - started:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
