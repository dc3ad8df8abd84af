"""Models with control flow (If, Loop): passes keep their subgraphs valid, the runner calibrates the
main graph around them, and ONNX Runtime runs the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant.api
from requant.cli import main
from requant.errors import RequantError
from requant.frontends import load_onnx_text
from requant.ir.verifier import VerifyError
from requant.passes import get_passes, run_passes

WEIGHT = "{1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 1.0}"
IF_MODEL = f"""
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,4] X, bool C) => (float[1,4] Y) {{
    W = Constant <value = float[4,4] {WEIGHT}> ()
    h = MatMul(X, W)
    Y = If (C) <then_branch = then_g () => (float[1,4] t) {{
        t = Relu(h)
    }}, else_branch = else_g () => (float[1,4] e) {{
        e = Identity(h)
    }}>
}}
"""
LOOP_MODEL = f"""
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,4] X) => (float[1,4] Y) {{
    W = Constant <value = float[4,4] {WEIGHT}> ()
    V = Constant <value = float[4,4] {WEIGHT}> ()
    M = Constant <value = int64 {{3}}> ()
    T = Constant <value = bool {{1}}> ()
    a = MatMul(X, W)
    Y = Loop (M, T, a) <body = body (int64 i, bool c, float[1,4] x) => (bool c_out, float[1,4] x_out) {{
        c_out = Identity(c)
        m = MatMul(x, V)
        x_out = Add(m, x)
    }}>
}}
"""


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]  # type: ignore[no-any-return]


def _bound(model: ir.Model, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The int8 MatMul's worst error: half a step of each operand, through the product."""
    scales = {str(v.name): v.const_value.numpy() for v in model.graph.initializers.values() if v.const_value}
    dx, dw = float(scales["X_scale"]) / 2, scales["W_scale"] / 2
    return np.abs(x) @ np.broadcast_to(dw, w.shape) + dx * np.abs(w).sum(0) + len(w) * dx * dw  # type: ignore[no-any-return]


def test_an_if_model_quantizes_and_its_branches_stay_valid() -> None:
    rng = np.random.default_rng(0)
    data = [{"X": rng.uniform(-1, 1, (1, 4)).astype(np.float32), "C": np.array(i % 2 == 0)} for i in range(16)]
    float_model = load_onnx_text(IF_MODEL)
    result = requant.api.quantize(load_onnx_text(IF_MODEL), data, measure=False)
    assert result.report["lint"]["int8_kernels"] == {"MatMulIntegerToFloat": 1}
    w = np.array(eval(WEIGHT.replace("{", "[").replace("}", "]")), np.float32).reshape(4, 4)
    for sample in data:
        got, want = _run(result.model, sample), _run(float_model, sample)
        h = sample["X"] @ w
        assert (np.abs(got - want) <= _bound(result.model, sample["X"], w) + 1e-6).all()  # Relu shrinks errors
        assert np.array_equal(got < 0, (h < 0) & ~sample["C"])  # the branch taken


def test_a_loop_model_quantizes_and_runs() -> None:
    rng = np.random.default_rng(1)
    data = [{"X": rng.uniform(-1, 1, (1, 4)).astype(np.float32)} for _ in range(16)]
    float_model = load_onnx_text(LOOP_MODEL)
    result = requant.api.quantize(load_onnx_text(LOOP_MODEL), data, measure=False)
    assert result.report["lint"]["int8_kernels"] == {"MatMulIntegerToFloat": 1}  # the main graph's MatMul
    # the body's MatMul stays float, and the report says so (silero-vad's whole model is an If's branches)
    (warning,) = result.report["quantizers"]["warnings"]
    (loop,) = [n.name for n in result.model.graph if n.op_type == "Loop"]
    assert warning.startswith(f"1 convolution or linear layer inside the bodies of '{loop}' (If, Loop, Scan) stay")
    assert f"warning: {warning}" in result.report["summary"]
    w = np.array(eval(WEIGHT.replace("{", "[").replace("}", "]")), np.float32).reshape(4, 4)
    growth = np.abs(w + np.eye(4)).sum(0).max() ** 3  # the body, x -> x V + x, three times
    for sample in data:
        error = np.abs(_run(result.model, sample) - _run(float_model, sample))
        assert error.max() <= growth * _bound(result.model, sample["X"], w).max() + 1e-5


def test_a_subgraph_returning_an_outer_value_directly_is_named() -> None:
    broken = load_onnx_text(IF_MODEL)
    (if_node,) = [n for n in broken.graph if n.op_type == "If"]
    else_branch = if_node.attributes["else_branch"].as_graph()
    identity = else_branch.node(0)
    else_branch.outputs[0] = identity.inputs[0]  # what an Identity removed carelessly leaves
    else_branch.remove(identity, safe=False)
    with pytest.raises(VerifyError, match="graph output 0 'h' is a value of an enclosing graph returned directly"):
        run_passes(broken, get_passes("canonicalize"))


def test_requant_opt_verify_each_also_runs_onnx_checker() -> None:
    """What requant's verifier does not know (an op's schema) ONNX's checker does, after every pass."""
    from requant.passes import PassOptions

    model = load_onnx_text(IF_MODEL)
    (matmul,) = [n for n in model.graph if n.op_type == "MatMul"]
    matmul.attributes["transA"] = ir.AttrInt64("transA", 1)  # MatMul has no such attribute
    run_passes(model.clone(), get_passes("remove-identity"))  # requant's own verifier is content
    with pytest.raises(VerifyError, match="after pass 'remove-identity', ONNX's checker rejects the model"):
        run_passes(model, get_passes("remove-identity"), PassOptions(check_onnx=True))


def test_a_relu_after_a_float_output_matmul_does_not_stop_onnx_runtime_fusing_it() -> None:
    """X -> MatMul -> Relu -> Loop: ONNX Runtime's selectors take the Relu for a clamp to drop before a
    QuantizeLinear that is not there, and left the MatMul float; written as Max(x, 0) it fuses."""
    text = LOOP_MODEL.replace("a = MatMul(X, W)", "a0 = MatMul(X, W)\n    a = Relu(a0)")
    rng = np.random.default_rng(2)
    data = [{"X": rng.uniform(-1, 1, (1, 4)).astype(np.float32)} for _ in range(16)]
    result = requant.api.quantize(load_onnx_text(text), data, measure=False)
    lint = result.report["lint"]
    assert lint["int8_kernels"] == {"MatMulIntegerToFloat": 1} and lint["asked_to_be_quantized_but_float"] == []
    assert "Max" in [n.op_type for n in result.model.graph] and "Relu" not in [n.op_type for n in result.model.graph]
    w = np.array(eval(WEIGHT.replace("{", "[").replace("}", "]")), np.float32).reshape(4, 4)
    growth = np.abs(w + np.eye(4)).sum(0).max() ** 3
    float_model = load_onnx_text(text)
    for sample in data:
        error = np.abs(_run(result.model, sample) - _run(float_model, sample))
        assert error.max() <= growth * _bound(result.model, sample["X"], w).max() + 1e-5


FLAG_MODEL = f"""
<ir_version: 10, opset_import: ["" : 21]>
g (float[1,4] X, bool C) => (float[1,4] Y) {{
    W = Constant <value = float[4,4] {WEIGHT}> ()
    Y = If (C) <then_branch = then_g () => (float[1,4] t) {{
        h = MatMul(X, W)
        t = Relu(h)
    }}, else_branch = else_g () => (float[1,4] e) {{
        e = Neg(X)
    }}>
}}
"""


def test_a_fixed_input_folds_the_if_and_its_branch_is_quantized(tmp_path: Path) -> None:
    """The whole model in an If's branch (silero-vad): float, with a warning; with the flag fixed, the
    branch taken is the main graph and its MatMul int8. Samples may still hold the fixed input."""
    rng = np.random.default_rng(2)
    data = [{"X": rng.uniform(-1, 1, (1, 4)).astype(np.float32), "C": np.array(True)} for _ in range(16)]
    plain = requant.api.quantize(load_onnx_text(FLAG_MODEL), data, measure=False)
    assert plain.report["lint"]["int8_kernels"] == {} and "stays float" in plain.report["quantizers"]["warnings"][0]
    fixed = requant.api.quantize(load_onnx_text(FLAG_MODEL), data, measure=False, fixed_inputs={"C": True})
    assert fixed.report["lint"]["int8_kernels"] == {"MatMulIntegerToFloat": 1}
    assert [v.name for v in fixed.model.graph.inputs] == ["X"] and fixed.report["fixed_inputs"] == {"C": True}
    assert "fixed inputs: C = True" in fixed.report["summary"]
    float_model = load_onnx_text(FLAG_MODEL)
    w = np.array(eval(WEIGHT.replace("{", "[").replace("}", "]")), np.float32).reshape(4, 4)
    for sample in data:
        got, want = _run(fixed.model, {"X": sample["X"]}), _run(float_model, sample)
        assert (np.abs(got - want) <= _bound(fixed.model, sample["X"], w) + 1e-6).all()
    with pytest.raises(RequantError, match="fixed input 'D': the model has no input of that name .*C, X"):
        requant.api.quantize(load_onnx_text(FLAG_MODEL), data, measure=False, fixed_inputs={"D": 1})
    # the command line: --fix-input NAME=VALUE; a malformed one is an error before any work
    model, calib, out = tmp_path / "m.onnx", tmp_path / "c.npz", tmp_path / "q.onnx"
    ir.save(load_onnx_text(FLAG_MODEL), model)
    np.savez(calib, X=np.concatenate([d["X"] for d in data]))
    assert (
        main(["quantize", str(model), "-o", str(out), "--calib", str(calib), "--fix-input", "C=1", "--no-measure"]) == 0
    )
    assert [i.name for i in onnx.load(out).graph.input] == ["X"]
    config, from_file = tmp_path / "run.toml", tmp_path / "f.onnx"
    config.write_text("[fixed_inputs]\nC = 1\n")  # a config file's [fixed_inputs] table does the same
    assert main(["quantize", str(model), "-o", str(from_file), "--calib", str(calib), "--config", str(config),
                 "--no-measure"]) == 0  # fmt: skip
    assert [i.name for i in onnx.load(from_file).graph.input] == ["X"]
    bad = tmp_path / "bad.onnx"
    assert main(["quantize", str(model), "-o", str(bad), "--calib", str(calib), "--fix-input", "C"]) != 0
    assert not bad.exists()
