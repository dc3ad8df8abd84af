"""Loading, canonicalizing and saving a large transformer, against plain ``onnx`` load and save.

Builds (once, in a temporary folder) a BERT-like encoder in ONNX with about 5,000 nodes and
300 MB of float32 weights in an external data file, the way exporters write them (LayerNorm and
GELU decomposed into small ops, weights transposed by MatMul, Identity and Dropout nodes left in).
Then, each in a fresh process so peak memory is its own:

- ``onnx``: ``onnx.load`` (external data read into memory) and ``onnx.save`` with external data;
- ``requant``: ``load_onnx`` (weights memory-mapped), the ``canonicalize`` pipeline, ``save_onnx``.

Prints wall time and peak resident memory of each, and the ratios.

    .venv/bin/python bench/bench_load.py [--layers 72] [--hidden 288]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(path: Path, layers: int, hidden: int, heads: int = 12) -> tuple[int, int]:
    """Write the model; returns (nodes, weight bytes)."""
    rng = np.random.default_rng(0)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    weight_bytes = 0

    def weight(name: str, *shape: int) -> str:
        nonlocal weight_bytes
        array = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        weight_bytes += array.nbytes
        inits.append(numpy_helper.from_array(array, name))
        return name

    def const(name: str, values: list[int] | list[float], dtype: int = TensorProto.INT64) -> str:
        nodes.append(
            helper.make_node(
                "Constant", [], [name], value=helper.make_tensor(name + "_v", dtype, [len(values)], values)
            )
        )
        return name

    def node(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def layer_norm(x: str, p: str) -> str:
        mean = node("ReduceMean", [x, const(p + "ax", [-1])], p + "mean")
        centered = node("Sub", [x, mean], p + "c")
        var = node("ReduceMean", [node("Mul", [centered, centered], p + "sq"), const(p + "ax2", [-1])], p + "var")
        std = node("Sqrt", [node("Add", [var, const(p + "eps", [1e-12], TensorProto.FLOAT)], p + "ve")], p + "std")
        normed = node("Div", [centered, std], p + "n")
        scaled = node("Mul", [normed, weight(p + "gamma", hidden)], p + "s")
        return node("Add", [scaled, weight(p + "beta", hidden)], p + "ln")

    def linear(x: str, p: str, cin: int, cout: int) -> str:
        # exporters store Linear weights as [out, in] and transpose them in the graph
        w_t = node("Transpose", [weight(p + "w", cout, cin)], p + "wt", perm=[1, 0])
        return node("Add", [node("MatMul", [x, w_t], p + "mm"), weight(p + "b", cout)], p + "out")

    def gelu(x: str, p: str) -> str:
        erf = node("Erf", [node("Div", [x, const(p + "r2", [1.4142135], TensorProto.FLOAT)], p + "d")], p + "erf")
        half = node("Mul", [x, const(p + "h", [0.5], TensorProto.FLOAT)], p + "half")
        return node("Mul", [half, node("Add", [erf, const(p + "one", [1.0], TensorProto.FLOAT)], p + "e1")], p + "g")

    head = hidden // heads
    x = node("Identity", ["X"], "x0")
    for i in range(layers):
        p = f"l{i}_"
        split_shape = const(p + "split", [0, 0, heads, head])
        qkv = []
        for name in "qkv":
            y = linear(x, p + name, hidden, hidden)
            y = node("Reshape", [y, split_shape], p + name + "r")
            qkv.append(node("Transpose", [y], p + name + "t", perm=[0, 2, 1, 3]))
        q, k, v = qkv
        kt = node("Transpose", [k], p + "k_T", perm=[0, 1, 3, 2])
        scores = node("Div", [node("MatMul", [q, kt], p + "qk"), const(p + "sc", [8.0], TensorProto.FLOAT)], p + "s")
        probs = node("Dropout", [node("Softmax", [scores], p + "sm", axis=-1)], p + "drop")
        ctx = node("Transpose", [node("MatMul", [probs, v], p + "ctx")], p + "ctxt", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, const(p + "merge", [0, 0, hidden])], p + "ctxr")
        x = layer_norm(node("Add", [x, linear(ctx, p + "o", hidden, hidden)], p + "res1"), p + "ln1")
        ffn = linear(gelu(linear(x, p + "up", hidden, 4 * hidden), p + "act"), p + "down", 4 * hidden, hidden)
        x = layer_norm(node("Add", [x, node("Identity", [ffn], p + "ffn")], p + "res2"), p + "ln2")
    nodes.append(helper.make_node("Identity", [x], ["Y"]))
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "sequence", hidden])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "sequence", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, path, save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return len(nodes), weight_bytes


CHILD = {
    "onnx": """
import onnx, sys
model = onnx.load(sys.argv[1])
onnx.save(model, sys.argv[2], save_as_external_data=True, location="out.onnx.data")
""",
    "requant": """
import sys
from requant.frontends import load_onnx, save_onnx
from requant.passes import get_passes, run_passes, PassOptions
model = load_onnx(sys.argv[1])
model, _ = run_passes(model, get_passes("canonicalize"), PassOptions(verify_each=False))
save_onnx(model, sys.argv[2])
""",
}
# Peak memory is VmHWM of the child's own address space: ru_maxrss would carry the parent's
# peak across fork and exec (the parent built a 300 MB model), as a first version of this
# benchmark found out. File pages of memory-mapped weights count once touched.
MEASURE = """
import json, sys, time
start = time.perf_counter()
exec(sys.argv.pop(1))
seconds = time.perf_counter() - start
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_mb": int(hwm.split()[1]) / 1024}))
"""


def measure(tool: str, source: Path, folder: Path) -> dict[str, float]:
    out = folder / tool
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, CHILD[tool], str(source), str(out / "out.onnx")],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{tool} failed:\n{result.stderr[-3000:]}")
    measured: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--hidden", type=int, default=288)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "encoder.onnx"
        start = time.perf_counter()
        count, weight_bytes = build(source, args.layers, args.hidden)
        print(
            f"model: {count:,} nodes, {weight_bytes / 1e6:.0f} MB of external weights "
            f"(built in {time.perf_counter() - start:.1f} s); python {sys.version.split()[0]}, "
            f"onnx {onnx.__version__}, {os.cpu_count()} cores"
        )
        rows = {tool: measure(tool, source, folder) for tool in ("onnx", "requant")}
        print(f"{'':<36} {'seconds':>8} {'peak MB':>9}")
        labels = {"onnx": "onnx: load + save", "requant": "requant: load + canonicalize + save"}
        for tool, label in labels.items():
            print(f"{label:<36} {rows[tool]['seconds']:>8.2f} {rows[tool]['peak_mb']:>9.0f}")
        print(
            f"ratio requant/onnx: time {rows['requant']['seconds'] / rows['onnx']['seconds']:.2f}, "
            f"peak memory {rows['requant']['peak_mb'] / rows['onnx']['peak_mb']:.2f}"
        )


if __name__ == "__main__":
    main()
