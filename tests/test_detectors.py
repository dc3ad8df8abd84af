"""A detector's head, and outputs far from float never returned quietly (issue 38).

A YOLOv8-style head concatenates box coordinates in pixels with class probabilities; one int8 type for
both rounds every probability to 0 or 1. Measured on ``tests.models.detector`` (64 calibration and 32
evaluation noise images): before, requant's default kept 10 of 819 float detections while the output's
SQNR read 48.6 dB; the Concat kept float (each input its own type) keeps 818.
"""

from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import requant
import requant.targets.registry as registry
from requant.calibration.calibrate import STEM_METHOD
from requant.cli.main import main
from requant.quantizers.pattern_quantizer import KEPT_FLOAT_KEY
from requant.report.outputs import compare_outputs, poor_parts
from tests.models.detector import detections, make_detector, noise_images


def _outputs(model: onnx.ModelProto | ir.Model, samples: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, s)[0] for s in samples]


@pytest.fixture(scope="module")
def detector() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    images = noise_images(96)
    return make_detector(), images[:64], images[64:]


def test_a_head_joining_pixels_and_probabilities_keeps_its_detections(detector: tuple) -> None:
    """The joins' rule, on a head quantized up to its output (an explicit method: ``auto`` keeps a detector's head
    float after its last kernels, below)."""
    model, calib, evaluation = detector
    result = requant.quantize(model, calib, method=STEM_METHOD, measure=False)
    (join,) = result.report["joins"]["found"]
    steps = {i["value"]: i["steps"] for i in join["inputs"]}  # the boxes' value: its stride Mul folded before it
    assert join["how"] == "float" and len(steps) == 2 and steps.pop("scores") < 1  # half a step of the pixels'
    assert next(iter(steps.values())) > 200
    kept, shift = detections(_outputs(model, evaluation), _outputs(result.model, evaluation))
    assert kept >= 0.95 and shift < 1.0  # measured: 818 of 819, 0.41 px
    assert "joins of ranges that cannot share one int8 type: 1" in result.report["summary"]
    assert "QLinearConcat" not in result.report["lint"]["int8_kernels"]  # the ops before it stay int8
    assert result.report["lint"]["int8_kernels"]["QLinearConv"] == 5  # no stem float: that is auto's
    assert not result.report["outputs"]["poor"]


@pytest.mark.parametrize("variant", ["dfl", "split"])
def test_a_dfl_head_and_a_head_sliced_into_two_outputs_keep_their_detections(variant: str) -> None:
    """YOLOv8's own box decode (each side a Softmax over bins weighted by the bins' index, then
    ``(cell -+ distance) * stride``) before the join; and the joined head sliced into a boxes output and
    a scores output (the Slices share the join's type: float with it)."""
    model = make_detector(**{variant: True})
    images = noise_images(96)
    calib, evaluation = images[:64], images[64:]
    result = requant.quantize(model, calib, method=STEM_METHOD, measure=False)
    assert "QLinearConcat" not in result.report["lint"]["int8_kernels"]  # the join is float
    if variant == "split":  # by the joins' rule, its Slices with it (they shared its type)
        (join,) = result.report["joins"]["found"]
        assert join["how"] == "float" and min(i["steps"] for i in join["inputs"]) < 1
    else:  # placement priced the head's ops after the Softmax cheaper in float: the join went with them
        groups = [p for p in result.report["quantizers"]["placements"] if p["placed"] == "float"]
        assert any("Concat" in g["ops"] for g in groups)
    joined = [np.concatenate(o, 1) for o in _all_outputs(model, evaluation)]
    kept, shift = detections(joined, [np.concatenate(o, 1) for o in _all_outputs(result.model, evaluation)])
    assert (
        kept >= 0.95 and shift < 2.0
    )  # measured: dfl 0.980 / 0.17 px (0.43 px with its decode int8), split 0.999 / 0.41 px
    assert not result.report["outputs"]["poor"]
    if variant == "dfl":  # the decode (its Softmax, the weights by bin, the box logits' Conv) float: the table's rule
        assert "QLinearSoftmax" not in result.report["lint"]["int8_kernels"]
        assert result.report["lint"]["int8_kernels"]["QLinearConv"] == 4  # the backbone's 3 and the classes'
        kept_float = {n.name: n.metadata_props.get(KEPT_FLOAT_KEY, "") for n in result.model.graph}
        decode = [name for name, why in kept_float.items() if why.startswith("an expectation over bins")]
        assert len(decode) == 3, kept_float


def _all_outputs(model: onnx.ModelProto | ir.Model, samples: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, s) for s in samples]


def test_an_output_far_from_float_gets_the_ops_feeding_it_float(
    detector: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the joins' rule (a target whose table lacks it), the output check finds the scores:
    their SQNR near 0 dB and nearly every decision changed (the whole output reads 48 dB), and, as its
    users count them, the head's detections after NMS lost; the ops between the output and the kernels
    before it are kept float, and the detections come back."""
    target = registry.TARGETS["onnxruntime-cpu"]
    without = dataclasses.replace(target, table=dataclasses.replace(target.table, joins={}))
    monkeypatch.setitem(registry.TARGETS, "onnxruntime-cpu", without)
    model, calib, evaluation = detector
    result = requant.quantize(model, calib, method=STEM_METHOD, eval_data=evaluation, measure=False)
    checked = result.report["outputs"]
    first = {p.get("joins", p["part"]): p for p in checked["parts"]}
    assert first["boxes"]["sqnr_db"] > 40 and first["scores"]["flipped"] > 0.9 and first["scores"]["sqnr_db"] < 5
    assert first["boxes"]["judged_by"] == first["scores"]["judged_by"] == "detections"
    assert first["detections"]["float_detections"] > 400 and first["detections"]["recall"] < 0.05
    assert not checked["held_out"] and checked["samples"] == 32  # a detector is calibrated on every sample
    remedy = checked["remedy"]
    assert remedy["kept"] and "node_13" in remedy["kept_float"]  # the Concat, and the ops before it
    assert not any(name.startswith("node_1") and name in ("node_10",) for name in remedy["kept_float"])  # no kernel
    assert not checked["poor"]
    (after,) = [p for p in remedy["parts"] if p["part"] == "detections"]
    assert after["recall"] >= 0.95 and after["precision"] >= 0.95
    kept, _ = detections(_outputs(model, evaluation), _outputs(result.model, evaluation))
    assert kept >= 0.95
    summary = result.report["summary"].splitlines()
    assert summary[0].startswith("far from float at first: output 'y' (a detector's, decoded with NMS): ")
    assert "ops feeding it kept float" in summary[0]


def test_a_split_head_far_from_float_gets_the_ops_feeding_both_its_outputs_float(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head sliced into a boxes and a scores output, without the joins' rule: its detections, judged over
    both outputs, are lost (0 of 832 found); the remedy keeps float the ops feeding both, and they come back."""
    target = registry.TARGETS["onnxruntime-cpu"]
    without = dataclasses.replace(target, table=dataclasses.replace(target.table, joins={}))
    monkeypatch.setitem(registry.TARGETS, "onnxruntime-cpu", without)
    images = noise_images(96)
    result = requant.quantize(make_detector(split=True), images[:64], method=STEM_METHOD, measure=False)
    checked = result.report["outputs"]
    (first,) = [p for p in checked["parts"] if p["part"] == "detections"]
    assert first["outputs"] == ["box_out", "score_out"] and first["recall"] < 0.05
    assert checked["remedy"]["kept"] and not checked["poor"]
    (after,) = [p for p in checked["remedy"]["parts"] if p["part"] == "detections"]
    assert after["recall"] >= 0.95 and after["precision"] >= 0.95


def _drowned(tmp_path: Path) -> tuple[Path, Path]:
    """y = Sigmoid(100 x W - 2): the input's informative channels (0.01) beside one of +-1000 that W does
    not read; one int8 type for the input rounds them all to 0 (y = 0.12: every decision lost), and no
    float op after the kernel brings them back (smoothing, which would, is off)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    w[0] = 0.0
    nodes = [helper.make_node("MatMul", ["x", "w"], ["d"]), helper.make_node("Mul", ["d", "k"], ["e"]),
             helper.make_node("Add", ["e", "c"], ["f"]), helper.make_node("Sigmoid", ["f"], ["y"])]  # fmt: skip
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(100.0, np.float32), "k"),
             numpy_helper.from_array(np.array(-2.0, np.float32), "c")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], inits)  # fmt: skip
    path = tmp_path / "drowned.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    x = rng.normal(size=(96, 8)) * 0.01
    x[:, 0] = rng.uniform(-1000, 1000, size=96)
    data = tmp_path / "calib.npz"
    np.savez(data, x=x.astype(np.float32))
    return path, data


def test_an_output_no_remedy_brings_back_is_said_first_and_strict_exits_3(tmp_path: Path) -> None:
    path, data = _drowned(tmp_path)
    out = tmp_path / "out.onnx"
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = main(["quantize", str(path), "-o", str(out), "--calib", str(data), "--no-measure", "--strict",
                     "--smoothing", "0", "--preset", "INT8_PER_CHANNEL_WEIGHTS"])  # fmt: skip
    assert code == 3 and out.exists()  # written, but no good as it is
    first = printed.getvalue().splitlines()[0]
    assert first.startswith("NOT USABLE AS IS: output 'y': ") and "decisions (scores >= 0.25) change" in first
    with redirect_stdout(io.StringIO()):
        assert (
            main(["quantize", str(path), "-o", str(out), "--calib", str(data), "--no-measure", "--smoothing", "0"]) == 0
        )
    checked = requant.quantize(path, data, smoothing=0, measure=False).report["outputs"]
    assert checked["poor"] and not checked["remedy"]["kept"]  # tried, no closer: left as it was
    assert checked["remedy"]["kept_float"] and all(k != "node" for k in checked["remedy"]["kept_float"])


def test_auto_calibrates_a_detector_with_its_fine_maps_clipped_at_99_99(detector: tuple) -> None:
    """method="auto" tells a detector by its float outputs and calibrates it with ``stem_percentile``
    (on every sample: nothing is compared, nothing held out): the maps at a quarter of
    the input's resolution or finer (64x64 -> 32x32 and 16x16) at the 99.99th percentile, the values
    between the head's convolutions and the output at their whole range (the class logits: their rare
    large values are the detections), the others as ``percentile`` calibrates them. (On the YOLO exports
    of the zoo: docs/benchmarks.md.)"""
    from requant.calibration.calibrate import fine_maps, near_outputs

    model, calib, _ = detector
    graph = ir.from_proto(onnx.shape_inference.infer_shapes(model)).graph
    assert fine_maps(graph) == {"x", "c0", "r0", "c1", "r1"}
    assert {"y", "probabilities", "logits", "boxes", "in_cells", "offsets"} <= near_outputs(graph)
    assert not near_outputs(graph) & {"r2", "c2", "x"}  # behind the head's convolutions
    result = requant.quantize(model, calib, measure=False)
    choice = result.report["method_choice"]
    assert choice["chosen"] == "stem_percentile" and choice["held_out"] == 0  # calibrated on every sample
    assert choice["why"].startswith("output 'y' holds boxes and 3 class scores: a detector; maps at a quarter")
    assert choice["stem_float"] == ["node", "node_1", "node_2", "node_3"]  # conv 64 -> 32 wide, Relu, 32 -> 16, Relu
    assert "its stem float: 4 ops, node, node_1, ..." in result.report["summary"]
    # the head from its last kernels (the box and class convolutions: 0.6 % of the multiply-adds) to the output
    assert choice["head_float"] == [f"node_{i}" for i in range(6, 14)]
    assert "; its head float after its last kernels: 8 ops" in result.report["summary"]
    assert not result.report["lint"]["int8_kernels"]  # the third conv reads the stem's result: float too
    assert not result.report["outputs"]["held_out"] and result.report["outputs"]["samples"] == 32
    types = {}
    for method in ("percentile", "stem_percentile", "minmax"):
        run = requant.quantize(model, calib, method=method, measure=False)
        types[method] = {c["value"]: c["type"] for c in run.report["calibrated"]}
    plain, stem = types["percentile"], types["stem_percentile"]
    scale = lambda t: float(t.split(", ")[1].split(":")[0].rstrip(">"))  # noqa: E731
    assert all(scale(stem[v]) < scale(plain[v]) for v in ("r0", "r1")), (plain, stem)  # 0.0093 < 0.0101, ...
    near = {"logits", "probabilities", "offsets", "in_cells", "boxes"} & set(plain)  # their whole range: minmax's
    assert near and all(stem[v] == types["minmax"][v] for v in near)
    assert all(stem[v] == plain[v] for v in set(plain) - near - {"x", "c0", "r0", "c1", "r1"})


@pytest.mark.parametrize(("classes", "kernels"), [(3, True), (80, False)])
def test_a_detectors_head_is_named_from_its_outputs_back_to_its_last_kernels(classes: int, kernels: bool) -> None:
    """``head_ops``: the ops between the head's outputs and the kernels before them, those kernels too while their
    multiply-adds are at most ``HEAD_SHARE`` of the model's (3 classes: 14 k of 2.2 M; 80: 172 k of 2.4 M, 7 %)."""
    from requant.targets.stem import HEAD_SHARE, head_ops

    model = ir.from_proto(onnx.shape_inference.infer_shapes(make_detector(classes=classes)))
    for i, node in enumerate(model.graph):
        node.name = f"n{i}"  # n0-n5 the backbone's Conv and Relu; n6 the boxes' Conv, n10 the classes'
    decode = ["n7", "n8", "n9", "n11", "n12", "n13"]  # Reshape, Add, Mul; Sigmoid, Reshape; the Concat
    assert head_ops(model, ["y"]) == (sorted([*decode, "n6", "n10"], key=lambda n: int(n[1:])) if kernels else decode)
    assert HEAD_SHARE == 0.02
    assert head_ops(model, []) == []  # no head output named: nothing


def test_a_detector_on_an_integer_only_target_keeps_nothing_float(detector: tuple) -> None:
    """tosa-int8 computes nothing in float: ``auto`` calibrates a detector as on any target, but keeps neither its
    stem nor its head float (it had kept the stem float, and the lowering refused the float Conv); the join of
    pixels and probabilities on one int8 type then loses the detections, and the summary says so first."""
    model, calib, _ = detector
    result = requant.quantize(model, calib[:32], target="tosa-int8", measure=False)
    choice = result.report["method_choice"]
    assert choice["chosen"] == STEM_METHOD and choice["stem_float"] == [] and choice["head_float"] == []
    assert result.report["summary"].startswith("NOT USABLE AS IS: output 'y' (a detector's, decoded with NMS): 0% of")


def test_parts_and_what_is_poor() -> None:
    """An output a Concat joins is split into its inputs; a part of scores counts its decisions."""
    f = [np.array([[[10.0, 200.0], [0.9, 0.1]]]), np.array([[[30.0, 100.0], [0.3, 0.6]]])]  # [1, 2, 2] each
    q = [np.array([[[10.0, 200.0], [1.0, 0.0]]]), np.array([[[30.0, 100.0], [0.0, 1.0]]])]
    parts = compare_outputs(["y"], [[a] for a in f], [[a] for a in q], {"y": (1, [("boxes", 1), ("scores", 1)])})
    boxes, scores = parts
    assert boxes["part"] == "values" and boxes["sqnr_db"] == float("inf")
    assert scores["part"] == "scores" and scores["decisions"] == 3  # 0.9, 0.3, 0.6
    assert scores["kept"] == pytest.approx(2 / 3, abs=1e-4) and scores["flipped"] == pytest.approx(1 / 3, abs=1e-4)
    expected = 10 * np.log10((0.81 + 0.01 + 0.09 + 0.36) / (0.01 + 0.01 + 0.09 + 0.16))
    assert scores["sqnr_db"] == pytest.approx(expected, abs=0.01)  # 6.7 dB
    assert poor_parts(parts) == [scores]  # below 10 dB; its 3 decisions alone are too few to say
    scores["sqnr_db"] = 12.0
    assert poor_parts(parts) == []


def _timed(monkeypatch: pytest.MonkeyPatch, *rounds: list[float] | list[list[float]]) -> list[int]:
    """The interleaved measurements answering ``rounds`` in turn (milliseconds by model, or by model and round):
    which models are faster is what this tests, not how fast they run (timings live in bench/)."""
    import requant.stages.speed as speed

    calls: list[int] = []

    def measured_rounds(sessions: list[object], sample: object) -> list[list[float]]:
        calls.append(len(sessions))
        given = rounds[len(calls) - 1][: len(sessions)]
        return [t if isinstance(t, list) else [t] * 5 for t in given]

    def measured(sessions: list[object], sample: object) -> list[float]:
        return [float(np.median(t)) for t in measured_rounds(sessions, sample)]

    monkeypatch.setattr(speed, "interleaved_rounds", measured_rounds)
    monkeypatch.setattr(speed, "interleaved_latency_ms", measured)
    return calls


def test_an_int8_model_as_fast_as_float_within_the_measurement_raises_no_alarm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # LAC's tagger (one float GRU): 0.233 against 0.232 ms by the medians, int8 slower in about half the rounds
    _timed(monkeypatch, [[1.0, 1.0, 1.1, 1.0, 0.9], [1.1, 0.9, 1.0, 1.05, 1.0]], [1.0, 1.0, 1.0])
    digits = Path(__file__).parent.parent / "examples" / "digits"
    summary = requant.quantize(digits / "digits_cnn.onnx", digits / "calib.npz").report["summary"]
    assert "SLOWER THAN FLOAT" not in summary
    assert "(1.00x): as fast as float within the measurement (int8 slower in 60% of the alternating rounds)" in summary


def test_a_faster_int8_model_says_first_what_it_gained_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """No alarm: the first line is the speed-up, the size and what the evaluation kept (accuracy with labels)."""
    _timed(monkeypatch, [1.0, 0.5])
    digits = Path(__file__).parent.parent / "examples" / "digits"
    report = requant.quantize(digits / "digits_cnn.onnx", digits / "calib.npz", eval_data=digits / "eval.npz").report
    size, ev = report["size_bytes"], report["evaluation"]
    assert report["summary"].splitlines()[0] == (
        f"int8 model: 2.00x as fast as float (batch 1), {size['quantized'] / size['float']:.2f}x its size, accuracy "
        f"{ev['float_accuracy']:.4f} -> {ev['int8_accuracy']:.4f} (450 samples)"
    )
    assert report["summary"].splitlines()[1] == "target: onnxruntime-cpu"


def test_an_int8_model_slower_than_float_gets_its_worst_groups_float(
    detector: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, calib, _ = detector
    calls = _timed(monkeypatch, [1.0, 1.3], [1.0, 1.3, 0.8])
    result = requant.quantize(model, calib, method=STEM_METHOD)  # auto: this head float, nothing int8 after the stem
    assert calls == [2, 3]  # float and int8; then the two with the candidate, in the same rounds
    tried = result.report["speed"]["tried"]
    assert tried["kept"] and tried["kept_float"] and result.report["latency_ms_batch1"]["quantized"] == 0.8
    assert all(ops for ops in tried["ops"])
    summary = result.report["summary"]
    assert "SLOWER THAN FLOAT" not in summary and "speed: the int8 model was no faster than float (1.30x)" in summary


def test_an_int8_model_still_slower_than_float_says_so_first(detector: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, calib, _ = detector
    _timed(monkeypatch, [1.0, 1.3], [1.0, 1.3, 1.28])
    result = requant.quantize(model, calib, method=STEM_METHOD)
    assert not result.report["speed"]["tried"]["kept"]  # not faster by 5 %: the int8 model stays
    first = result.report["summary"].splitlines()[0]
    assert first.startswith("SLOWER THAN FLOAT: the int8 model takes 1.30x the float model's time")
    assert first.endswith("(no faster: not kept)")
    _timed(monkeypatch, [1.0, 1.2])
    digits = requant.quantize(Path(__file__).parent.parent / "examples" / "digits" / "digits_cnn.onnx",
                              Path(__file__).parent.parent / "examples" / "digits" / "calib.npz")  # fmt: skip
    assert digits.report["summary"].splitlines()[0].endswith("no group of int8 ops between kernels was priced to "
                                                             "keep float (the kernels themselves are int8)")  # fmt: skip


def test_a_probability_maps_summary_gives_its_closeness_not_a_top_1() -> None:
    """A text detector's [1, 1, H, W] map has no class: the argmax of a sample is one pixel among many near 1
    (PP-OCR's detector read "top-1 agreement with float 0.0000" on 20 photos it kept at 19.6 dB)."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper as nh

    weight = nh.from_array((np.random.default_rng(0).standard_normal((1, 3, 3, 3)) * 0.5).astype(np.float32), "w")
    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Sigmoid", ["c"], ["map"])], "g",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [h.make_tensor_value_info("map", TensorProto.FLOAT, [1, 1, 16, 16])], [weight],
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    data = [{"x": np.random.default_rng(i).standard_normal((1, 3, 16, 16)).astype(np.float32)} for i in range(24)]
    report = requant.quantize(model, data[:16], eval_data=data[16:], measure=False).report
    ev, first = report["evaluation"], report["summary"].splitlines()[0]
    assert ev["class_scores"] == 0.0
    assert first.endswith(f"cosine to float {ev['cosine_similarity']:.5f}, SQNR {ev['sqnr_db']:.1f} dB (8 samples)")
    assert "top-1" not in report["summary"]
