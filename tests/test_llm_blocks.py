"""Block weights (requant.llm.blocks) as ONNX Runtime's MatMulNBits runs them, and GPTQ (requant.llm.gptq)
against the textbook computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from requant.encoding.rounding import damped, damped_diagonal
from requant.llm.blocks import (
    Blocked,
    BlockFormat,
    block_scales,
    dequantize,
    pack,
    quantize_with,
    round_to_nearest,
    unpack,
)
from requant.llm.gptq import gptq, inverse_factor
from requant.llm.rounding import METHODS


def _matmul_nbits(x: np.ndarray, blocked: Blocked) -> np.ndarray:
    """``x @ W`` as ONNX Runtime's MatMulNBits computes it from ``pack(blocked)``."""
    fmt, n = blocked.format, blocked.codes.shape[0]
    b, scales, zero_points = pack(blocked)
    a = ir.Value(name="a", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(x.shape)))
    inputs = [a, ir.Value(name="b", const_value=ir.tensor(b)), ir.Value(name="scales", const_value=ir.tensor(scales))]
    if zero_points is not None:
        inputs.append(ir.Value(name="zero_points", const_value=ir.tensor(zero_points)))
    attributes = {"K": blocked.k, "N": n, "bits": fmt.bits, "block_size": fmt.block_size, "accuracy_level": 0}
    node = ir.node("MatMulNBits", inputs, attributes=attributes, domain="com.microsoft", num_outputs=1)
    node.outputs[0].name, node.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([a], node.outputs, nodes=[node], initializers=inputs[1:],
                     opset_imports={"": 21, "com.microsoft": 1})  # fmt: skip
    data = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"a": x})[0])


@pytest.mark.parametrize(
    ("bits", "block_size", "symmetric", "k"),
    [(4, 32, True, 96), (4, 128, False, 200), (8, 64, True, 64), (8, 16, False, 40)],
)
def test_block_weights_run_in_matmul_nbits_as_dequantized(bits: int, block_size: int, symmetric: bool, k: int) -> None:
    """ONNX Runtime's kernel computes x @ dequantize(codes) (float accumulation: within float32 rounding);
    K need not be a multiple of the block size (the padding is zeros)."""
    rng = np.random.default_rng(bits + block_size + k)
    w = rng.normal(size=(k, 24)).astype(np.float32)
    x = rng.normal(size=(5, k)).astype(np.float32)
    blocked = round_to_nearest(w, BlockFormat(bits, block_size, symmetric))
    expected = x @ dequantize(blocked)
    np.testing.assert_allclose(_matmul_nbits(x, blocked), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_round_to_nearest_is_within_half_a_step_and_symmetric_uses_the_whole_code_range() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(256, 8)).astype(np.float32)
    for symmetric in (True, False):
        fmt = BlockFormat(4, 64, symmetric)
        blocked = round_to_nearest(w, fmt)
        step = np.abs(np.repeat(blocked.scales, 64, axis=1)).T  # [K, N]
        # symmetric: the largest magnitude sits on code 0; its opposite value, if any, is clipped at 7 steps
        inside = np.abs(w) < 7 * step if symmetric else np.ones_like(w, bool)
        assert (np.abs(dequantize(blocked) - w)[inside] <= step[inside] / 2 + 1e-6).all()
        assert blocked.codes.min() == 0 and blocked.codes.max() <= 15
    sym = round_to_nearest(w, BlockFormat(4, 64, True))
    extreme = np.abs(w).reshape(4, 64, 8).max(axis=1).T  # [N, blocks]
    np.testing.assert_allclose(np.abs(sym.scales), extreme / 8, rtol=1e-6)


def _textbook_gptq(w: np.ndarray, h: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """GPTQ as its paper writes it (natural order, one input at a time, the inverse Hessian updated by
    removing each input in turn; group scales when a group's first input is reached): the codes [N, K]."""
    k, n = w.shape
    rows = np.asarray(w, np.float64).T.copy()
    hinv = np.linalg.inv(damped(h))
    codes = np.zeros((n, k), np.int64)
    s = z = np.zeros(n)
    for i in range(k):
        if i % fmt.block_size == 0:
            found = block_scales(rows[:, None, i : i + fmt.block_size], fmt)
            s, z = found[0][:, 0].astype(np.float64), found[1][:, 0].astype(np.float64)
        codes[:, i] = np.clip(np.rint(rows[:, i] / s) + z, 0, fmt.top)
        error = (rows[:, i] - (codes[:, i] - z) * s) / hinv[i, i]
        rows[:, i + 1 :] -= np.outer(error, hinv[i, i + 1 :])
        hinv = hinv - np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return codes


def _inputs(k: int, count: int, seed: int) -> np.ndarray:
    """Correlated inputs with a few large channels (a transformer's linear inputs in small)."""
    mix = np.random.default_rng(k).normal(size=(k, k)) / np.sqrt(k) + np.eye(k)  # one distribution per size
    x = np.random.default_rng(seed).normal(size=(count, k)) @ mix
    x[:, :3] *= 8
    return x.astype(np.float32)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_matches_the_textbook_computation_and_beats_nearest_on_its_inputs(symmetric: bool) -> None:
    k, n = 96, 16
    rng = np.random.default_rng(1)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = _inputs(k, 512, seed=2)
    h = x.astype(np.float64).T @ x
    fmt = BlockFormat(4, 32, symmetric)
    ours = gptq(w, h, fmt)
    expected = _textbook_gptq(w, h, fmt)
    assert (ours.codes[:, :k] == expected).mean() > 0.995  # the same, up to rounding ties of float sums
    error = {name: float(((x @ (dequantize(b) - w)) ** 2).mean())
             for name, b in (("gptq", ours), ("nearest", round_to_nearest(w, fmt)))}  # fmt: skip
    assert error["gptq"] < 0.7 * error["nearest"], error
    held_out = _inputs(k, 256, seed=3)
    assert float(((held_out @ (dequantize(ours) - w)) ** 2).mean()) < error["nearest"] * 1.2


@pytest.mark.parametrize("order", ["natural", "activation"])
def test_the_inverse_factor_made_in_place_is_the_factor_of_the_damped_padded_reordered_inverse(order: str) -> None:
    """GPTQ's U: the upper Cholesky factor of the inverse of H damped (an input never seen: 1 on its diagonal),
    padded to whole blocks with an identity and put in the order; computed as written, in float64."""
    k, size = 40, 48
    x = _inputs(k, 128, seed=6)
    x[:, 5] = 0  # an input never seen
    h = x.astype(np.float64).T @ x
    diagonal = damped_diagonal(h)
    perm = np.argsort(-diagonal, kind="stable") if order == "activation" else np.arange(k)
    perm = np.concatenate([perm, np.arange(k, size)])
    padded = np.eye(size)
    padded[:k, :k] = damped(h)
    reordered = padded[np.ix_(perm, perm)]
    expected = np.linalg.cholesky(np.linalg.inv(reordered)).T
    got = inverse_factor(h, diagonal, perm)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max())
    np.testing.assert_array_equal(h, x.astype(np.float64).T @ x)  # H itself untouched


def test_gptq_in_activation_order_keeps_each_blocks_scales_from_the_original_weights() -> None:
    k, n = 64, 8
    rng = np.random.default_rng(4)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = _inputs(k, 256, seed=5)
    fmt = BlockFormat(4, 16, True)
    ours = gptq(w, x.astype(np.float64).T @ x, fmt, order="activation")
    np.testing.assert_array_equal(ours.scales, round_to_nearest(w, fmt).scales)
    nearest = round_to_nearest(w, fmt)
    assert float(((x @ (dequantize(ours) - w)) ** 2).mean()) < float(((x @ (dequantize(nearest) - w)) ** 2).mean())


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_clipping_search_keeps_each_blocks_best_ratio_as_computed_block_by_block(symmetric: bool) -> None:
    """Against the reference: for each output and block, each ratio's scale, its rounding and its error
    e^T H_bb e computed one block at a time; the search keeps the least (the full range when none is less)."""
    from requant.llm.clip import RATIOS, clipped_scales

    k, n, size = 80, 6, 16  # K not a multiple of the block: the last block padded
    rng = np.random.default_rng(8)
    w = rng.standard_t(3, size=(k, n)).astype(np.float32)  # heavy tails: some blocks gain by clipping
    x = _inputs(k, 300, seed=9).astype(np.float64)
    h = x.T @ x
    fmt = BlockFormat(4, size, symmetric)
    scales, zero_points = clipped_scales(w, h, fmt)
    clipped = 0
    for col in range(n):
        for b in range(fmt.blocks(k)):
            lo, hi = b * size, min((b + 1) * size, k)
            block = w[lo:hi, col].astype(np.float64)
            hb = h[lo:hi, lo:hi]
            best = None
            for ratio in RATIOS:
                padded = np.zeros(size)
                padded[: hi - lo] = block * ratio
                s, z = (a[0, 0] for a in block_scales(padded[None, None, :], fmt))
                q = (np.clip(np.rint(block / s) + z, 0, fmt.top) - z) * float(s)
                error = float((q - block) @ hb @ (q - block))
                if best is None or error < best[0] - 1e-12 * abs(best[0]):
                    best = (error, float(s), int(z), ratio)
            assert best is not None
            assert scales[col, b] == pytest.approx(best[1], rel=1e-6) and zero_points[col, b] == best[2]
            clipped += best[3] < 1
    assert clipped > 0
    nearest, ours = round_to_nearest(w, fmt), quantize_with(w, scales, zero_points, fmt)
    assert float(((x @ (dequantize(ours) - w)) ** 2).sum()) < float(((x @ (dequantize(nearest) - w)) ** 2).sum())


def test_each_layer_keeps_the_rounding_with_the_least_output_error_on_its_inputs() -> None:
    """The error read from H is the error of the layer's output on the inputs H came from; the method kept is
    the one with the highest output SQNR, and on correlated inputs with large channels that is a GPTQ."""
    from requant.llm.rounding import METHODS, output_error, round_layer

    k, n = 128, 12
    w = np.random.default_rng(6).normal(size=(k, n)).astype(np.float32)
    x = _inputs(k, 400, seed=7).astype(np.float64)
    h = x.T @ x
    fmt = BlockFormat(4, 32, True)
    nearest = round_to_nearest(w, fmt)
    direct = float(((x @ (dequantize(nearest).astype(np.float64) - w)) ** 2).sum())
    assert output_error(w, nearest, h) == pytest.approx(direct, rel=1e-5)  # its products in float32
    blocked, record = round_layer(w, h, fmt)
    assert set(record["output_sqnr_db"]) == set(METHODS)
    assert record["chosen"] == max(record["output_sqnr_db"], key=record["output_sqnr_db"].get)
    assert (
        "gptq" in record["chosen"]
        and record["output_sqnr_db"][record["chosen"]] > record["output_sqnr_db"]["nearest"] + 1
    )
    signal = float(((x @ w.astype(np.float64)) ** 2).sum())
    assert 10 * np.log10(signal / output_error(w, blocked, h)) == pytest.approx(
        record["output_sqnr_db"][record["chosen"]]
    )


def test_a_models_linear_layers_become_matmul_nbits_that_onnx_runtime_runs_as_rounded() -> None:
    """Two MatMuls with weights of their own: both rewritten (the first rounded against its inputs' moments,
    the second to nearest), the model runs in ONNX Runtime and computes x @ dequantized weights; a weight
    shorter than a block stays float, with the reason."""
    from requant.llm.nbits import to_matmul_nbits

    rng = np.random.default_rng(8)
    w1, w2 = rng.normal(size=(64, 96)).astype(np.float32), rng.normal(size=(96, 16)).astype(np.float32)
    w3 = rng.normal(size=(16, 4)).astype(np.float32)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, 64]))
    weights = [ir.Value(name=n, const_value=ir.tensor(w, name=n)) for n, w in (("w1", w1), ("w2", w2), ("w3", w3))]
    h1 = ir.node("MatMul", [x, weights[0]], name="fc1")
    relu = ir.node("Relu", [h1.outputs[0]], name="relu")
    h2 = ir.node("MatMul", [relu.outputs[0], weights[1]], name="fc2")
    h3 = ir.node("MatMul", [h2.outputs[0], weights[2]], name="head")
    h3.outputs[0].name = "y"
    graph = ir.Graph([x], h3.outputs, nodes=[h1, relu, h2, h3], initializers=weights, opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    data = _inputs(64, 256, seed=9)
    fmt = BlockFormat(4, 32, True)
    records = to_matmul_nbits(model, fmt, {"fc1": data.astype(np.float64).T @ data})
    assert [r["node"] for r in records] == ["fc1", "fc2", "head"]
    assert records[0]["rounding"]["chosen"] in METHODS
    assert records[1]["rounding"] == {"chosen": "nearest", "why": "no input moments"}
    assert records[2]["float"] == "K = 16 is less than one block of 32"
    assert [n.op_type for n in model.graph] == ["MatMulNBits", "Relu", "MatMulNBits", "MatMul"]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": data[:8]})[0]
    stored = {n.name: n for n in model.graph}
    assert stored["fc1"].attributes.get_int("K") == 64 and stored["fc1"].attributes.get_int("N") == 96
    deq = {}
    for name in ("fc1", "fc2"):
        b, scales = (v.const_value.numpy() for v in stored[name].inputs[1:3])
        k = stored[name].attributes.get_int("K")
        deq[name] = dequantize(unpack(b, scales, None, k, fmt))
    expected = np.maximum(data[:8] @ deq["fc1"], 0) @ deq["fc2"] @ w3
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # fc1's stored weight is at least as close on its inputs as nearest's
    nearest = dequantize(round_to_nearest(w1, fmt))
    assert ((data @ (deq["fc1"] - w1)) ** 2).sum() <= ((data @ (nearest - w1)) ** 2).sum() * (1 + 1e-9)


def test_rounded_layers_kept_in_a_folder_are_memory_mapped_and_write_the_same_model(tmp_path: Path) -> None:
    """Each layer's blocks written to the folder as soon as they are rounded and read back memory-mapped (the
    flow then holds none of them): the model is the same as with the blocks in memory."""
    from requant.llm.nbits import to_matmul_nbits

    w = np.random.default_rng(10).normal(size=(64, 24)).astype(np.float32)
    models = []
    for folder in (None, tmp_path):
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, 64]))
        node = ir.node("MatMul", [x, ir.Value(name="w", const_value=ir.tensor(w, name="w"))], name="fc")
        node.outputs[0].name = "y"
        models.append(ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21}), ir_version=10))
        models[-1].graph.initializers["w"] = node.inputs[1]  # type: ignore[index]
        data = _inputs(64, 128, seed=11)
        to_matmul_nbits(models[-1], BlockFormat(4, 32, True), {"fc": data.astype(np.float64).T @ data}, folder=folder)
    stored = models[1].graph.initializers["w_Q"].const_value.numpy()  # type: ignore[union-attr]
    assert isinstance(stored, np.memmap) and Path(stored.filename).parent == tmp_path
    assert ir.to_proto(models[0]).SerializeToString() == ir.to_proto(models[1]).SerializeToString()


def test_the_two_activation_order_gptqs_in_one_pass_give_the_codes_of_two() -> None:
    from requant.llm.clip import clipped_scales
    from requant.llm.rounding import _activation_order_pair

    k, n = 96, 10
    w = np.random.default_rng(10).normal(size=(k, n)).astype(np.float32)
    x = _inputs(k, 300, seed=11).astype(np.float64)
    h = x.T @ x
    fmt = BlockFormat(4, 32, True)
    clip = clipped_scales(w, h, fmt)
    pair = _activation_order_pair(w, h, fmt, clip)
    for method, alone in (("gptq_activation_order", gptq(w, h, fmt, order="activation")),
                          ("clip_gptq", gptq(w, h, fmt, order="activation", given=clip))):  # fmt: skip
        np.testing.assert_array_equal(pair[method].codes, alone.codes)
        np.testing.assert_array_equal(pair[method].scales, alone.scales)


@pytest.mark.parametrize(("bits", "symmetric", "k"), [(4, True, 64), (4, False, 80), (8, False, 96), (8, True, 80)])
def test_stored_bytes_are_what_matmul_nbits_stores(bits: int, symmetric: bool, k: int) -> None:
    from requant.llm.blocks import pack
    from requant.llm.budget import stored_bytes

    fmt = BlockFormat(bits, 32, symmetric)
    b, scales, zero_points = pack(round_to_nearest(np.random.default_rng(1).normal(size=(k, 24)), fmt))
    assert stored_bytes(fmt, k, 24) == b.nbytes + scales.nbytes + (0 if zero_points is None else zero_points.nbytes)


def test_the_budget_promotes_the_most_error_per_byte_that_still_fits() -> None:
    from requant.llm.budget import Candidate, promoted

    layers = [Candidate("a", 10.0, 100), Candidate("b", 30.0, 200), Candidate("c", 8.0, 50), Candidate("d", 1.0, 10)]
    # per byte: c 0.16, b 0.15, a 0.10, d 0.10 (a before d: by name on a tie)
    assert promoted(layers, 260) == ["c", "b", "d"]  # a does not fit after c and b; d does
    assert promoted(layers, 40) == ["d"]
    assert promoted(layers, 0) == []


def test_a_size_budget_gives_8_bits_to_the_layer_that_loses_most_and_is_met() -> None:
    """Two layers of the same shape, the first's inputs ten times the second's: its 4-bit blocks leave 100x the
    output error, so room for one 8-bit layer goes to it; ONNX Runtime runs the model; a budget below the
    all-4-bit size is refused before anything changes."""
    from requant.llm.budget import stored_bytes
    from requant.llm.nbits import BudgetError, to_matmul_nbits

    rng = np.random.default_rng(3)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, 64]))
    ws = [ir.Value(name=f"w{i}", const_value=ir.tensor(rng.normal(size=(64, 64)).astype(np.float32), name=f"w{i}"))
          for i in (1, 2)]  # fmt: skip
    a = ir.node("MatMul", [x, ws[0]], name="loud")
    b = ir.node("MatMul", [x, ws[1]], name="quiet")
    add = ir.node("Add", [a.outputs[0], b.outputs[0]], name="add")
    add.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x], add.outputs, nodes=[a, b, add], initializers=ws, opset_imports={"": 21}),
                     ir_version=10)  # fmt: skip
    data = _inputs(64, 256, seed=4).astype(np.float64)
    moments = {"loud": 100 * data.T @ data, "quiet": data.T @ data}
    fmt = BlockFormat(4, 32, True)
    four, eight = stored_bytes(fmt, 64, 64), stored_bytes(BlockFormat(8, 32, True), 64, 64)
    with pytest.raises(BudgetError, match="more than --max-size"):
        to_matmul_nbits(model, fmt, moments, max_bytes=2 * four - 1)
    assert [n.op_type for n in model.graph] == ["MatMul", "MatMul", "Add"]  # refused before any change
    records = to_matmul_nbits(model, fmt, moments, max_bytes=four + eight)
    assert [r["bits"] for r in records] == [8, 4]
    assert records[0]["budget"]["bits"] == 4 and records[0]["budget"]["output_error"] > 50 * records[1]["rounding"][
        "output_error"]  # fmt: skip
    stored = {n.name: n for n in model.graph}
    assert stored["loud"].attributes.get_int("bits") == 8 and stored["quiet"].attributes.get_int("bits") == 4
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values())
    assert total == four + eight
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": data[:4].astype(np.float32)})[0]
    expected = data[:4] @ (ws[0].const_value.numpy() + ws[1].const_value.numpy())  # type: ignore[union-attr]
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()


@pytest.mark.parametrize("bad", ["nan", "indefinite"])
def test_moments_no_rounding_can_use_are_an_error_naming_the_layer(bad: str) -> None:
    """NaN in a layer's input moments, or moments GPTQ cannot factor once damped (not x x^T: a strong
    off-diagonal), stop the rounding with a requant error that names the layer, not NumPy's."""
    from requant.llm.nbits import RoundingError, to_matmul_nbits

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, 64]))
    w = ir.Value(name="w", const_value=ir.tensor(np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)))
    node = ir.node("MatMul", [x, w], name="proj")
    model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 21}), ir_version=10)
    h = np.eye(64)
    if bad == "nan":
        h[3, 5] = np.nan
    else:
        h[0, 1] = h[1, 0] = 10.0
    message = "layer proj: " + (
        "its calibration inputs hold NaN" if bad == "nan" else "the damped input moments are not"
    )
    with pytest.raises(RoundingError, match=message):
        to_matmul_nbits(model, BlockFormat(4, 32, True), {"proj": h})
