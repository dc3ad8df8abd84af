"""What one op costs in ONNX Runtime, in float and in int8, and what a QuantizeLinear / DequantizeLinear costs.

The numbers behind ``requant.targets.costs`` (the cost model that decides where int8 ends, see
docs/targets.md "Placement by modelled cost"). For each op, chains of ``SHORT`` and ``LONG`` copies
of it are built at a small and a large tensor size: in float (``x -> op -> op ...``; a binary op
reads the chain and the input) and in QDQ as requant writes it (``DequantizeLinear -> op ->
QuantizeLinear`` each, which ONNX Runtime fuses into its int8 op: the script checks the optimized
graph has the op it expects and no float copy left). The conversions are measured as chains of
``QuantizeLinear -> DequantizeLinear -> Neg`` against the same chain of ``Neg`` alone. All chains
run interleaved in one process on one thread pool (2 threads, batch 1; ``requant.report.latency``);
one op's cost is ``(long - short) / (LONG - SHORT)``, which cancels the session's own overhead, and
costs at the two sizes give a fixed part (microseconds) and a part per element (nanoseconds).

    .venv/bin/python bench/bench_op_costs.py [--rounds 30] [--json FILE]
    PYTHONPATH=/tmp/ort-avx2 .venv/bin/python bench/bench_op_costs.py   # AVX2 kernels (bench/ort_without_vnni.py)

Prints a table for ``requant/targets/costs.py``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

SHORT, LONG = 2, 10
NHWC = ("MaxPool", "AveragePool")  # int8: as ONNX Runtime runs them next to int8 convs (_nhwc_chain)
SIZES = ((1, 16, 14, 14), (1, 64, 56, 56))  # 3,136 and 200,704 elements
OPSET = 17
# label -> (op, attributes, binary, the int8 op ONNX Runtime must have fused it into, or None: runs on bytes)
OPS: dict[str, tuple[str, dict[str, Any], bool, str | None]] = {
    "Add": ("Add", {}, True, "QLinearAdd"),
    "Mul": ("Mul", {}, True, "QLinearMul"),
    "Sigmoid": ("Sigmoid", {}, False, "QLinearSigmoid"),
    "LeakyRelu": ("LeakyRelu", {"alpha": 0.1}, False, "QLinearLeakyRelu"),
    "Softmax": ("Softmax", {"axis": -1}, False, "QLinearSoftmax"),
    "AveragePool 3x3": ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, False, "QLinearAveragePool"),
    "MaxPool 3x3": ("MaxPool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, False, "NhwcMaxPool"),
    "MaxPool 5x5": ("MaxPool", {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}, False, "NhwcMaxPool"),
    "MaxPool 13x13": ("MaxPool", {"kernel_shape": [13, 13], "pads": [6, 6, 6, 6]}, False, "NhwcMaxPool"),
    "GlobalAveragePool": ("GlobalAveragePool", {}, False, "QLinearGlobalAveragePool"),
    "Tanh": ("Tanh", {}, False, None),  # float only: no int8 Tanh in ONNX Runtime 1.31
}


def _chain(label: str, count: int, shape: tuple[int, ...], int8: bool) -> onnx.ModelProto:
    """``count`` copies of the op in a chain or, for an op whose output is much smaller than its
    input (GlobalAveragePool), side by side on the same input, each to an output of its own."""
    op, attrs, binary, _ = OPS[label]
    if int8 and op in NHWC:
        return _nhwc_chain(label, count, shape)
    chained = op != "GlobalAveragePool"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
    ]
    nodes, outputs = [], []
    first = "x"
    if int8:
        nodes.append(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q0"]))
        first = "q0"
        if binary:
            nodes.append(helper.make_node("DequantizeLinear", ["q0", "s", "z"], ["dx"]))
    cur = first
    for i in range(count):
        src = cur if chained else first
        if int8:
            nodes.append(helper.make_node("DequantizeLinear", [src, "s", "z"], [f"d{i}"]))
            src = f"d{i}"
        inputs = [src, "dx" if int8 else "x"] if binary else [src]
        out = f"f{i}"
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        if int8:
            nodes.append(helper.make_node("QuantizeLinear", [out, "s", "z"], [f"q{i + 1}"]))
            out = f"q{i + 1}"
        cur = out
        if not chained or i == count - 1:
            if int8:
                nodes.append(helper.make_node("DequantizeLinear", [out, "s", "z"], [f"y{i}"]))
            else:
                nodes.append(helper.make_node("Identity", [out], [f"y{i}"]))
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, op, [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def _nhwc_chain(label: str, count: int, shape: tuple[int, ...]) -> onnx.ModelProto:
    """An int8 pool as ONNX Runtime runs it between int8 convs: its NHWC transformer turns a uint8
    MaxPool into ``com.microsoft.NhwcMaxPool`` and a QLinearAveragePool into its channels-last form
    (a standalone chain keeps the slow NCHW uint8 ones: 3.8 ns an element for a 3x3 MaxPool, 40x
    float). Written here directly, between a transpose in and one out."""
    op, attrs, _, _ = OPS[label]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("Transpose", ["q"], ["t0"], perm=[0, 2, 3, 1]),
    ]
    for i in range(count):
        if op == "MaxPool":
            nodes.append(helper.make_node("NhwcMaxPool", [f"t{i}"], [f"t{i + 1}"], domain="com.microsoft", **attrs))
        else:
            nodes.append(
                helper.make_node(
                    "QLinearAveragePool",
                    [f"t{i}", "s", "z", "s", "z"],
                    [f"t{i + 1}"],
                    domain="com.microsoft",
                    channels_last=1,
                    **attrs,
                )
            )
    nodes.append(helper.make_node("Transpose", [f"t{count}"], ["back"], perm=[0, 3, 1, 2]))
    nodes.append(helper.make_node("DequantizeLinear", ["back", "s", "z"], ["y"]))
    graph = helper.make_graph(nodes, label, [x], [y], inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _conversions(count: int, shape: tuple[int, ...], with_qdq: bool) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
    ]
    nodes, cur = [], "x"
    for i in range(count):
        if with_qdq:
            nodes.append(helper.make_node("QuantizeLinear", [cur, "s", "z"], [f"q{i}"]))
            nodes.append(helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"]))
            cur = f"d{i}"
        nodes.append(helper.make_node("Neg", [cur], [f"n{i}"]))
        cur = f"n{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    graph = helper.make_graph(nodes, "conversions", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def _session(model: onnx.ModelProto, folder: Path, name: str) -> tuple[Any, list[str]]:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.use_per_session_threads = False
    optimized = folder / f"{name}.opt.onnx"
    options.optimized_model_filepath = str(optimized)
    s = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return s, [n.op_type for n in onnx.load(optimized).graph.node]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("--ops", help="only these labels, comma-separated (e.g. 'MaxPool 3x3,Add')")
    args = parser.parse_args()
    onnxruntime.set_global_thread_pool_sizes(2, 1)
    from requant.report.latency import interleaved_latency_ms

    print(f"onnxruntime {onnxruntime.__version__} from {Path(onnxruntime.__file__).parent}")
    results: dict[str, Any] = {"sizes": [int(np.prod(s)) for s in SIZES], "ops": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for shape in SIZES:
            elements = int(np.prod(shape))
            sessions, keys = [], []
            for op, (op_type, _, _, fused) in OPS.items():
                if args.ops and op not in args.ops.split(","):
                    continue
                for int8 in (False, True):
                    if int8 and op == "Tanh":
                        continue
                    for count in (SHORT, LONG):
                        name = f"{op}.{'int8' if int8 else 'float'}.{count}.{elements}"
                        s, kinds = _session(_chain(op, count, shape, int8), folder, name)
                        if int8:
                            want = fused or op_type
                            if kinds.count(want) != count or (fused and op_type in kinds):
                                raise SystemExit(f"{name}: ONNX Runtime did not fuse as expected: {kinds}")
                        sessions.append(s)
                        keys.append((op, "int8" if int8 else "float", count))
            for with_qdq in (False, True):
                for count in (SHORT, LONG):
                    s, _ = _session(_conversions(count, shape, with_qdq), folder, f"conv.{with_qdq}.{count}.{elements}")
                    sessions.append(s)
                    keys.append(("QuantizeLinear+DequantizeLinear" if with_qdq else "Neg", "float", count))
            sample = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
            ms = dict(
                zip(keys, interleaved_latency_ms(sessions, sample, 0.0, 10.0, args.rounds, args.rounds), strict=True)
            )
            for op, kind, _ in keys:
                per_op_us = (ms[(op, kind, LONG)] - ms[(op, kind, SHORT)]) / (LONG - SHORT) * 1e3
                results["ops"].setdefault(op, {}).setdefault(kind, {})[str(elements)] = per_op_us
        ops = results["ops"]
        conv = ops.pop("QuantizeLinear+DequantizeLinear")["float"]
        neg = ops.pop("Neg")["float"]
        ops["QuantizeLinear+DequantizeLinear"] = {"float": {n: conv[n] - neg[n] for n in conv}}
    small, large = (str(n) for n in results["sizes"])
    print(f"{'op':34} {'kind':6} {'us at ' + small:>12} {'us at ' + large:>14} {'fixed us':>9} {'ns/elem':>8}")
    for op, kinds in results["ops"].items():
        for kind, at in kinds.items():
            per = (at[large] - at[small]) / (int(large) - int(small)) * 1e3
            fixed = at[small] - per * int(small) / 1e3
            at["fixed_us"], at["ns_per_element"] = fixed, per
            print(f"{op:34} {kind:6} {at[small]:12.2f} {at[large]:14.2f} {fixed:9.2f} {per:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
