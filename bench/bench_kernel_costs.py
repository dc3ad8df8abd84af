"""What a kernel costs in ONNX Runtime in float and in int8, and what keeping one float between int8 kernels costs.

The numbers behind the kernel part of ``requant.targets.costs`` (``KernelCost``), which the accuracy
budget uses to choose, among the sets of kernels kept float that meet a budget, the one modelled
fastest (docs/accuracy.md). For each kernel class (pointwise, depthwise 3x3 and dense 3x3 convs, a
linear layer) chains ``x -> kernel -> Relu -> kernel -> Relu ...`` of ``SHORT`` and ``LONG`` kernels
are built at a small and a large size and run three ways: float; quantized by requant (minmax, no
bias correction, no equalization: every kernel int8, as ONNX Runtime fuses requant's QDQ); and
quantized with every other kernel kept float (``int8, float, int8, ..., int8``: each float kernel
between two int8 ones, with the conversions, NHWC transposes and NCHWc reorders that brings). All
chains run interleaved in one process (2 threads, batch 1; ``requant.report.latency``); a kernel's
cost is ``(long - short) / (LONG - SHORT)``, which cancels the session's own overhead. The
boundary is what a float kernel between int8 ones costs beyond its float cost and the int8 cost it
replaces; chains of ``LONG`` int8 kernels with only the first or only the last one float split it into
its output's crossing (float to int8: measured about nothing) and its input's (int8 to float: nearly
all of it, the conversion and ONNX Runtime's reorders into its float kernel's layout).

    .venv/bin/python bench/bench_kernel_costs.py [--rounds 30] [--json FILE]
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_kernel_costs.py   # AVX2 kernels (bench/ort_without_vnni.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

SHORT, LONG = 3, 11  # int8, float, int8 / int8, float, ..., int8: 1 and 5 float kernels between int8 ones
# class -> two (channels, height = width) sizes; a linear layer's are (features, tokens)
CASES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "pointwise": ((64, 14), (64, 56)),
    "depthwise": ((64, 14), (64, 56)),
    "dense3x3": ((32, 14), (32, 56)),
    "linear": ((384, 16), (384, 128)),
}


def chain(kind: str, count: int, channels: int, size: int, seed: int = 0) -> onnx.ModelProto:
    """``count`` kernels of ``kind`` with a Relu after each but the last; random weights (He scale)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i in range(count):
        if kind == "linear":
            w = (rng.standard_normal((channels, channels)) * np.sqrt(2 / channels)).astype(np.float32)
            inits += [
                numpy_helper.from_array(w, f"w{i}"),
                numpy_helper.from_array(np.zeros(channels, np.float32), f"b{i}"),
            ]
            nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"k{i}"),
                      helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"], name=f"bias{i}")]  # fmt: skip
        else:
            group = channels if kind == "depthwise" else 1
            k = 1 if kind == "pointwise" else 3
            fan_in = channels // group * k * k
            w = (rng.standard_normal((channels, channels // group, k, k)) * np.sqrt(2 / fan_in)).astype(np.float32)
            inits += [
                numpy_helper.from_array(w, f"w{i}"),
                numpy_helper.from_array(np.zeros(channels, np.float32), f"b{i}"),
            ]
            pads = [k // 2] * 4
            nodes.append(
                helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"y{i}"], name=f"k{i}", group=group, pads=pads)
            )
        x = f"y{i}"
        if i < count - 1:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"], name=f"relu{i}"))
            x = f"r{i}"
    shape = [1, size, channels] if kind == "linear" else [1, channels, size, size]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def quantized(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], floats: list[str]) -> onnx.ModelProto:
    import onnx_ir as ir

    from requant.api import quantize
    from requant.quantizers import Quantizer

    quantizer = Quantizer().set_global_by_model().with_float_nodes(floats) if floats else None
    q = quantize(model, samples, quantizer=quantizer, method="minmax", measure=False, bias_correction=False,
                 smoothing=None, equalization=False, progress=lambda done, total: None)  # fmt: skip
    return ir.serde.serialize_model(q.model)


def elements(kind: str, channels: int, size: int) -> tuple[int, int]:
    """A kernel's multiply-adds and its output's elements."""
    out = channels * size if kind == "linear" else channels * size * size
    per = {"pointwise": channels, "depthwise": 9, "dense3x3": 9 * channels, "linear": channels}[kind]
    return out * per, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("--kinds", help="only these classes, comma-separated")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    onnxruntime.set_global_thread_pool_sizes(2, 1)
    from requant.report.latency import interleaved_latency_ms

    print(f"onnxruntime {onnxruntime.__version__} from {Path(onnxruntime.__file__).parent}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, sizes in CASES.items():
            if args.kinds and kind not in args.kinds.split(","):
                continue
            for channels, size in sizes:
                shape = [1, size, channels] if kind == "linear" else [1, channels, size, size]
                rng = np.random.default_rng(1)
                samples = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(8)]
                sessions, keys = [], []
                for count in (SHORT, LONG):
                    model = chain(kind, count, channels, size)
                    ways = [
                        ("float", model),
                        ("int8", quantized(model, samples, [])),
                        ("mixed", quantized(model, samples, [f"k{i}" for i in range(1, count, 2)])),
                    ]
                    if count == LONG:  # one float kernel: the first (only its output crosses) or the last
                        ways += [("first", quantized(model, samples, ["k0"])),
                                 ("last", quantized(model, samples, [f"k{count - 1}"]))]  # fmt: skip
                    for way, proto in ways:
                        options = onnxruntime.SessionOptions()
                        options.log_severity_level = 3
                        options.use_per_session_threads = False
                        path = Path(tmp) / f"{kind}.{way}.{count}.onnx"
                        onnx.save(proto, path)
                        sessions.append(
                            onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                        )
                        keys.append((way, count))
                ms = dict(
                    zip(
                        keys,
                        interleaved_latency_ms(sessions, samples[0], 0.0, 10.0, args.rounds, args.rounds),
                        strict=True,
                    )
                )
                per = {w: (ms[(w, LONG)] - ms[(w, SHORT)]) * 1e3 / (LONG - SHORT) for w in ("float", "int8")}
                pairs = (LONG - SHORT) // 2  # each adds one float and one int8 kernel to the mixed chain
                boundary = (ms[("mixed", LONG)] - ms[("mixed", SHORT)]) * 1e3 / pairs - per["float"] - per["int8"]
                macs, out = elements(kind, channels, size)
                swap = per["float"] - per["int8"]  # one kernel float instead of int8
                crossing = {side: (ms[(side, LONG)] - ms[("int8", LONG)]) * 1e3 - swap for side in ("first", "last")}
                row = {"macs": macs, "elements": out, "float_us": per["float"], "int8_us": per["int8"],
                       "boundary_us": boundary, "boundary_ns_per_element": boundary * 1e3 / (2 * out),
                       "output_crossing_us": crossing["first"], "input_crossing_us": crossing["last"]}  # fmt: skip
                results.setdefault(kind, []).append(row)
                print(f"{kind:10} {channels:4}x{size:<4} MACs {macs / 1e6:7.2f}M  float {per['float']:8.1f} us  "
                      f"int8 {per['int8']:8.1f} us ({per['int8'] / per['float']:.2f})  boundary {boundary:7.1f} us "
                      f"({row['boundary_ns_per_element']:.3f} ns/element in+out); output alone "
                      f"{crossing['first']:.1f} us, input alone {crossing['last']:.1f} us", flush=True)  # fmt: skip
    print(
        f"{'class':10} {'float ns/MAC':>13} {'fixed us':>9} {'int8 ns/MAC':>12} {'fixed us':>9} {'input crossing ns/el':>21} {'fixed us':>9}"
    )
    for kind, (small, large) in results.items():
        fit = {}
        for way in ("float", "int8"):
            per = (large[f"{way}_us"] - small[f"{way}_us"]) / (large["macs"] - small["macs"]) * 1e3
            fit[way] = (per, small[f"{way}_us"] - per * small["macs"] / 1e3)
        # the input: as many elements as the output in these chains
        per = (large["input_crossing_us"] - small["input_crossing_us"]) / (large["elements"] - small["elements"]) * 1e3
        fit["input_crossing"] = (per, small["input_crossing_us"] - per * small["elements"] / 1e3)
        results[kind] = {"sizes": [small, large], **fit}
        print(f"{kind:10} {fit['float'][0]:13.4f} {fit['float'][1]:9.2f} {fit['int8'][0]:12.4f} {fit['int8'][1]:9.2f} "
              f"{fit['input_crossing'][0]:21.3f} {fit['input_crossing'][1]:9.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
