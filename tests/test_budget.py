"""The accuracy budget (``max_drop``): the fewest kernels kept float (the most effective, or the first in graph
order) until the drop fits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant
from requant.errors import ArgumentError
from requant.ir.requests import QuantizationSpec
from requant.quantizers import INT8_PER_CHANNEL_WEIGHTS, Quantizer
from requant.report.budget import choose_metric, drop, fewest, fewest_of, float_cost_us, kernel_class
from requant.targets.costs import ONNXRUNTIME_X86_COSTS
from tests.host import PAIRS_SATURATE
from tests.test_quantize import run_cli

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 8, 9, 13])
def test_fewest_finds_the_smallest_k_trying_each_once(needed: int) -> None:
    tried: list[int] = []

    def within(k: int) -> bool:
        tried.append(k)
        return k >= needed

    assert fewest(13, within) == needed
    assert len(tried) == len(set(tried)) and len(tried) <= 2 * int(np.ceil(np.log2(13))) + 1


def test_fewest_says_when_not_even_all_are_enough() -> None:
    assert fewest(6, lambda k: False) is None and fewest(0, lambda k: True) is None


@pytest.mark.parametrize(("ranked", "first", "expected"), [
    (5, 3, ("first", 3)),  # the region from the inputs needs fewer
    (2, 7, ("ranked", 2)),
    (4, 4, ("first", 4)),  # a tie: the family named last (one region, fewer boundaries)
    (13, 13, ("first", 13)),
    (None, 9, ("first", 9)),  # one family never meets it
    (None, None, None),
])  # fmt: skip
def test_fewest_of_two_families(ranked: int | None, first: int | None, expected: tuple | None) -> None:
    needed = {"ranked": ranked, "first": first}
    tried: list[tuple[str, int]] = []

    def within(family: str, k: int) -> bool:
        tried.append((family, k))
        return needed[family] is not None and k >= needed[family]

    assert fewest_of(["ranked", "first"], 13, within) == expected
    assert len(tried) == len(set(tried))  # each pair once
    # doubling for both (1, 2, 4, 8, 13), then bisecting below the first k met: a few more each
    assert len(tried) <= 2 * 5 + 2 * 3


def test_fewest_of_stops_doubling_at_the_first_k_any_family_meets() -> None:
    tried: list[tuple[str, int]] = []

    def within(family: str, k: int) -> bool:
        tried.append((family, k))
        return family == "first" and k >= 2

    assert fewest_of(["ranked", "first"], 53, within) == ("first", 2)
    assert tried == [("ranked", 1), ("first", 1), ("ranked", 2), ("first", 2)]  # never 4, 8, ... 53


@pytest.mark.parametrize(("first_cost", "expected"), [
    (10.0, ("first", 5)),  # more kernels, but one region: cheaper than the 2 scattered ones
    (150.0, ("ranked", 2)),  # the region's next k already costs more than what is within: not tried
])  # fmt: skip
def test_fewest_of_takes_the_cheapest_set_within(first_cost: float, expected: tuple) -> None:
    needed = {"ranked": 2, "first": 5}
    unit = {"ranked": 100.0, "first": first_cost}
    tried: list[tuple[str, int]] = []

    def within(family: str, k: int) -> bool:
        tried.append((family, k))
        return k >= needed[family]

    assert fewest_of(["ranked", "first"], 40, within, lambda family, k: unit[family] * k) == expected
    assert len(tried) == len(set(tried))
    if expected[0] == "ranked":  # first at 2 costs 300 against ranked's 200 within: it stops at 1
        assert [k for f, k in tried if f == "first"] == [1]
    else:  # the region doubles on past ranked's hit while cheaper (4: 40, 8: 80), then is bisected
        assert [k for f, k in tried if f == "first"] == [1, 2, 4, 8, 6, 5]


CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
chain (float[1, 8, 16, 16] x) => (float[1, 8, 16, 16] y) {
    a = Conv <pads = [0, 0, 0, 0]> (x, w_pw, b_pw)
    r = Relu (a)
    d = Conv <group = 16, pads = [1, 1, 1, 1]> (r, w_dw, b_dw)
    y = Conv <pads = [1, 1, 1, 1]> (d, w_dense, b_dense)
}
"""


def _chain() -> ir.Model:
    import onnx

    model = onnx.parser.parse_model(CHAIN)
    rng = np.random.default_rng(0)
    shapes = {"pw": (16, 8, 1, 1), "dw": (16, 1, 3, 3), "dense": (8, 16, 3, 3)}
    for name, shape in shapes.items():
        weight = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        model.graph.initializer.extend([onnx.numpy_helper.from_array(weight, f"w_{name}"),
                                        onnx.numpy_helper.from_array(np.zeros(shape[0], np.float32), f"b_{name}")])  # fmt: skip
    for node, name in zip(model.graph.node, ["pw", "relu", "dw", "dense"], strict=True):
        node.name = name
    return ir.serde.deserialize_model(model)


def test_float_cost_us_prices_each_kernel_and_the_crossing_into_it() -> None:
    """A kernel kept float costs its float time less its int8 time (by its multiply-adds), plus the
    crossing of its input when an int8 kernel writes it: none for the first kernel (it reads the
    graph's input) or for one whose writer is float too (one region)."""
    calibration = {"x": np.random.default_rng(1).standard_normal((8, 8, 16, 16)).astype(np.float32)}
    q = requant.quantize(_chain(), calibration, method="minmax", measure=False, bias_correction=False)
    model, costs = q.model, ONNXRUNTIME_X86_COSTS.kernels
    nodes = {n.name: n for n in model.graph}
    assert [kernel_class(nodes[n]) for n in ("pw", "dw", "dense")] == ["pointwise", "depthwise", "dense"]
    positions = 16 * 16

    def swap(kind: str, macs: int) -> float:
        return costs[kind].float_op.us(macs) - costs[kind].int8_op.us(macs)

    pw, dw, dense = (
        swap("pointwise", positions * 16 * 8),
        swap("depthwise", positions * 16 * 9),
        swap("dense", positions * 8 * 16 * 9),
    )
    crossing = {kind: costs[kind].input_crossing.us(16 * positions) for kind in ("depthwise", "dense")}
    assert float_cost_us(model, ["pw"], ONNXRUNTIME_X86_COSTS) == pytest.approx(pw)
    assert float_cost_us(model, ["dw"], ONNXRUNTIME_X86_COSTS) == pytest.approx(dw + crossing["depthwise"])
    assert float_cost_us(model, ["pw", "dw"], ONNXRUNTIME_X86_COSTS) == pytest.approx(pw + dw)  # through the Relu
    assert float_cost_us(model, ["dense"], ONNXRUNTIME_X86_COSTS) == pytest.approx(dense + crossing["dense"])
    # two scattered kernels: the crossing into the second; the region of all three has none
    assert float_cost_us(model, ["pw", "dense"], ONNXRUNTIME_X86_COSTS) == pytest.approx(pw + dense + crossing["dense"])
    assert float_cost_us(model, ["pw", "dw", "dense"], ONNXRUNTIME_X86_COSTS) == pytest.approx(pw + dw + dense)


def test_the_metric_and_its_drop() -> None:
    evaluation = {"float_accuracy": 0.9, "int8_accuracy": 0.85, "top1_agreement": 0.93, "cosine_similarity": 0.99}
    assert choose_metric(None, True) == "accuracy" and choose_metric(None, False) == "top1"
    assert drop(evaluation, "accuracy") == pytest.approx(0.05) and drop(evaluation, "top1") == pytest.approx(0.07)
    assert drop(evaluation, "cosine") == pytest.approx(0.01)


def _agreement(path: Path, eval_x: np.ndarray) -> float:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    f = ort.InferenceSession(str(DIGITS / "digits_cnn.onnx"), options, providers=["CPUExecutionProvider"])
    q = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = f.get_inputs()[0].name
    same = [f.run(None, {name: x[None]})[0].argmax() == q.run(None, {name: x[None]})[0].argmax() for x in eval_x]
    return float(np.mean(same))


def _clipping() -> Quantizer:
    """The default, but the first conv's output range cut at its 60th percentile: the int8 kernel
    reading it clips (on every CPU)."""
    spec = QuantizationSpec("uint8", observer="percentile", observer_options={"percentile": 60.0})
    clipped = dataclasses.replace(INT8_PER_CHANNEL_WEIGHTS, output_activation=spec)
    return Quantizer().set_global_by_model().set_node_name("node_conv2d", clipped)


def test_a_budget_keeps_the_kernel_that_loses_most_float() -> None:
    """A clipped activation: 22 digits in 450 change; with no disagreement allowed, one kernel kept
    float is enough either way: the one reading it (found by its measured effect on the output) or
    the one writing it (the first in graph order: its output is then quantized as the reader asks,
    without the clipping). A tie goes to the region from the inputs."""
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", quantizer=_clipping(),
                              eval_data=DIGITS / "eval.npz", max_drop=0.0, metric="top1", measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["met"] and budget["first_drop"] > 0.04 and budget["final_drop"] == 0.0  # measured: 0.049
    tries = [(t["kept_float"], t["family"], t["nodes"], t["drop"]) for t in budget["tries"]]
    assert tries == [(0, "ranked", [], budget["first_drop"]), (1, "ranked", ["node_conv2d_1"], 0.0),
                     (1, "first", ["node_conv2d"], 0.0)]  # fmt: skip
    assert [k["node"] for k in budget["kept_float"]] == ["node_conv2d"] and budget["family"] == "first"
    effects = {k["node"]: k["effect_db"] for k in budget["kept_float"]}
    assert effects["node_conv2d"] is not None
    assert "with the first 1 of 3 kernels kept float" in result.report["summary"]


@pytest.mark.skipif(not PAIRS_SATURATE, reason="full-range int8 weights saturate only on CPUs without VNNI")
def test_a_budget_keeps_the_fewest_worst_kernels_float(tmp_path: Path) -> None:
    """Full-range int8 weights (the VNNI target) on a CPU without VNNI: one digit in 450 changes;
    with no disagreement allowed, the worst-measured kernel is kept float and the budget holds."""
    out = tmp_path / "budget.onnx"
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", target="onnxruntime-cpu-vnni",
                              eval_data=DIGITS / "eval.npz", max_drop=0.0, metric="top1", output=out,
                              measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["met"] and budget["first_drop"] > 0.0 and budget["final_drop"] == 0.0
    kept = budget["kept_float"]
    assert 1 <= len(kept) < budget["candidates"]
    # the saturating first conv, found by its measured effect on the output (its local SQNR, computed
    # on dequantized values, does not show the saturation)
    assert kept[0]["node"] == "node_conv2d" and kept[0]["effect_db"] > 10
    assert len(budget["tries"]) >= 2 and budget["tries"][0]["kept_float"] == 0
    assert _agreement(out, np.load(DIGITS / "eval.npz")["x"]) == 1.0  # re-measured on the saved file
    assert "accuracy budget: top-1 disagreement at most 0;" in result.report["summary"]


def test_an_unreachable_budget_keeps_the_try_that_lost_least() -> None:
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz",
                              max_drop=0.0, metric="cosine", measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert not budget["met"] and budget["final_drop"] == min(t["drop"] for t in budget["tries"])
    assert "NOT MET" in result.report["summary"] and "tries that met it" not in result.report["summary"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_drop": 0.01}, "max_drop needs eval_data"),
        ({"max_drop": 1.5, "eval_data": DIGITS / "eval.npz"}, "max_drop must be a number in"),
        ({"max_drop": 0.01, "eval_data": DIGITS / "eval.npz", "keep_float_below": 30}, "not both"),
        ({"max_drop": 0.01, "eval_data": DIGITS / "eval.npz", "metric": "f1"}, "metric must be one of"),
        ({"metric": "top1"}, "give max_drop too"),
        ({"max_drop": 0.01, "eval_data": {"x": np.zeros((2, 1, 8, 8), np.float32)}, "metric": "accuracy"}, "labels"),
        ({"max_drop": 0.01, "eval_data": DIGITS / "eval.npz", "metric": "detections", "target": "executorch-xnnpack"},
         "measured by the ONNX targets' budget"),
    ],
)
def test_budget_arguments_are_checked_before_any_work(options: dict, message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", measure=False, **options)


def test_the_cli_takes_a_budget(tmp_path: Path) -> None:
    out = tmp_path / "b.onnx"
    ran = run_cli(str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--calib", str(DIGITS / "calib.npz"),
                  "--eval", str(DIGITS / "eval.npz"), "--max-drop", "0.01", "--no-measure")  # fmt: skip
    assert ran.returncode == 0 and out.is_file()
    assert "accuracy budget: accuracy drop at most 0.01;" in ran.stdout
    refused = run_cli(str(DIGITS / "digits_cnn.onnx"), "-o", str(tmp_path / "c.onnx"), "--calib",
                      str(DIGITS / "calib.npz"), "--max-drop", "0.01")  # fmt: skip
    assert refused.returncode != 0 and "max_drop needs eval_data" in refused.stderr
    assert not (tmp_path / "c.onnx").exists()


def test_a_generator_of_evaluation_samples_is_read_once_and_kept_for_every_try() -> None:
    x = np.load(DIGITS / "eval.npz")["x"]
    samples = ({"x": x[i : i + 1]} for i in range(len(x)))
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", quantizer=_clipping(),
                              eval_data=samples, max_drop=0.0, metric="top1", measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["met"] and len(budget["tries"]) == 3  # every try evaluated on the whole set, not an empty one
    assert [t["drop"] for t in budget["tries"][1:]] == [0.0, 0.0]
    assert [k["node"] for k in budget["kept_float"]] == ["node_conv2d"]
    assert result.report["evaluation"]["samples"] == len(x)


def test_a_transformers_linear_layers_are_candidates_too() -> None:
    """Linear layers with float outputs (MatMulIntegerToFloat, which requant writes itself) are not
    measured by bias correction, yet they are the kernels of a transformer: the budget tries them
    (before, it had no candidate and said 'not met' without a try)."""
    from tests.test_linear_layers import D, S, _feed_forward

    rng = np.random.default_rng(1)
    calibration = {"x": rng.normal(size=(16, S, D)).astype(np.float32)}
    evaluation = {"x": rng.normal(size=(8, S, D)).astype(np.float32)}
    result = requant.quantize(_feed_forward(), calibration, eval_data=evaluation, max_drop=1e-6, metric="cosine",
                              measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["candidates"] == 2 and budget["first_drop"] > 1e-5  # measured: 1.1e-4
    assert budget["met"] and budget["final_drop"] <= 1e-6
    tried = {tuple(t["nodes"]) for t in budget["tries"][1:]}
    assert ("mm1",) in tried and ("mm1", "mm2") in tried  # the first in graph order, then both
    assert {k["node"] for k in budget["kept_float"]} <= {"mm1", "mm2"}
    # each measured: MatMul of the float input (clamped where requant dropped the ReLU before mm2's
    # QuantizeLinear) and the dequantized weight, plus the bias; making either float brings the output closer
    assert all(k["effect_db"] is not None and k["effect_db"] > 0 for k in budget["kept_float"])


def test_the_summary_line_signs_effects_and_says_when_the_result_is_no_faster_than_float() -> None:
    from requant.stages.budget import budget_line as _budget_line

    budget = {
        "measures": "1 - cosine", "max_drop": 0.0, "first_drop": 3e-5, "final_drop": 0.0, "met": True,
        "family": "ranked", "candidates": 3, "tries": [{}, {}], "latency_ms_before": 1.2,
        "kept_float": [{"node": "a", "effect_db": 1.1}, {"node": "b", "effect_db": -36.1}, {"node": "c", "effect_db": None}],
    }  # fmt: skip
    line = _budget_line(budget, {"float": 1.0, "quantized": 1.001})
    assert "a (+1.1 dB), b (-36.1 dB), c;" in line and "+-" not in line
    assert "1.20x -> 1.00x of float (no faster than the float model, which meets any budget)" in line
    assert "no faster" not in _budget_line(budget, {"float": 1.0, "quantized": 0.99})


def test_a_kernel_after_a_dropped_relu_is_measured_on_clamped_values() -> None:
    """requant drops the ReLU before the second conv (its QuantizeLinear clamps at the zero point
    anyway) and records the value it stands for; the ranking's float variant of that conv must read
    the ReLU's output, not its input (it read negative values the float model never gives it)."""
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz",
                              max_drop=5e-6, metric="cosine", measure=False)  # fmt: skip
    first = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", measure=False)  # the first pass's model
    proto = ir.serde.serialize_model(first.model)
    dropped = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"
               and any(p.key == "requant.quantizes" for p in n.metadata_props)]  # fmt: skip
    assert dropped, "no QuantizeLinear stands for a dropped clamp: the case is not exercised"
    effects = {k["node"]: k["effect_db"] for k in result.report["accuracy_budget"]["kept_float"]}
    # measured: node_conv2d +3.62 dB, node_conv2d_1 +0.95 dB (1 - cosine 1.0e-5 at first, with float logits)
    assert set(effects) == {"node_conv2d", "node_conv2d_1"} and all(e > 0.1 for e in effects.values()), effects


def test_a_detectors_budget_counts_its_detections() -> None:
    """A detector's budget is measured as its users count: float's detections after NMS found again in
    int8's (the lower of recall and precision), not the top-1 class of a [1, 4 + C, anchors] output. Every
    conv's output range cut at its 60th percentile loses detections; kept float, the drop is what the
    returned model's detections give, measured again here."""
    from requant.report.detections import heads, judge
    from tests.models.detector import make_detector, noise_images

    spec = QuantizationSpec("uint8", observer="percentile", observer_options={"percentile": 60.0})
    clipped = Quantizer().set_global_by_model().set_op_type(
        "Conv", dataclasses.replace(INT8_PER_CHANNEL_WEIGHTS, output_activation=spec))
    model, images = make_detector(), noise_images(48)
    result = requant.quantize(model, images[:32], quantizer=clipped, eval_data=images[32:], max_drop=0.02,
                              measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["metric"] == "detections" and budget["first_drop"] > 0.1 and budget["met"]
    assert 1 <= len(budget["kept_float"]) < budget["candidates"]

    def outputs(m: object) -> list[list[np.ndarray]]:
        proto = ir.serde.serialize_model(m) if isinstance(m, ir.Model) else m
        s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])  # type: ignore[union-attr]
        return [s.run(None, image) for image in images[32:]]

    floats = outputs(model)
    found = judge(heads(["y"], floats)[0], floats, outputs(result.model))
    assert budget["final_drop"] == pytest.approx(1 - min(found["recall"], found["precision"]))
    assert budget["final_drop"] <= 0.02
    assert "1 - min(recall, precision) of float's detections at most 0.02" in result.report["summary"]


def test_the_detections_metric_needs_a_detector() -> None:
    assert choose_metric(None, False, detector=True) == "detections" and choose_metric(None, True, True) == "accuracy"
    assert drop({"recall": 0.95, "precision": 0.9}, "detections") == pytest.approx(0.1)
    with pytest.raises(requant.RequantError, match="'detections' needs a detector"):
        requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz",
                         max_drop=0.01, metric="detections", measure=False)  # fmt: skip
