"""qcast / dcast throughput against ONNX Runtime's QuantizeLinear / DequantizeLinear.

Same data, same machine, one run: 64M float32 values, per-tensor and per-channel
(1024 channels on axis 0, like a weight tensor), uint8 / int8 storage. Prints the
best of ``--repeat`` runs for each, and requant's time as a ratio of ONNX Runtime's
(below 1.0 means requant is faster).

    .venv/bin/python bench/bench_casts.py [--values 67108864] [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from requant.types import UniformQuantizedPerAxisType, UniformQuantizedType, UniformType, dcast, qcast


def best_of(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def session(op: str, t: UniformType, shape: tuple[int, ...], threads: int) -> ort.InferenceSession:
    storage = {"u8": TensorProto.UINT8, "i8": TensorProto.INT8}[t.storage]
    if isinstance(t, UniformQuantizedType):
        scale, zp, attrs = np.array(t.scale, np.float32), np.array(t.zero_point), {}
    else:
        assert isinstance(t, UniformQuantizedPerAxisType)
        scale, zp, attrs = np.array(t.scales, np.float32), np.array(t.zero_points), {"axis": t.axis}
    in_type, out_type = (TensorProto.FLOAT, storage) if op == "QuantizeLinear" else (storage, TensorProto.FLOAT)
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "scale", "zp"], ["y"], **attrs)],
        "bench",
        [helper.make_tensor_value_info("x", in_type, list(shape))],
        [helper.make_tensor_value_info("y", out_type, list(shape))],
        [
            numpy_helper.from_array(scale, "scale"),
            helper.make_tensor("zp", storage, list(zp.shape), zp.ravel().tolist()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure(x: np.ndarray, t: UniformType, threads: int, repeat: int) -> list[tuple[str, float, float]]:
    """(op, requant seconds, ONNX Runtime seconds) for qcast and dcast, after checking they agree."""
    q_sess = session("QuantizeLinear", t, x.shape, threads)
    d_sess = session("DequantizeLinear", t, x.shape, threads)
    q = qcast(x, t)
    assert np.array_equal(q, q_sess.run(None, {"x": x})[0]), "qcast and QuantizeLinear disagree"
    assert np.array_equal(dcast(q, t), d_sess.run(None, {"x": q})[0]), "dcast and DequantizeLinear disagree"
    return [
        ("qcast", best_of(repeat, lambda: qcast(x, t)), best_of(repeat, lambda: q_sess.run(None, {"x": x}))),
        ("dcast", best_of(repeat, lambda: dcast(q, t)), best_of(repeat, lambda: d_sess.run(None, {"x": q}))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    args = parser.parse_args()

    channels = 1024
    shape = (channels, args.values // channels)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    cases: list[tuple[str, UniformType]] = [
        ("per-tensor u8", UniformQuantizedType("u8", "f32", float(np.float32(8 / 255)), 128)),
        (
            "per-channel i8",
            UniformQuantizedPerAxisType(
                "i8", "f32", 0, [float(s) for s in rng.uniform(0.01, 0.05, channels).astype(np.float32)]
            ),
        ),
    ]
    print(
        f"{x.size:,} float32 values {shape}; numpy {np.__version__}, onnxruntime {ort.__version__}, "
        f"onnx {onnx.__version__}; {os.cpu_count()} cores, {platform.machine()}; best of {args.repeat}; "
        f"ORT threads {args.threads}"
    )
    print(f"{'case':<16} {'op':<6} {'requant':>10} {'onnxruntime':>12} {'ratio':>7}   (ms; ratio = requant / ORT)")
    for name, t in cases:
        for op, ours, theirs in measure(x, t, args.threads, args.repeat):
            print(f"{name:<16} {op:<6} {ours * 1e3:>10.1f} {theirs * 1e3:>12.1f} {ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
