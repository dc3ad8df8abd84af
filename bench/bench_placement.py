"""Where int8 should end: ops between two int8 convs, run in int8 and kept float, measured in context.

For each case, ``x -> Conv 1x1 -> <ops> -> Conv 1x1 -> y`` (random weights) is quantized by requant
twice: with the ops in int8 as the quantizers annotate them, and with them kept float
(``FLOAT_PLACED``, what placement does); both without the target's cost model, minmax, no bias
correction. ONNX Runtime's optimized graph says whether the float ops stayed float (it fuses a lone
``DequantizeLinear -> op -> QuantizeLinear`` into its int8 op whatever requant writes). Latency is
interleaved in one process (2 threads, batch 1). Printed beside it: what requant's cost model
(``requant.targets.costs``) predicts for the same group, so the model can be checked against ONNX
Runtime in context: the conversions, the NHWC transposes and NCHWc reorders that a float op between
int8 convs brings.

    .venv/bin/python bench/bench_placement.py [--rounds 30] [--json FILE]
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_placement.py   # AVX2 kernels (bench/ort_without_vnni.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper, parser

sys.path.insert(0, str(Path(__file__).parent))

CASES: dict[str, str] = {  # name -> the ops between the convs, reading c, writing a (ONNX text)
    "Sigmoid": "a = Sigmoid(c)",
    "SiLU": "s = Sigmoid(c)\n a = Mul(c, s)",
    "LeakyRelu": "a = LeakyRelu<alpha=0.1>(c)",
    "Softmax (channels)": "a = Softmax<axis=1>(c)",
    "AveragePool 3x3": "a = AveragePool<kernel_shape=[3,3], pads=[1,1,1,1]>(c)",
    "MaxPool 3x3": "a = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(c)",
    "MaxPool 5x5": "a = MaxPool<kernel_shape=[5,5], pads=[2,2,2,2]>(c)",
    "MaxPool 13x13": "a = MaxPool<kernel_shape=[13,13], pads=[6,6,6,6]>(c)",
    "Sigmoid, Tanh, Sigmoid": "s = Sigmoid(c)\n t = Tanh(s)\n a = Sigmoid(t)",
    "Tanh, Sigmoid, Tanh": "t = Tanh(c)\n s = Sigmoid(t)\n a = Tanh(s)",
    "Tanh, Add 1, Tanh": "t = Tanh(c)\n one = Constant<value = float {1.0}>()\n s = Add(t, one)\n a = Tanh(s)",
}
SHAPES = ((64, 56), (256, 13))  # channels, height = width


def between_convs(body: str, channels: int, size: int, weight_scale: float = 0.1) -> onnx.ModelProto:
    """``x -> Conv 1x1 -> <body: ONNX text reading c, writing a> -> Conv 1x1 -> y``, random weights
    (standard normal times ``weight_scale``), nodes named ``n<index>_<op>``."""
    c, h = channels, size
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,{c},{h},{h}] x) => (float[1,{c},{h},{h}] y)
      <float[{c},{c},1,1] w1, float[{c}] b1, float[{c},{c},1,1] w2, float[{c}] b2> {{
      c = Conv(x, w1, b1)
      {body}
      y = Conv(a, w2, b2)
    }}"""
    model = parser.parse_model(text)
    rng = np.random.default_rng(0)
    for name, shape in (("w1", (c, c, 1, 1)), ("b1", (c,)), ("w2", (c, c, 1, 1)), ("b2", (c,))):
        weights = (rng.standard_normal(shape) * weight_scale).astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(weights, name))
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}_{node.op_type}"
    return model


def _fused(path: Path, folder: Path) -> list[str]:
    """The op types of ONNX Runtime's optimized graph of ``path``."""
    from bench_op_costs import _session

    return _session(onnx.load(path), folder, "placed")[1]


def main() -> None:
    arguments = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments.add_argument("--rounds", type=int, default=30)
    arguments.add_argument("--json")
    arguments.add_argument("--cases", help="only these cases, separated by semicolons")
    args = arguments.parse_args()
    onnxruntime.set_global_thread_pool_sizes(2, 1)
    import requant
    from bench_quantize import interleaved_latency
    from requant.quantizers import Quantizer
    from requant.quantizers.quantizer import FLOAT_PLACED
    from requant.targets import registry

    target = registry.TARGETS["onnxruntime-cpu"]
    registry.TARGETS["onnxruntime-cpu"] = dataclasses.replace(target, costs=None)  # as the quantizers annotate
    print(f"onnxruntime {onnxruntime.__version__} from {Path(onnxruntime.__file__).parent}; 2 threads, batch 1")
    print(f"{'case':26} {'shape':>12} {'int8 ms':>8} {'float ms':>8} {'measured':>9} {'modelled':>9}  ONNX Runtime")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for channels, size in SHAPES:
            for name, body in CASES.items():
                if args.cases and name not in args.cases.split(";"):
                    continue
                model = between_convs(body, channels, size)
                source = folder / "model.onnx"
                onnx.save(model, source)
                data = [{"x": np.random.default_rng(i).standard_normal((1, channels, size, size)).astype(np.float32)}
                        for i in range(4)]  # fmt: skip
                ops = [n.name for n in model.graph.node if n.op_type not in ("Conv", "Constant")]
                as_int8 = requant.quantize(str(source), data, method="minmax", bias_correction=False, measure=False)
                placed = Quantizer().set_global_by_model().with_float_nodes(ops, FLOAT_PLACED)
                as_float = requant.quantize(str(source), data, quantizer=placed, method="minmax",
                                            bias_correction=False, measure=False)  # fmt: skip
                paths = [folder / "int8.onnx", folder / "float.onnx"]
                as_int8.save(paths[0])
                as_float.save(paths[1])
                kinds = _fused(paths[1], folder)
                kept = [k for k in kinds if k in {n.op_type for n in model.graph.node if n.op_type != "Conv"}]
                fused = "float ops kept" if kept else "re-fused into int8"
                int8_ms, float_ms = interleaved_latency(paths, data[0], args.rounds)
                predicted = _predicted(model, data, target)
                shape = f"{channels}x{size}x{size}"
                print(f"{name:26} {shape:>12} {int8_ms:8.3f} {float_ms:8.3f} {1e3 * (float_ms - int8_ms):+8.1f}u "
                      f"{predicted:+8.1f}u  {fused}")  # fmt: skip
                results.append({"case": name, "shape": shape, "int8_ms": int8_ms, "float_ms": float_ms,
                                "modelled_float_minus_int8_us": predicted, "onnxruntime": fused})  # fmt: skip
    registry.TARGETS["onnxruntime-cpu"] = target
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _predicted(model: onnx.ModelProto, data: list[dict[str, np.ndarray]], target: Any) -> float:
    """The cost model's float-minus-int8 microseconds for the case's groups (summed)."""
    from requant.quantizers import Quantizer
    from requant.quantizers.placement import place
    from requant.stages.annotate import annotate
    from requant.targets.registry import get_target

    chosen = get_target("onnxruntime-cpu")
    annotated = annotate(model, Quantizer().set_global_by_model(), chosen, False, None, None, {}).model
    return sum((p.float_us or 0.0) - (p.int8_us or 0.0) for p in place(annotated, target.costs))


if __name__ == "__main__":
    main()
