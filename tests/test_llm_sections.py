"""A decoder cut into sections (requant.llm.sections): which nodes go where, what each section reads and
carries, the models that cannot be cut, and windows run through the sections as through the whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from requant.llm.sections import SectionRun, sections


def _model(names: list[str]) -> ir.Model:
    """``x`` through one ``Add`` of a constant per name (each node named so), then a ``Mul`` of the first
    node's output (a value a later section reads again, as a decoder's attention mask is)."""
    nodes, previous = [], "x"
    for i, name in enumerate(names):
        nodes.append(helper.make_node("Add", [previous, "one"], [f"v{i}"], name=name))
        previous = f"v{i}"
    nodes.append(helper.make_node("Mul", [previous, "v0"], ["y"], name="/lm_head/Mul"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )  # fmt: skip
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))


def test_the_layers_and_what_comes_before_and_after_are_sections() -> None:
    model = _model(["/model/embed/Add", "/model/layers.0/a/Add", "/model/layers.0/b/Add", "/model/between/Add",
                    "/model/layers.1/a/Add"])  # fmt: skip
    found = sections(model.graph, most=0)  # a layer per section
    assert [(s.name, s.nodes, s.inputs, s.carried) for s in found] == [
        ("prologue", (0,), ("x",), ("v0",)),
        ("layers.0", (1, 2, 3), ("v0",), ("v3",)),  # the unnamed node between layers joins the one before
        ("layers.1", (4,), ("v3",), ("v4",)),
        ("epilogue", (5,), ("v4", "v0"), ()),  # v0 read again two sections later
    ]


def test_consecutive_layers_share_a_section_up_to_a_size() -> None:
    names = ["/model/embed/Add", *(f"/model/layers.{i}/Add" for i in range(5))]
    model = _model(names)
    model.graph.initializers["one"].const_value = ir.tensor(np.ones(256, np.float32))  # 1 kB read by each
    assert [s.name for s in sections(model.graph, most=2048)] == ["prologue", "layers.0-1", "layers.2-3",
                                                                   "layers.4", "epilogue"]  # fmt: skip
    assert [s.name for s in sections(model.graph, most=10**6)] == ["prologue", "layers.0-4", "epilogue"]


@pytest.mark.parametrize(
    "names",
    [
        ["/model/embed/Add", "/model/norm/Add"],  # no layer named: nothing to cut by
        ["/model/layers.1/Add", "/model/layers.0/Add"],  # out of order
    ],
)
def test_a_model_that_cannot_be_cut_is_one_section(names: list[str]) -> None:
    found = sections(_model(names).graph)
    assert [(s.name, s.inputs) for s in found] == [("model", ("x",))]
    assert found[0].nodes == tuple(range(len(names) + 1))


def test_windows_run_through_the_sections_give_the_whole_models_values(tmp_path: Path) -> None:
    model = _model(["/model/embed/Add", "/model/layers.0/Add", "/model/layers.1/Add"])
    run = SectionRun(ir.to_proto(model), model.graph, tmp_path, most=0)
    feeds = [{"x": np.array([1.0, -2.0], np.float32)}, {"x": np.array([0.5, 3.0], np.float32)}]
    seen = [
        (s.name, w, sorted(got)) for s, w, got in run.run(feeds, lambda s, w: ["y"] if s.name == "epilogue" else [])
    ]
    given = {"prologue": ["v0"], "layers.0": ["v1"], "layers.1": ["v2"], "epilogue": ["y"]}  # wanted and carried
    assert seen == [(name, w, given[name]) for name in given for w in (0, 1)]
    ys = [got["y"] for s, _, got in run.run(feeds, lambda s, w: ["y"] if s.name == "epilogue" else [])
          if s.name == "epilogue"]  # fmt: skip
    for feed, y in zip(feeds, ys, strict=True):
        np.testing.assert_array_equal(y, (feed["x"] + 3) * (feed["x"] + 1))
    asked = [got for s, _, got in run.run(feeds, lambda s, w: ["v0"] if s.name == "layers.0" else [])
             if s.name == "layers.0"]  # fmt: skip
    np.testing.assert_array_equal(asked[1]["v0"], feeds[1]["x"] + 1)  # a section's input, given as it came


def test_a_section_onnx_runtime_refuses_is_a_clear_error(tmp_path: Path) -> None:
    from requant.llm.decoder import DecoderError

    model = _model(["/model/embed/Add", "/model/layers.0/Add", "/model/layers.1/Add"])
    list(model.graph)[2].op_type = "NoSuchOp"  # layers.1's node
    run = SectionRun(ir.to_proto(model), model.graph, tmp_path, most=0)
    with pytest.raises(DecoderError, match=r"cannot run the model in .* \(its section layers\.1\)"):
        list(run.run([{"x": np.array([1.0, 2.0], np.float32)}], lambda s, w: ["y"] if s.name == "epilogue" else []))
