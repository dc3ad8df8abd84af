"""A decomposition of the ``onnxruntime-cpu`` target against none: latency and SQNR, in context.

For each case, ``x -> Conv 1x1 -> <op> -> Conv 1x1 -> y`` (random weights, ``bench_placement``'s
models) is quantized by requant's defaults with the target as it is and with one decomposition taken
out of its table; the float model and both int8 models run interleaved in one process (2 threads,
batch 1), and each int8 model's output SQNR against float is measured on 16 random inputs.

    .venv/bin/python bench/bench_decompose.py [--rounds 30]
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_decompose.py   # AVX2 kernels (bench/ort_without_vnni.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

sys.path.insert(0, str(Path(__file__).parent))

# (case, the op between the convs reading c and writing a, channels, height = width)
CASES = (
    ("AveragePool 3x3, padded", "a = AveragePool<kernel_shape=[3,3], pads=[1,1,1,1], count_include_pad=1>(c)", 64, 56),
    ("AveragePool 2x2 stride 2", "a = AveragePool<kernel_shape=[2,2], strides=[2,2]>(c)", 128, 56),
    ("AveragePool 3x3, padded", "a = AveragePool<kernel_shape=[3,3], pads=[1,1,1,1], count_include_pad=1>(c)", 256, 13),
)


def main() -> None:
    arguments = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments.add_argument("--rounds", type=int, default=30)
    args = arguments.parse_args()
    onnxruntime.set_global_thread_pool_sizes(2, 1)
    import requant
    from bench_placement import between_convs
    from bench_quantize import interleaved_latency, outputs
    from requant.targets import registry
    from requant.targets.decompose import AVERAGE_POOL_AS_DEPTHWISE

    target = registry.TARGETS["onnxruntime-cpu"]
    without = dataclasses.replace(
        target.table, decompositions=tuple(d for d in target.table.decompositions if d is not AVERAGE_POOL_AS_DEPTHWISE)
    )
    print(f"onnxruntime {onnxruntime.__version__} from {Path(onnxruntime.__file__).parent}; 2 threads, batch 1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, body, channels, size in CASES:
            source = folder / "float.onnx"
            onnx.save(between_convs(body, channels, size), source)
            data = [
                {"x": np.random.default_rng(i).standard_normal((1, channels, size, size)).astype(np.float32)}
                for i in range(16)
            ]
            paths = [source, folder / "without.onnx", folder / "with.onnx"]
            registry.TARGETS["onnxruntime-cpu"] = dataclasses.replace(target, table=without)
            requant.quantize(str(source), data, measure=False).save(paths[1])
            registry.TARGETS["onnxruntime-cpu"] = target
            requant.quantize(str(source), data, measure=False).save(paths[2])
            ms = interleaved_latency(paths, data[0], args.rounds)
            f = outputs(paths[0], data)
            sqnr = [10 * np.log10((f**2).sum() / ((f - outputs(p, data)) ** 2).sum()) for p in paths[1:]]
            print(
                f"{name} on {channels}x{size}x{size}: float {ms[0]:.3f} ms; QLinearAveragePool {ms[1]:.3f} ms "
                f"({sqnr[0]:.1f} dB); depthwise conv {ms[2]:.3f} ms ({sqnr[1]:.1f} dB)"
            )


if __name__ == "__main__":
    main()
