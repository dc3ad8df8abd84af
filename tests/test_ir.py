"""The IR layer: annotations (typed, persisted, carried through rewrites), printer details, verifier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from requant.frontends import load_onnx, load_onnx_text, save_onnx
from requant.ir import (
    AnnotationError,
    print_model,
    quant_type,
    set_quant_type,
)
from requant.ir.verifier import VerifyError, verify_model
from requant.passes import PassOptions, get_passes, run_passes
from requant.types import parse_type

MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,4] X) => (float[N,4] Y) {
    A = Relu(X)
    B = Identity(A)
    Y = Neg(B)
}
"""
U8 = parse_type("!quant.uniform<u8:f32, 0.02:128>")
PER_AXIS = parse_type("!quant.uniform<i8:f32:1, {0.1,0.2,0.3,0.4}>")


def values(model: ir.Model) -> dict[str, ir.Value]:
    found = {v.name: v for v in model.graph.inputs}
    for node in model.graph:
        found.update({o.name: o for o in node.outputs if o.name})
    return found


def test_annotations_are_typed_and_checked() -> None:
    model = load_onnx_text(MODEL)
    x = model.graph.inputs[0]
    assert quant_type(x) is None
    set_quant_type(x, PER_AXIS)
    assert quant_type(x) == PER_AXIS
    with pytest.raises(AnnotationError, match="is f32 but its annotation .* expresses f16"):
        set_quant_type(x, parse_type("!quant.uniform<i8:f16, 0.5>"))
    with pytest.raises(AnnotationError, match="quantized dimension size does not match number of scales"):
        set_quant_type(x, parse_type("!quant.uniform<i8:f32:1, {0.1,0.2}>"))
    with pytest.raises(TypeError):
        set_quant_type(x, "!quant.uniform<i8:f32, 0.5>")  # type: ignore[arg-type]
    set_quant_type(x, None)
    assert quant_type(x) is None and "requant.type" not in x.metadata_props


def test_annotations_survive_save_and_load(tmp_path: Path) -> None:
    model, _ = run_passes(load_onnx_text(MODEL), get_passes("infer-shapes"))
    set_quant_type(values(model)["A"], U8)
    set_quant_type(model.graph.inputs[0], PER_AXIS)
    save_onnx(model, tmp_path / "m.onnx")
    again = load_onnx(tmp_path / "m.onnx")
    assert quant_type(values(again)["A"]) == U8
    assert quant_type(again.graph.inputs[0]) == PER_AXIS
    assert "tensor<Nx4x!quant.uniform<u8:f32, 2.000000e-02:128>>" in print_model(again)


def test_a_rewrite_carries_the_annotation_over() -> None:
    model = load_onnx_text(MODEL)
    set_quant_type(values(model)["B"], U8)  # on the Identity's output, which the pass removes
    model, _ = run_passes(model, get_passes("remove-identity"))
    assert "B" not in values(model)
    assert quant_type(values(model)["A"]) == U8


def test_annotations_survive_canonicalize() -> None:
    model = load_onnx_text(MODEL)
    set_quant_type(values(model)["Y"], U8)
    model, _ = run_passes(model, get_passes("canonicalize"))
    assert quant_type(model.graph.outputs[0]) == U8


def test_printer_is_deterministic_and_shows_annotations() -> None:
    model = load_onnx_text(MODEL)
    set_quant_type(values(model)["A"], U8)
    text = print_model(model)
    assert text == print_model(load_onnx(ir.serde.serialize_model(model)))
    # A has no inferred type yet: an annotated value of unknown type prints as an unranked tensor
    assert text.splitlines()[2] == "  %A: tensor<*x!quant.uniform<u8:f32, 2.000000e-02:128>> = Relu(%X)"


def test_verifier_reports_every_problem() -> None:
    model = load_onnx_text(MODEL)
    nodes = list(model.graph)
    nodes[2].outputs[0].name = "A"  # a duplicate name
    model.graph.remove(nodes[0])  # A's producer: its uses now dangle
    with pytest.raises(VerifyError) as info:
        verify_model(model)
    message = str(info.value)
    assert "uses input 0 'A' before it is defined" in message


def test_the_manager_names_the_pass_that_broke_the_ir() -> None:
    from requant.passes import Pass

    class Breaker(Pass):
        name = "breaker"
        recurses_into_subgraphs = False

        def call(self, model: ir.Model) -> ir.passes.PassResult:
            first = next(iter(model.graph))
            model.graph.remove(first)
            return ir.passes.PassResult(model, True)

    with pytest.raises(VerifyError, match="after pass 'breaker'"):
        run_passes(load_onnx_text(MODEL), [Breaker()], PassOptions(verify_each=True))


def test_initializer_annotation_and_integer_values() -> None:
    model = load_onnx_text(
        """
        <ir_version: 10, opset_import: ["" : 21]>
        g (uint8[4] Q) => (float[4] Y) {
            s = Constant <value = float {0.5}> ()
            z = Constant <value = uint8 {3}> ()
            Y = DequantizeLinear(Q, s, z)
        }
        """
    )
    q = model.graph.inputs[0]
    set_quant_type(q, parse_type("!quant.uniform<u8:f32, 0.5:3>"))  # stored values: the storage must match
    with pytest.raises(AnnotationError, match="holds u8 values"):
        set_quant_type(q, parse_type("!quant.uniform<i8:f32, 0.5:3>"))
    w = ir.Value(
        name="W",
        const_value=ir.Tensor(np.ones((4,), np.float32)),
        shape=ir.Shape([4]),
        type=ir.TensorType(ir.DataType.FLOAT),
    )
    set_quant_type(w, parse_type("!quant.uniform<i8:f32:0, {0.1,0.2,0.3,0.4}>"))


def test_a_broken_postcondition_names_the_pass() -> None:
    from requant.passes import Pass
    from requant.passes._manager import PassInvariantError

    class Promises(Pass):
        name = "promises"
        recurses_into_subgraphs = False

        def call(self, model: ir.Model) -> ir.passes.PassResult:
            return ir.passes.PassResult(model, False)

        def ensures(self, model: ir.Model) -> None:
            self.fail_unless(["Relu"], "no Relu remains")

    with pytest.raises(PassInvariantError, match="pass 'promises' broke what it ensures: no Relu remains: Relu"):
        run_passes(load_onnx_text(MODEL), [Promises()])


def test_declared_postconditions_hold_on_canonicalize() -> None:
    # the passes with an ensures() check it on every run; canonicalize on a messy model passes them
    passes = get_passes("canonicalize")
    declared = {p.name for p in passes if type(p).ensures is not ir.passes.InPlacePass.ensures}
    assert {"constants-to-initializers", "remove-identity", "dequantize-per-consumer", "unique-names"} <= declared
    run_passes(load_onnx_text(MODEL), passes)


def test_an_annotation_error_cuts_a_long_type_and_says_how_long_it_was() -> None:
    from requant.ir.annotations import AnnotationError, check_annotation
    from requant.types import UniformQuantizedPerAxisType

    value = ir.Value(name="w", shape=ir.Shape([4, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    many = UniformQuantizedPerAxisType("i8", "f32", 0, list(np.linspace(0.001, 0.002, 500)), [0] * 500)
    with pytest.raises(AnnotationError) as raised:
        check_annotation(value, many)
    message = str(raised.value)
    assert len(message) < 400 and "characters)" in message and "the type has 500 scales" in message
