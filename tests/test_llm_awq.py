"""Activation-aware scales (requant.llm.awq): the search against the computation written out on the inputs, and
the folds keep what the model computes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from requant.llm.awq import ALPHAS, ScaleSearch, groups, search
from requant.llm.blocks import BlockFormat, dequantize, round_to_nearest
from requant.llm.nbits import linear_weights

FMT = BlockFormat(4, 32, True)


def _inputs(count: int, k: int, seed: int) -> np.ndarray:
    """Inputs with a few channels much larger than the rest (a transformer's linear inputs in small)."""
    x = np.random.default_rng(seed).normal(size=(count, k))
    x[:, [3, 17, 40]] *= 20
    return x.astype(np.float32)


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_search_scores_each_alpha_by_the_output_error_computed_on_the_inputs(symmetric: bool) -> None:
    """For each alpha: s from the inputs' root mean squares, the weight's rows scaled by s rounded to nearest and
    scaled back, and the error of x @ that against x @ W summed over the inputs. The search tries alpha upwards
    until two do worse than the best: it finds the least of the whole grid, and on inputs with a few large
    channels it is well below unscaled nearest's."""
    k, n = 64, 16
    w = np.random.default_rng(1).normal(size=(k, n)).astype(np.float32)
    x = _inputs(512, k, seed=2).astype(np.float64)
    h = x.T @ x
    fmt = BlockFormat(4, 32, symmetric)
    alpha, s, errors = search([w], h, fmt)
    expected = {}
    rms = np.sqrt((x**2).sum(axis=0))
    for a in ALPHAS:
        scales = rms**a / np.sqrt((rms**a).max() * (rms**a).min())
        stored = dequantize(round_to_nearest((w * scales[:, None]).astype(np.float32), fmt)) / scales[:, None]
        expected[a] = float(((x @ (stored - w)) ** 2).sum())
    tried = list(errors)
    assert tried == list(ALPHAS[: len(tried)]) and len(tried) < len(ALPHAS) and tried[-1] - alpha >= 0.15
    for a in tried:
        np.testing.assert_allclose(errors[a], expected[a], rtol=1e-3)
    assert alpha == min(expected, key=lambda a: expected[a])
    np.testing.assert_allclose(s, rms**alpha / np.sqrt((rms**alpha).max() * (rms**alpha).min()), rtol=1e-12)
    assert alpha > 0 and errors[alpha] < 0.8 * errors[0.0], errors


def _mlp(k: int, hidden: int, seed: int) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """x -> SimplifiedLayerNormalization -> gate, up -> silu(gate) * up -> down -> Relu -> out: the MLP of a
    decoder layer and one layer whose input nothing can take a scale (a Relu makes it)."""
    rng = np.random.default_rng(seed)
    arrays = {"gamma": rng.uniform(0.5, 2, size=k), "wg": rng.normal(size=(k, hidden)),
              "wu": rng.normal(size=(k, hidden)), "wd": rng.normal(size=(hidden, k)), "wo": rng.normal(size=(k, 8))}  # fmt: skip
    arrays = {name: a.astype(np.float32) for name, a in arrays.items()}
    values = {name: ir.Value(name=name, const_value=ir.tensor(a, name=name)) for name, a in arrays.items()}
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, k]))
    norm = ir.node("SimplifiedLayerNormalization", [x, values["gamma"]], attributes={"axis": -1, "epsilon": 1e-5},
                   name="norm")  # fmt: skip
    gate = ir.node("MatMul", [norm.outputs[0], values["wg"]], name="gate")
    up = ir.node("MatMul", [norm.outputs[0], values["wu"]], name="up")
    sig = ir.node("Sigmoid", [gate.outputs[0]], name="sig")
    act = ir.node("Mul", [gate.outputs[0], sig.outputs[0]], name="act")
    mul = ir.node("Mul", [act.outputs[0], up.outputs[0]], name="mul")
    down = ir.node("MatMul", [mul.outputs[0], values["wd"]], name="down")
    relu = ir.node("Relu", [down.outputs[0]], name="relu")
    out = ir.node("MatMul", [relu.outputs[0], values["wo"]], name="out")
    out.outputs[0].name = "y"
    nodes = [norm, gate, up, sig, act, mul, down, relu, out]
    graph = ir.Graph([x], out.outputs, nodes=nodes, initializers=list(values.values()), opset_imports={"": 21})
    return ir.Model(graph, ir_version=10), arrays


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    data = ir.to_proto(model).SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _values(arrays: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    """The MLP's linear layers' inputs, by layer."""
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-5) * arrays["gamma"]
    gate, up = normed @ arrays["wg"], normed @ arrays["wu"]
    mul = gate / (1 + np.exp(-gate)) * up
    return {"gate": normed, "up": normed, "down": mul, "out": np.maximum(mul @ arrays["wd"], 0)}


def test_the_scales_fold_into_the_normalization_and_the_layer_before_the_mul_and_change_no_output() -> None:
    """gate and up share the normalization's output (1/s into its scale), down reads up's output times the
    gate's (1/s into up's columns), out's input comes from a Relu (nothing to fold into: no group). Once the
    scales are applied the float model computes what it did, and each layer's moments are those of its new
    inputs."""
    k, hidden = 64, 96
    model, arrays = _mlp(k, hidden, seed=3)
    x = _inputs(256, k, seed=4)
    before = _run(model, x)
    linear = linear_weights(model.graph)
    found = groups(linear, set(linear))
    assert [(g.layers, g.into) for g in found] == [(["gate", "up"], "norm"), (["down"], "up")]
    moments = {name: v.T @ v for name, v in _values(arrays, x).items()}
    scales = ScaleSearch(linear, found, dict.fromkeys(linear, FMT))
    scales(moments)
    assert [(r["layers"], r["into"]) for r in scales.records] == [(["gate", "up"], "norm"), (["down"], "up")]
    assert all(r["alpha"] > 0 and r["error_ratio"] < 1 for r in scales.records), scales.records
    after = _run(model, x)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    folded = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}  # type: ignore[union-attr]
    assert not np.allclose(folded["gamma"], arrays["gamma"]) and not np.allclose(folded["wu"], arrays["wu"])
    for name, v in _values(folded, x).items():
        np.testing.assert_allclose(moments[name], v.T @ v, rtol=1e-3, atol=1e-6 * np.abs(v.T @ v).max())
    np.testing.assert_array_equal(folded["wo"], arrays["wo"])
