"""Quantizers: finders, precedence, order independence, every rejection reason, strict mode, module parameters."""

from __future__ import annotations

import json
import logging
from typing import Any

import onnx_ir as ir
import pytest

from requant.frontends import load_onnx_text
from requant.ir import request
from requant.ir.annotations import iter_values
from requant.passes import get_passes, run_passes
from requant.quantizers import (
    A16W8,
    INT4_BLOCKWISE_WEIGHTS,
    INT8_PER_CHANNEL_WEIGHTS,
    INT8_PER_TENSOR,
    Global,
    ModulePath,
    ModuleType,
    NodeName,
    NoQuant,
    OpType,
    PatternMatcher,
    Predicate,
    QuantizationConfig,
    QuantizationSpec,
    Quantizer,
    QuantParams,
    StrictQuantizationError,
)
from requant.targets.onnxruntime_cpu import ONNXRUNTIME_CPU

MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,2,4,4] X, float[2,8] A) => (float[1,2,4,4] Y, float[2,4] G, float[2,8] S) {
    W = Constant <value = float[2,2,1,1] {1.0, -0.5, 0.25, 2.0}> ()
    c = Conv(X, W)
    Y = Relu(c)
    Wm = Constant <value = float[8,4] {1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8}> ()
    G = MatMul(A, Wm)
    S = Sigmoid(A)
}
"""


def model(text: str = MODEL) -> ir.Model:
    m, _ = run_passes(load_onnx_text(text), get_passes("canonicalize"))
    return m


def requests_of(m: ir.Model) -> dict[str, str]:
    return {str(v.name): str(request(v)) for v in iter_values(m.graph) if request(v) is not None}


def test_finders_select_and_describe() -> None:
    m = model()
    by_out = {n.outputs[0].name: n for n in m.graph}
    assert [n.op_type for n in OpType("Conv", "MatMul").find(m)] == ["Conv", "MatMul"]
    assert (
        repr(OpType("Conv") | ~NodeName("x.*", regex=True) & Global())
        == "OpType(Conv) | ~NodeName('x.*', regex=True) & Global()"
    )
    assert [n.op_type for n in (Global() & ~OpType("Relu", "Sigmoid")).find(m)] == ["Conv", "MatMul"]
    assert Predicate(lambda n: n.op_type == "Sigmoid", "sigmoids").find(m) == [by_out["S"]]
    by_out["c"].name = "/features/features.0/conv/Conv"  # an exporter's name scope
    assert ModulePath("features.0").find(m) == [by_out["c"]] and ModulePath("features.0.conv").find(m)
    assert not ModulePath("features.01").find(m)
    by_out["G"].metadata_props["requant.module_class"] = "torch.nn.modules.linear.Linear"
    assert ModuleType("Linear").find(m) == [by_out["G"]]


def test_order_of_independent_selections_changes_nothing() -> None:
    def run(reverse: bool) -> tuple[dict[str, str], Any]:
        m = model()
        q = Quantizer().set_global(INT8_PER_TENSOR)
        calls = [lambda: q.set_op_type("Conv", INT8_PER_CHANNEL_WEIGHTS), lambda: q.set_op_type("MatMul", A16W8)]
        for call in reversed(calls) if reverse else calls:
            call()
        report = q.quantize(m)
        return requests_of(m), sorted(json.dumps(r.to_json(), sort_keys=True) for r in report.records)

    assert run(False) == run(True)


def test_later_selections_win_and_none_keeps_float() -> None:
    m = model()
    q = Quantizer().set_global(INT8_PER_TENSOR).set_op_type("MatMul", A16W8).set_op_type("MatMul", None)
    q.quantize(m)
    got = requests_of(m)
    assert got["G"] == "#requant.float" and got["Wm"] == "#requant.float"  # the last set_op_type applied first
    assert got["Y"] == "#requant.spec<uint8, affine, observer = minmax>"


def test_every_rejection_reason_is_reachable() -> None:
    text = """
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[1,1,2,2,2,2] X3, float[1,2,4,4] X, float[2,2,1,1] Wd, float[2,8] A) => (float[1,1,2,2,2,2] Y3, float[1,2,4,4] Yd, float[1,2,4,4] Y, float[2,4] G, float[1,2,4,4] E) {
        W3 = Constant <value = float[1,1,1,1,1,1] {2.0}> ()
        Y3 = Conv(X3, W3)
        Yd = Conv(X, Wd)
        W = Constant <value = float[2,2,1,1] {1.0, -0.5, 0.25, 2.0}> ()
        Y = Conv(X, W)
        Wm = Constant <value = float[8,4] {1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8}> ()
        G = MatMul(A, Wm)
        E = Erf(X)
    }
    """
    u8 = QuantizationSpec("uint8")

    def reasons(config: QuantizationConfig) -> set[str]:
        m = model(text)
        report = Quantizer().set_global(config).quantize(m)
        return {d.reason for r in report.records for d in r.decisions if d.status == "rejected"}

    def cfg(**kw: Any) -> QuantizationConfig:
        return QuantizationConfig("C", **{"input_activation": u8, "output_activation": u8, **kw})

    int8_axis = QuantizationSpec("int8", True, granularity="per_axis", axis=0)
    found = reasons(cfg(weight=int8_axis))
    assert "ONNX Runtime's int8 Conv is 1-d to 3-d; this one is 4-d (at node)" in found
    assert "Conv weight 'Wd' is not a constant (at node_1)" in found
    assert "Erf is in no pattern of ONNXRUNTIME_CPU_SUPPORT" in found
    assert any(
        "is not an activation type ONNX Runtime runs" in r
        for r in reasons(cfg(input_activation=QuantizationSpec("int32")))
    )
    per_axis_act = QuantizationSpec("uint8", granularity="per_axis", axis=1)
    assert any(
        "must be per tensor on ONNX Runtime, not per_axis" in r for r in reasons(cfg(output_activation=per_axis_act))
    )
    assert any(
        "weight dtype int16 is not one ONNX Runtime runs" in r
        for r in reasons(cfg(weight=QuantizationSpec("int16", True)))
    )
    blocked8 = QuantizationSpec("int8", True, granularity="blockwise", axis=0, block_size=4)
    found = reasons(cfg(weight=blocked8))
    assert any("blockwise weights run in MatMul and Gemm only, not Conv" in r for r in found)
    assert any("mis-fuses 8-bit activations with blockwise 8-bit weights" in r for r in found)
    assert any(
        "4-bit weights need blockwise granularity" in r for r in reasons(cfg(weight=QuantizationSpec("int4", True)))
    )
    # int4 blockwise weights with float activations: the MatMul is accepted (weight-only quantization)
    m = model(text)
    Quantizer().set_op_type("MatMul", INT4_BLOCKWISE_WEIGHTS).quantize(m)
    assert requests_of(m)["Wm"] == "#requant.spec<int4, symmetric, blockwise = 0:32, observer = minmax>"
    # already annotated, and the shared-spec reasons, are in tests/golden/quantizers


def test_selectors_that_match_nothing_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="requant.quantizers"):
        report = Quantizer().set_global(INT8_PER_TENSOR).set_node_name("no_such_node", A16W8).quantize(model())
    assert report.warnings == ["NodeName('no_such_node') selected no node: check the name, path or type"]
    assert "selected no node" in caplog.text


def test_strict_mode_names_the_node_and_the_reason() -> None:
    text = MODEL.replace("G = MatMul(A, Wm)", "G = MatMul(A, Wm)\n    E = Erf(A)").replace(
        "float[2,8] S)", "float[2,8] S, float[2,8] E)"
    )
    Quantizer().set_global(INT8_PER_TENSOR).quantize(model(text))  # not strict: reported only
    with pytest.raises(
        StrictQuantizationError,
        match=r"node_\d+ was asked to be quantized \(INT8_PER_TENSOR, by Global\(\)\) but cannot be: Erf is in no pattern",
    ):
        Quantizer().set_global(INT8_PER_TENSOR).quantize(model(text), strict=True)


def test_report_json_is_stable() -> None:
    first = Quantizer().set_global(INT8_PER_CHANNEL_WEIGHTS).quantize(model()).to_json()
    second = Quantizer().set_global(INT8_PER_CHANNEL_WEIGHTS).quantize(model()).to_json()
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert first["quantizers"][0]["accepted"] == 3 and first["unannotated_nodes"] == []  # Conv->Relu, MatMul, Sigmoid


def test_matcher_takes_the_longest_pattern_and_each_node_once() -> None:
    m = model(
        """
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[2,8] A) => (float[2,4] Y) {
            W = Constant <value = float[8,4] {1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8}> ()
            B = Constant <value = float[4] {1,2,3,4}> ()
            m = MatMul(A, W)
            a = Add(m, B)
            Y = Relu(a)
        }
        """
    )
    # canonicalize fused MatMul+Add into a Gemm; Gemm->Relu is one kernel
    matches, unmatched = PatternMatcher(ONNXRUNTIME_CPU).match(list(m.graph))
    assert [mt.pattern.name for mt in matches] == ["Gemm->Relu"] and not unmatched


def test_module_parameters_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import requant
    from requant.quantizers import module_params

    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.inner = nn.Sequential(nn.Conv2d(4, 4, 1))

        def forward(self, x: Any) -> Any:
            return nn.functional.relu(self.inner(self.conv(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 1)
            self.block = Block()
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x: Any) -> Any:
            return self.head(self.block(self.stem(x)))

    net = Net()
    int16 = QuantizationSpec("int16", True)
    net.block.__quant_params__ = QuantParams(
        weights=QuantizationSpec("int8", True), activations=QuantizationSpec("uint16")
    )  # type: ignore[assignment]
    net.block.inner.__quant_params__ = QuantParams(weights=NoQuant(), activations=NoQuant())  # type: ignore[assignment]
    m = requant.load(net, example_inputs=(torch.randn(1, 3, 4, 4),))
    m, _ = run_passes(m, get_passes("canonicalize"))
    params = module_params(net)
    assert set(params) == {"block", "block.inner"}
    # a dict entry for a module whose source we cannot edit
    params["head"] = QuantParams(weights=QuantizationSpec("int8", True), activations=int16)
    report = Quantizer().set_global(INT8_PER_TENSOR).set_module_params(params).quantize(m)
    by_path = {}
    for record in report.records:
        for d in record.decisions:
            if d.status == "accepted":
                for name in d.nodes:
                    by_path[name] = record.config
    paths = {n.name: n.metadata_props.get("requant.module_path") for n in m.graph}
    configs = {paths[name]: config for name, config in by_path.items()}
    assert configs["stem"] == "INT8_PER_TENSOR"
    assert configs["block.conv"] == "QuantParams(block)"  # inherits its parent's
    assert configs["block.inner.0"] == "QuantParams(block.inner)"  # sets its own: float
    assert configs["block"] == "QuantParams(block)"  # F.relu inside block gets block's
    assert configs["head"] == "QuantParams(head)"


DEPTHWISE = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,2,4,4] X) => (float[1,2,4,4] Y) {
    Wd = Constant <value = float[2,1,1,1] {0.5, -2.0}> ()
    d = Conv <group = 2> (X, Wd)
    Wp = Constant <value = float[2,2,1,1] {1.0, -0.5, 0.25, 2.0}> ()
    Y = Conv(d, Wp)
}
"""


@pytest.mark.parametrize(
    ("preset", "pointwise"),
    [
        ("INT8_REDUCED_RANGE_WEIGHTS", "int8, symmetric, reduced"),
        ("UINT8_PER_CHANNEL_WEIGHTS", "uint8, symmetric"),  # ONNX Runtime's uint8-weight depthwise kernel is slow
    ],
)
def test_depthwise_convs_get_full_range_int8_weights(preset: str, pointwise: str) -> None:
    from requant.quantizers import PRESETS

    m = model(DEPTHWISE)
    report = Quantizer().set_global(PRESETS[preset]).quantize(m)
    requests = requests_of(m)
    assert requests["Wd"] == "#requant.spec<int8, symmetric, per_axis = 0, observer = minmax>"
    assert requests["Wp"] == f"#requant.spec<{pointwise}, per_axis = 0, observer = minmax>"
    notes = {tuple(d.nodes): d.reason for d in report.records[0].decisions}
    assert list(notes.values()) == ["depthwise Conv: full-range int8 weights (int32 kernel)", ""]
    # a config without reduced range is left alone
    m = model(DEPTHWISE)
    Quantizer().set_global(INT8_PER_CHANNEL_WEIGHTS).quantize(m)
    assert (
        requests_of(m)["Wd"]
        == requests_of(m)["Wp"]
        == "#requant.spec<int8, symmetric, per_axis = 0, observer = minmax>"
    )
