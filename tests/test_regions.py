"""Logical kernels: form, list and inline regions; same numbers in ONNX Runtime; shared definitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from requant.frontends import load_onnx, load_onnx_text, save_onnx
from requant.ir import print_model, quant_type, set_quant_type
from requant.ir.regions import KERNEL_DOMAIN, RegionError, form_region, inline_regions, regions
from requant.ir.verifier import verify_model
from requant.passes import get_passes, run_passes
from requant.types import parse_type

MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,2,4,4] X) => (float[1,2,4,4] Y) {
    W = Constant <value = float[2,2,1,1] {1.0, -0.5, 0.25, 2.0}> ()
    B = Constant <value = float[2] {0.1, -0.2}> ()
    c1 = Conv(X, W, B)
    r1 = Relu(c1)
    c2 = Conv(r1, W, B)
    r2 = Relu(c2)
    c3 = Conv <pads = [0, 0, 0, 0]> (r2, W)
    Y = Add(c3, r1)
}
"""
U8 = parse_type("!quant.uniform<u8:f32, 0.05:0>")


def prepared() -> ir.Model:
    model, _ = run_passes(load_onnx_text(MODEL), get_passes("constants-to-initializers") + get_passes("infer-shapes"))
    return model


def by_output(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if any(o.name == name for o in n.outputs))


def run(model: ir.Model) -> np.ndarray:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    return np.asarray(session.run(None, {"X": x})[0])


def test_regions_run_the_same_and_share_definitions() -> None:
    model = prepared()
    expected = run(model)
    first = form_region(model, [by_output(model, "c1"), by_output(model, "r1")], "conv_relu")
    second = form_region(model, [by_output(model, "c2"), by_output(model, "r2")], "conv_relu")
    third = form_region(model, [by_output(model, "c3")], "conv")
    verify_model(model)
    assert first.function is second.function  # identical kernels, one definition
    assert [(r.kernel, [v.name for v in r.inputs], [o.name for o in r.outputs]) for r in regions(model)] == [
        ("conv_relu", ["X", "W", "B"], ["r1"]),
        ("conv_relu", ["r1", "W", "B"], ["r2"]),
        ("conv", ["r2", "W"], ["c3"]),
    ]
    assert third.function.name == "conv"
    assert np.array_equal(run(model), expected)
    text = print_model(model)
    assert "%r1: tensor<1x2x4x4xf32> = requant.kernels.conv_relu(%X, %W, %B)" in text
    assert (
        "func @requant.kernels::conv_relu(%X: tensor<1x2x4x4xf32>, %W: tensor<2x2x1x1xf32>, %B: tensor<2xf32>)" in text
    )
    assert inline_regions(model) == 3
    verify_model(model)
    assert not model.functions and KERNEL_DOMAIN not in model.opset_imports
    assert [n.op_type for n in model.graph] == ["Conv", "Relu", "Conv", "Relu", "Conv", "Add"]
    assert {o.name for n in model.graph for o in n.outputs} >= {"r1", "r2", "c3", "Y"}
    assert np.array_equal(run(model), expected)


def test_different_bodies_under_one_name_get_their_own_function() -> None:
    model = prepared()
    a = form_region(model, [by_output(model, "c1")], "conv")
    b = form_region(model, [by_output(model, "c3")], "conv")  # pads attribute: a different body
    assert a.function is not b.function
    assert (a.function.name, b.function.name, a.kernel, b.kernel) == ("conv", "conv_1", "conv", "conv")


def test_port_annotations_survive_forming_saving_and_inlining(tmp_path: Path) -> None:
    model = prepared()
    set_quant_type(by_output(model, "r1").outputs[0], U8)
    region = form_region(model, [by_output(model, "c1"), by_output(model, "r1")], "conv_relu")
    assert quant_type(region.outputs[0]) == U8
    save_onnx(model, tmp_path / "m.onnx")
    again = load_onnx(tmp_path / "m.onnx")
    (reloaded,) = [r for r in regions(again) if r.outputs[0].name == "r1"]
    assert quant_type(reloaded.outputs[0]) == U8 and reloaded.kernel == "conv_relu"
    inline_regions(again)
    assert quant_type(by_output(again, "r1").outputs[0]) == U8


def test_invalid_regions_are_refused() -> None:
    model = prepared()
    with pytest.raises(RegionError, match="not form a convex region"):
        # c1 -> r1 -> c2: skipping r1 would make the kernel depend on itself
        form_region(model, [by_output(model, "c1"), by_output(model, "c2")], "bad")
    with pytest.raises(RegionError, match="no nodes"):
        form_region(model, [], "empty")
    verify_model(model)  # a refused region leaves the model as it was
    assert np.array_equal(run(model), run(prepared()))
