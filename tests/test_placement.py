"""Placement by modelled cost (requant.quantizers.placement, requant.targets.costs).

Golden files in ``tests/golden/placement``: ``# target: NAME``, a model in ONNX text, then the IR
as annotated after placement (``# expected ir:``) and each group's decision with its modelled costs
(``# expected placements:``, one JSON object a line). ``pytest --update-golden`` rewrites them.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from bench.bench_placement import between_convs
from onnx import parser

import requant
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.ir.annotations import iter_values, request
from requant.quantizers import PRESETS, QuantizationSpec, Quantizer, QuantizerReport
from requant.quantizers.quantizer import FLOAT_KERNEL, FLOAT_PLACED
from requant.report.latency import session
from requant.report.markdown import to_markdown
from requant.stages.annotate import prepare
from requant.targets.registry import get_target
from tests.golden_file import check_sections, header_value, model_text

CASES = sorted((Path(__file__).parent / "golden" / "placement").glob("*.test"))
IR, PLACEMENTS = "# expected ir:\n", "# expected placements:\n"


def _prepare(model: Any, quantizer: Quantizer | None, target: str) -> tuple[ir.Model, QuantizerReport]:
    """Annotated and placed for ``target`` (:func:`requant.stages.annotate.prepare`)."""
    chosen = get_target(target)
    prepared = prepare(model, (quantizer or Quantizer().set_global_by_model()).for_table(chosen.table), chosen, False,
                       None)  # fmt: skip
    return prepared.model, prepared.report


def run(path: Path) -> tuple[str, str, str]:
    head = path.read_text().split(IR)[0]
    model = load_onnx_text(model_text(head), path.name)
    model, report = _prepare(model, None, header_value(head, "target"))
    lines = "".join(json.dumps(p, sort_keys=True) + "\n" for p in report.placements)
    return head, print_model(model), lines


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_placement_golden(path: Path, update_golden: bool) -> None:
    head, ir_text, placements = run(path)
    check_sections(path, head, [(IR, "IR", ir_text), (PLACEMENTS, "placements", placements)], update_golden)


def _conv_model(body: str) -> onnx.ModelProto:
    """``body`` between two int8 1x1 convs, 8 channels of 12x12 (the placement bench's models)."""
    return between_convs(body, 8, 12, weight_scale=0.3)


def _sigmoid_between_tanhs(dims: str) -> onnx.ModelProto:
    """``Tanh -> Sigmoid -> Tanh`` on a ``[dims]`` input: an int8 Sigmoid between float ops."""
    return parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{dims}] x) => (float[{dims}] y) {{
      t = Tanh(x)
      s = Sigmoid(t)
      y = Tanh(s)
    }}""")


def _samples(shape: tuple[int, ...], count: int = 8) -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(count)]


def _optimized(model: onnx.ModelProto, tmp_path: Path) -> list[str]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]


def test_ops_without_kernels_around_them_run_in_float_and_compute_what_float_does() -> None:
    model = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,8,16,16] x) => (float[1,8,16,16] y) {
      s = Sigmoid(x)
      t = Tanh(s)
      u = Sigmoid(t)
      y = Relu(u)
    }""")
    data = _samples((1, 8, 16, 16))
    result = requant.quantize(model, data, measure=False)
    ops = [n.op_type for n in result.model.graph]
    assert ops == [
        "Sigmoid",
        "Tanh",
        "Sigmoid",
        "Relu",
    ]  # without placement: a QuantizeLinear and a DequantizeLinear each
    placements = result.report["quantizers"]["placements"]
    assert {p["placed"] for p in placements} == {"float"}
    assert all(p["float_us"] < p["int8_us"] for p in placements)
    float_session = session(model)
    quant_session = session(ir.serde.serialize_model(result.model))
    for sample in data[:2]:
        np.testing.assert_array_equal(quant_session.run(None, sample)[0], float_session.run(None, sample)[0])


def test_float_placed_ops_between_int8_convs_leave_the_convs_int8(tmp_path: Path) -> None:
    # FLOAT_PLACED asks nothing of its ports (FLOAT_KERNEL keeps its inputs float, so the conv before
    # it would lose its quantized output and run in float); a data-movement op named float is float
    model = _conv_model("s = Sigmoid(c)\n t = Tanh(s)\n a = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(t)")
    data = _samples((1, 8, 12, 12))
    placed = Quantizer().set_global_by_model().with_float_nodes(["n1_Sigmoid", "n3_MaxPool"], FLOAT_PLACED)
    result = requant.quantize(model, data, quantizer=placed, measure=False, method="minmax")
    proto = ir.serde.serialize_model(result.model)
    ops = _optimized(proto, tmp_path)
    assert ops.count("QLinearConv") == 2 and "QLinearSigmoid" not in ops
    assert "Sigmoid" in ops
    # the MaxPool reads the float Tanh: nothing quantizes t (ONNX Runtime itself may move the conv's
    # QuantizeLinear before the MaxPool, which commutes with it)
    assert not [n for n in result.model.graph if n.op_type == "QuantizeLinear" and n.inputs[0].name == "t"]
    kernels = Quantizer().set_global_by_model().with_float_nodes(["n1_Sigmoid"], FLOAT_KERNEL)
    result = requant.quantize(model, data, quantizer=kernels, measure=False, method="minmax")
    assert _optimized(ir.serde.serialize_model(result.model), tmp_path).count("QLinearConv") == 1


def test_a_group_between_int8_convs_stays_int8_where_it_saves_conversions(tmp_path: Path) -> None:
    model = _conv_model("s = Sigmoid(c)\n a = Mul(c, s)")  # SiLU
    result = requant.quantize(model, _samples((1, 8, 12, 12)), measure=False, method="minmax")
    (group,) = result.report["quantizers"]["placements"]
    assert group["ops"] == ["Sigmoid", "Mul"] and group["placed"] == "int8"
    assert group["int8_us"] < group["float_us"]
    ops = _optimized(ir.serde.serialize_model(result.model), tmp_path)
    assert {"QLinearSigmoid", "QLinearMul"} <= set(ops) and ops.count("QLinearConv") == 2
    markdown = to_markdown(result.report)
    assert "1 group of int8 ops between kernels stays int8" in markdown


def test_a_data_movement_op_named_float_shares_nothing() -> None:
    # the shared-spec quantizer would tie its output to its input's quantization (a MaxPool on bytes)
    model = _conv_model("a = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(c)")
    as_int8, _ = _prepare(model, None, "onnxruntime-cpu")
    assert str(request(next(v for v in iter_values(as_int8.graph) if v.name == "a"))) == "#requant.shared<%c>"
    floats = Quantizer().set_global_by_model().with_float_nodes(["n1_MaxPool"], FLOAT_PLACED)
    kept, report = _prepare(model, floats, "onnxruntime-cpu")
    a = next(v for v in iter_values(kept.graph) if v.name == "a")
    assert isinstance(request(a), QuantizationSpec)  # the next conv's own request, not shared
    (record,) = [r for r in report.records if r.config == "FLOAT_PLACED"]
    assert [(d.nodes, d.status) for d in record.decisions] == [(["n1_MaxPool"], "accepted")]


def test_what_the_report_says_onnx_runtime_fuses_anyway_it_does(tmp_path: Path) -> None:
    path = Path(__file__).parent / "golden" / "placement" / "residual_sums.test"
    text = "".join(line + "\n" for line in path.read_text().split(IR)[0].splitlines() if not line.startswith("#"))
    model = ir.to_proto(load_onnx_text(text, path.name))
    x = _samples((1, 4, 8, 8))
    result = requant.quantize(model, [{"X": s["x"]} for s in x], measure=False, method="minmax")
    priced = {p["nodes"][0]: p for p in result.report["quantizers"]["placements"] if p["by"] == "table"}
    anyway = {name for name, p in priced.items() if "anyway" in p["why"]}
    assert anyway == {"node_7"} and set(priced) == {"node_2", "node_4", "node_7"}
    ops = _optimized(ir.serde.serialize_model(result.model), tmp_path)
    assert ops.count("QLinearAdd") == len(anyway) and ops.count("Add") == len(priced) - len(anyway)
    assert "ops kept float by the target's table for accuracy cost" in result.report["summary"]
    from requant.report.html import to_html

    assert "0 groups of int8 ops between kernels, placed by modelled cost (0 kept float); 3 ops the target" in (
        html.unescape(to_html(result.report))
    )


def test_a_group_whose_sizes_are_symbolic_is_left_as_annotated() -> None:
    # a symbolic batch counts as 1 (the costs are per run at batch 1); a symbolic image size is not priced
    model = _sigmoid_between_tanhs("N,8,H,W")
    (group,) = _prepare(model, None, "onnxruntime-cpu")[1].placements
    assert group["placed"] == "as annotated" and "no static shape after its batch" in group["why"]
    batch_only = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 8, 16, 16])
    model.graph.input[0].CopyFrom(batch_only)
    (group,) = _prepare(model, None, "onnxruntime-cpu")[1].placements
    assert group["placed"] == "float"


def test_a_group_whose_sizes_are_symbolic_is_priced_at_the_first_samples_shapes() -> None:
    # a text detector's height and width are symbolic: its calibration samples say what they are
    model = _sigmoid_between_tanhs("N,8,H,W")
    result = requant.quantize(model, _samples((1, 8, 16, 16)), measure=False, method="minmax")
    (group,) = result.report["quantizers"]["placements"]
    assert group["placed"] == "float" and group["float_us"] < group["int8_us"]
    static = _sigmoid_between_tanhs("1,8,16,16")  # the same prices as the model with those sizes written in
    (same,) = requant.quantize(static, _samples((1, 8, 16, 16)), measure=False, method="minmax").report["quantizers"][
        "placements"
    ]
    assert (group["int8_us"], group["float_us"]) == (same["int8_us"], same["float_us"])


def test_the_pages_show_each_group_kept_float_with_both_prices() -> None:
    from requant.report.html import to_html

    model = _sigmoid_between_tanhs("1,8,16,16")
    result = requant.quantize(model, _samples((1, 8, 16, 16)), measure=False)
    (group,) = result.report["quantizers"]["placements"]
    int8_us, float_us = f"{group['int8_us']:.1f}", f"{group['float_us']:.1f}"
    row = f"| Sigmoid | float | {int8_us} | {float_us} | float is cheaper: {float_us} us against {int8_us} us in int8 |"
    assert row in to_markdown(result.report)
    page = to_html(result.report)
    assert "1 group of int8 ops between kernels, placed by modelled cost (1 kept float)" in page
    assert "placement: 1 group of int8 ops between kernels, 1 kept float (Sigmoid: modelled" in result.report["summary"]


def test_each_onnx_runtime_target_prices_with_its_own_cpus_costs() -> None:
    from requant.targets.registry import get_target

    avx2, vnni = get_target("onnxruntime-cpu").costs, get_target("onnxruntime-cpu-vnni").costs
    assert avx2 is not None and vnni is not None and avx2 is not vnni
    assert "AVX2" in avx2.name and "VNNI" in vnni.name
    # measured: AVX-512's conversions cost a third of AVX2's per element; the QLinear ops the same
    assert vnni.quantize.ns_per_element < avx2.quantize.ns_per_element / 2
    assert get_target("tosa-int8").costs is None  # integer-only: nothing runs in float between kernels


KEPT_FLOAT_BEHIND_A_TRANSPOSE = """<ir_version: 10, opset_import: ["" : 17]>
g (float[N,4,8,8] x) => (float[N,4,8,8] out) {
    w1 = Constant <value = float[4,4,3,3] {%s}> ()
    w2 = Constant <value = float[4,4,1,1] {%s}> ()
    c1 = Conv <pads = [1,1,1,1]> (x, w1)
    r = Relu (c1)
    t = Transpose <perm = [0, 1, 3, 2]> (r)
    [conv2] c2 = Conv (t, w2)
    y = Relu (c2)
    out = Conv <pads = [1,1,1,1]> (y, w1)
}"""


def test_a_kernel_kept_float_behind_a_transpose_stays_float_in_onnx_runtime() -> None:
    """``int8 conv -> Transpose -> conv2 (kept float) -> int8 conv``: ONNX Runtime moves the
    DequantizeLinear before the Transpose past it, then quantizes conv2's float weight itself (per
    tensor, full range: its int16 pairs can saturate without VNNI) and fuses a QLinearConv. requant's
    output keeps it from that: conv2 runs on its float weights, as the graph says."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(size=144), rng.normal(size=16) * np.array([1, 1, 1, 8] * 4)
    text = KEPT_FLOAT_BEHIND_A_TRANSPOSE % (", ".join(f"{v:.4f}" for v in w1), ", ".join(f"{v:.4f}" for v in w2))
    x = rng.uniform(0, 1, (16, 4, 8, 8)).astype(np.float32)
    kept = Quantizer().set_global_by_model().with_float_nodes(["conv2"], FLOAT_KERNEL)
    result = requant.quantize(parser.parse_model(text), [{"x": s[None]} for s in x], quantizer=kept, measure=False)
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 2}  # conv2 is not one (it was)
    proto = ir.to_proto(result.model).SerializeToString()
    as_written = ort.SessionOptions()
    as_written.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fused = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    written = ort.InferenceSession(proto, as_written, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # measured: the same bits (with conv2 fused on ONNX Runtime's per-tensor weights: 3 output steps apart)
    np.testing.assert_array_equal(fused, written)


def test_a_group_writing_a_graph_output_goes_float_where_float_costs_no_more(tmp_path: Path) -> None:
    # TransNetV2's tail: a Sigmoid of a few logits writes the output; int8 would put it on 1/255 steps for
    # nothing (0.6 us either way, modelled)
    rng = np.random.default_rng(0)
    weight = onnx.numpy_helper.from_array((rng.standard_normal((4, 8, 12, 12)) * 0.05).astype(np.float32), "w")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            onnx.helper.make_node("Sigmoid", ["c"], ["y"], name="sig"),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 12, 12])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 1, 1])],
        [weight],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    data = _samples((1, 8, 12, 12), 16)
    result = requant.quantize(model, data, measure=False, method="minmax")
    (group,) = [p for p in result.report["quantizers"]["placements"] if p["ops"] == ["Sigmoid"]]
    assert group["placed"] == "float" and "graph output" in group["why"]
    assert group["float_us"] <= group["int8_us"]
    ops = _optimized(ir.serde.serialize_model(result.model), tmp_path)
    assert "QLinearConv" in ops and "Sigmoid" in ops and "QLinearSigmoid" not in ops
    (writer,) = [n for n in result.model.graph if n.outputs[0].is_graph_output()]
    assert writer.op_type == "Sigmoid"  # the output as float computes it, not a DequantizeLinear's steps
    assert "Sigmoid: as fast, no rounding" in result.report["summary"]


def test_a_linear_layer_read_only_by_a_float_output_op_keeps_its_result_float(tmp_path: Path) -> None:
    # TransNetV2's classifier: Linear (MatMul + bias Add) -> Sigmoid -> the output. Once placement keeps the
    # Sigmoid float, the logits need no int8 type: the layer runs as MatMulIntegerToFloat with its bias, the
    # logits unrounded (they were on steps of 0.1: the output 45 -> 48 dB against float on 32 clips)
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((64, 1)) * 0.2).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(np.array([0.3], np.float32), "b")]  # fmt: skip
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
            onnx.helper.make_node("Add", ["b", "m"], ["logits"], name="fc_bias"),
            onnx.helper.make_node("Sigmoid", ["logits"], ["y"], name="sig"),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 100, 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 100, 1])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    data = _samples((1, 100, 64), 16)
    quantizer = Quantizer().set_global(PRESETS["INT8_PER_CHANNEL_WEIGHTS"])  # TransNetV2's, a conv net's
    result = requant.quantize(model, data, measure=False, method="minmax", quantizer=quantizer)
    (group,) = [p for p in result.report["quantizers"]["placements"] if p["ops"] == ["Sigmoid"]]
    assert group["placed"] == "float"
    assert result.report["lint"]["int8_kernels"] == {"MatMulIntegerToFloat": 1}
    (sigmoid,) = [n for n in result.model.graph if n.op_type == "Sigmoid"]
    writer = sigmoid.inputs[0].producer()
    assert writer is not None and writer.op_type == "MatMulIntegerToFloat"  # no QuantizeLinear between them
