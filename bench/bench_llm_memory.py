"""requant's language-model flow on a decoder larger than the memory the process may take: the model is
processed a section (a decoder layer) at a time, so the quantization's memory is one section's, not the
model's.

Model: a synthetic Llama (random weights, ``torch.manual_seed(0)``; by default hidden 1536, MLP 4096, 24 layers,
16 heads, vocabulary 512, tied embedding: 2.7 GB of float32), exported by onnxruntime-genai's builder (float32, CPU), with
the tests' byte-level tokenizer (trained on requant's docs). Its perplexity means nothing: memory and time are
what is measured.

``requant quantize`` runs in a child process whose data segment (``RLIMIT_DATA``: heap and anonymous memory; not
the model's weights memory-mapped read-only from its file) is limited to ``--limit`` MB, less than the model:
it must finish, and its peak resident memory (``ru_maxrss``, which also counts the mapped weights' pages while
they are resident) is printed beside the model's size. What the flow before sections held at once (every
layer's input moments, ``K^2`` float64 each) is printed as well.

    .venv/bin/python bench/bench_llm_memory.py [--limit 2000] [--layers 24] [--hidden 1536] [--mlp 4096]
                                               [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).parent / "results" / "bench_llm_memory.json"


# the CLI in the limited child, which prints a line as each section is done (its data segment then, MB) and its
# own peak resident memory (kB) last
_CHILD = """import re, resource, runpy, sys, time
import requant.stages.blocks as blocks
started = time.perf_counter()

def progress(label, total, unit):
    def line(done, seconds):
        data = re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
        wall = time.perf_counter() - started
        print(f"section {done} of {total} at {wall:.0f} s: data {int(data) >> 10} MB", file=sys.stderr, flush=True)
    return line

blocks.terminal_progress = progress
sys.argv = ["requant", *sys.argv[1:]]
try:
    runpy.run_module("requant", run_name="__main__")
finally:
    print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _limited(limit_mb: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit_mb << 20, limit_mb << 20))

    return apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=2000, help="the child's RLIMIT_DATA, MB")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--mlp", type=int, default=4096)
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--model", help="a folder where the synthetic decoder is made once and kept")
    args = parser.parse_args()
    from tests.models.tiny_decoder import docs_text, make_random_decoder

    from requant.llm.decoder import model_bytes, open_decoder
    from requant.llm.nbits import linear_weights

    with tempfile.TemporaryDirectory(prefix="requant-memory-") as scratch:
        root = Path(scratch)
        kept = Path(args.model) if args.model else None
        folder = (
            kept / "genai"
            if kept and (kept / "genai").is_dir()
            else make_random_decoder(kept or root, args.layers, args.hidden, args.mlp)
        )
        decoder = open_decoder(folder)
        size = model_bytes(decoder.path)
        values = {str(node.inputs[0].name): node.inputs[1].const_value.shape[0]  # type: ignore[union-attr]
                  for node, _ in linear_weights(decoder.model.graph).values()}  # fmt: skip
        all_moments = sum(8 * k * k for k in values.values())
        names = [str(node.name) for node, _ in linear_weights(decoder.model.graph).values()]
        layers = len({name.split("layers.")[1].split("/")[0] for name in names if "layers." in name})
        calib = root / "calib.txt"
        calib.write_text(docs_text()[0])
        cli = ["quantize", str(folder), "-o", str(root / "out"), "--calib", str(calib), "--preset",
               "INT4_BLOCKWISE_WEIGHTS", "--block-size", "128", "--no-measure", "--report-json",
               str(root / "report.json")]  # fmt: skip
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", _CHILD, *cli], preexec_fn=_limited(args.limit),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        said, sections = [], []
        for line in child.stderr or ():
            said.append(line.rstrip("\n"))
            if line.startswith("section "):
                print(line.rstrip(), flush=True)
                sections.append(int(line.split()[-2]))
        returncode = child.wait()
        seconds = time.perf_counter() - started
        peaks = [line.split()[-1] for line in said if line.startswith("peak ")]
        peak = int(peaks[-1]) * 1024 if peaks else 0
        report = json.loads((root / "report.json").read_text()) if returncode == 0 else {}
    result = {"model_bytes": size, "layers": layers, "limit_bytes": args.limit << 20, "exit": returncode,
              "data_mb_after_each_section": sections,
              "seconds": seconds, "peak_rss_bytes": peak, "all_moments_bytes": all_moments,
              "quantized_bytes": report.get("llm", {}).get("size", {}).get("quantized_bytes"),
              "check": report.get("outputs", {}).get("ratio"), "steps": report.get("llm", {}).get("seconds")}  # fmt: skip
    print(f"model {size / 1e6:.0f} MB float32 ({layers} layers), RLIMIT_DATA {args.limit} MB: exit "
          f"{returncode} in {seconds:.0f} s, peak resident {peak / 1e6:.0f} MB; every layer's moments at once "
          f"(the flow before sections) {all_moments / 1e6:.0f} MB")  # fmt: skip
    if returncode != 0:
        print("\n".join(line for line in said[-12:] if not line.startswith(("peak ", "section "))))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
