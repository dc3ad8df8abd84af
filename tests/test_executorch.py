"""The executorch-xnnpack target end to end: a PyTorch module in, a .pte out, run by ExecuTorch's runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

import requant  # noqa: E402
import requant.pt2e  # noqa: E402  (torchao imported quietly first)
from requant.backends.executorch import PteSession, lower_to_pte  # noqa: E402
from requant.backends.executorch.lower import LoweringError  # noqa: E402
from requant.errors import RequantError  # noqa: E402
from requant.frontends import LoadError  # noqa: E402
from requant.options import ArgumentError, Options  # noqa: E402
from requant.quantizers import INT8_DYNAMIC_LINEAR, Quantizer  # noqa: E402
from tests.models.pt2e_cases import make_cancelling_heads, make_residual_net, make_two_input_net  # noqa: E402

TARGET = "executorch-xnnpack"


@pytest.fixture(scope="module")
def digits() -> tuple[Any, float, np.ndarray, np.ndarray, np.ndarray]:
    from tests.models.digits import digits_split, train_digits_cnn

    net, accuracy = train_digits_cnn()
    x_train, _, x_test, y_test = digits_split()
    return net, accuracy, x_train[:128], x_test[:256], y_test[:256]


def _samples(images: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{"x": images[i : i + 1]} for i in range(len(images))]


def test_digits_cnn_to_pte_keeps_its_accuracy(digits: Any, tmp_path: Path) -> None:
    net, accuracy, calib, x_test, y_test = digits
    out = tmp_path / "digits.pte"
    result = requant.quantize(net, _samples(calib), target=TARGET, example_inputs=(torch.from_numpy(calib[:1]),),
                              eval_data=_samples(x_test), output=out)  # fmt: skip
    report = result.report
    assert out.read_bytes() == result.pte
    section = report["executorch"]
    assert section["coverage"] == 1.0 and section["delegates"] == 1, section  # every op in one XNNPACK delegate
    assert section["against_program"]["same"] and abs(section["against_program"]["gap_db"]) < 1.0
    # the written .pte, run again by the runtime: the test set's accuracy within 2 points of float's
    pte = PteSession(out.read_bytes(), ["x"])
    predicted = np.array([pte.run(None, {"x": x_test[i : i + 1]})[0].argmax() for i in range(len(x_test))])
    assert float((predicted == y_test).mean()) >= accuracy - 0.02
    assert report["evaluation"]["top1_agreement"] >= 0.97 and report["evaluation"]["sqnr_db"] > 15
    assert (
        report["latency_ms_batch1"]["quantized"] > 0
        and report["size_bytes"]["quantized"] < report["size_bytes"]["float"]
    )
    assert "executorch: " in report["summary"] and "NOT USABLE" not in report["summary"]
    assert report["outputs"]["parts"][0]["sqnr_db"] > 15 and not report["outputs"]["poor"]  # held out of calibration
    from requant.report.html import to_html

    assert "<h2>ExecuTorch program</h2>" in to_html(report)
    corrected = report["bias_correction"]  # three kernels' biases, kept only where closer on held-out samples
    assert len(corrected["kernels"]) == 3 and (corrected["after"] <= corrected["before"]) == corrected["kept"]
    kernels = [r for r in report["pt2e"]["nodes"] if r["role"] == "kernel"]
    assert len(kernels) == 3 and all(r["decision"] == "int8" for r in kernels)


def test_an_accuracy_budget_keeps_the_kernels_that_lose_most_float_until_it_is_met(digits: Any) -> None:
    """A budget of 1e-5 on 1 - cosine (the int8 .pte's is about 4e-5): the kernels losing the most signal are
    kept float, fewest first, until it is met; each try is in the record, and the kernels kept float say why
    in the quantizer's decisions."""
    net, _, calib, x_test, _ = digits
    result = requant.quantize(net, _samples(calib), target=TARGET, example_inputs=(torch.from_numpy(calib[:1]),),
                              eval_data=_samples(x_test), max_drop=1e-5, metric="cosine", measure=False)  # fmt: skip
    budget = result.report["accuracy_budget"]
    assert budget["first_drop"] > 1e-5 and budget["met"] and budget["final_drop"] <= 1e-5, budget
    assert 1 - result.report["evaluation"]["cosine_similarity"] <= 1e-5
    kept = [k["node"] for k in budget["kept_float"]]
    assert 1 <= len(kept) <= 3 and budget["tries"][0]["kept_float"] == 0
    decisions = {r["node"]: r["decision"] for r in result.report["pt2e"]["nodes"]}
    assert all(decisions[k].startswith("float: the accuracy budget") for k in kept), decisions
    assert f"accuracy budget: 1 - cosine at most 1e-05; {budget['first_drop']:.4f} at first" in result.report["summary"]


def test_same_module_data_and_options_give_the_same_bytes(digits: Any) -> None:
    net, _, calib, _, _ = digits
    runs = [requant.quantize(net, _samples(calib[:32]), target=TARGET, example_inputs=(torch.from_numpy(calib[:1]),),
                             measure=False).pte for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]


def test_a_linear_model_gets_dynamic_linear_layers_close_to_float() -> None:
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    data = np.random.default_rng(0).normal(size=(48, 1, 32)).astype(np.float32)
    samples = [{"input": d} for d in data]
    result = requant.quantize(mlp, samples, target=TARGET, example_inputs=(torch.from_numpy(data[0]),),
                              measure=False)  # fmt: skip
    report = result.report
    assert report["quantizers"]["preset_choice"].startswith("INT8_DYNAMIC_LINEAR")
    assert report["executorch"]["delegated"].get("linear", 0) + report["executorch"]["delegated"].get("addmm", 0) >= 3
    # per-call int8 inputs, per-channel int8 weights: within a few percent of float
    assert report["evaluation"]["cosine_similarity"] > 0.999, report["evaluation"]


def test_smoothing_brings_a_post_norm_block_closer_to_float_at_the_targets_alpha() -> None:
    """The target's default alpha is 0.5 (0.8 on ONNX targets unless given); with it, the .pte of a block whose
    LayerNorm output has outlier channels is closer to float on held-out inputs than without smoothing (measured
    43.7 against 40.5 dB)."""
    from requant.report.outputs import sqnr
    from tests.models.pt2e_cases import make_post_norm_block

    assert Options.create(target=TARGET).smoothing == 0.5 and Options.create().smoothing == 0.8
    assert Options.create(target=TARGET, smoothing=0.8).smoothing == 0.8
    net = make_post_norm_block()
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(1, 6, 16)).astype(np.float32)} for _ in range(96)]
    example = (torch.from_numpy(data[0]["x"]),)
    expected = np.concatenate([net(torch.from_numpy(d["x"])).detach().numpy() for d in data[64:]])
    db, summaries = {}, {}
    for alpha in (None, 0.0):
        given = {} if alpha is None else {"smoothing": alpha}
        result = requant.quantize(net, data[:64], target=TARGET, example_inputs=example, measure=False, **given)
        pte = PteSession(result.pte or b"", ["x"])
        db[alpha] = sqnr(expected, np.concatenate([pte.run(None, d)[0] for d in data[64:]]))
        smoothed = [r["input"] for r in result.report["smoothing"]["inputs"] if r["applied"]]
        assert smoothed == ([] if alpha == 0.0 else ["layer_norm", "add"]), result.report["smoothing"]
        summaries[alpha] = result.report["summary"]
    assert "smoothing (alpha 0.5): 2 linear-layer inputs" in summaries[None] and "smoothing" not in summaries[0.0]
    assert db[None] > db[0.0] + 1.5, db


def test_a_pte_far_from_its_program_is_refused() -> None:
    """A .pte that computes other numbers than the program it was lowered from (here: lowered from the same
    network with other weights) is refused, with the figures, and nothing is written."""
    from requant.calibration.samples import Samples
    from requant.stages import pt2e, pte

    net = make_residual_net()
    data = [{"x": np.random.default_rng(i).normal(size=(1, 3, 8, 8)).astype(np.float32)} for i in range(16)]
    options = Options.create(target=TARGET, example_inputs=(torch.from_numpy(data[0]["x"]),), measure=False)
    exported = pt2e.export_program(net, options)
    other = make_residual_net()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    wrong = lower_to_pte(torch.export.export(other, (torch.from_numpy(data[0]["x"]),)))
    with pytest.raises(LoweringError, match="computes other numbers than the program it was lowered from"):
        pte.check_pte(exported, exported.module, wrong, Samples(data), None, options)


def test_a_pte_departing_from_its_program_is_refused_naming_the_first_op_that_departs() -> None:
    """A real fault of the runtime: a .pte exported from a channels-last example of input ``u`` misreads the
    contiguous ``u`` it is given (test below). The lowered prefixes of the program are bisected: the first op
    that departs is the conv reading ``u`` (its ReLU folded), not one of the two before it reading ``x``."""
    from requant.calibration.samples import Samples
    from requant.stages import pt2e, pte

    rng = np.random.default_rng(0)
    data = [{n: rng.normal(size=(1, 3, 8, 8)).astype(np.float32) for n in ("x", "u")} for _ in range(16)]
    example = tuple(torch.from_numpy(data[0][n]) for n in ("x", "u"))
    options = Options.create(target=TARGET, example_inputs=example, measure=False, method="minmax")
    exported = pt2e.export_program(make_two_input_net(), options)
    run = pt2e.quantize_once(exported, Samples(data), options)
    misread = (example[0], example[1].to(memory_format=torch.channels_last))
    lowered = pte.lower_converted(exported, run.converted, misread)
    with pytest.raises(LoweringError, match=r"first op whose lowered prefix departs: conv2d_2 \(conv2d with relu"):
        pte.check_pte(exported, run.converted, lowered, Samples(data), None, options, example=misread)
    assert pte.check_pte(exported, run.converted, run.lowered, Samples(data), None, options)["executorch"][
        "against_program"]["same"]  # fmt: skip


def test_every_output_is_checked_and_a_far_one_is_said_first(tmp_path: Path) -> None:
    """The second output (two int8 convs that nearly cancel) is far from float while the first is close:
    the summary's first line says which output; keeping the op feeding it float is tried, measured, and
    left out as no closer; the .pte is written (--strict would exit 3)."""
    net = make_cancelling_heads()
    data = [{"x": np.random.default_rng(i).normal(size=(1, 3, 8, 8)).astype(np.float32)} for i in range(48)]
    out = tmp_path / "heads.pte"
    result = requant.quantize(net, data, target=TARGET, example_inputs=(torch.from_numpy(data[0]["x"]),),
                              measure=False, output=out)  # fmt: skip
    checked = result.report["outputs"]
    by_output = {p["output"]: p for p in checked["parts"]}
    assert by_output["linear"]["sqnr_db"] > 30 and by_output["add"]["sqnr_db"] < 10, checked
    assert checked["poor"] == [f"output 'add': SQNR {by_output['add']['sqnr_db']:.1f} dB"]
    assert checked["remedy"]["kept_float"] == ["add"] and not checked["remedy"]["kept"]
    assert result.report["summary"].startswith("NOT USABLE AS IS: output 'add'")
    assert out.read_bytes() == result.pte


def test_the_pte_reads_inputs_in_its_examples_memory_order_and_requant_feeds_contiguous() -> None:
    """ExecuTorch 1.5.1's sharp edge (docs/targets.md): a .pte reads any input tensor in the memory order of
    the example it was exported with, whatever its strides; requant exports from and feeds contiguous ones."""
    from executorch.runtime import Runtime

    net = make_residual_net()
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    channels_last = x.to(memory_format=torch.channels_last)
    pte = lower_to_pte(torch.export.export(net, (x,))).pte
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    with torch.no_grad():
        expected = net(x)
    assert float((method.execute([channels_last])[0] - expected).abs().max()) > 0.05  # misread, silently
    got = PteSession(pte, ["x"]).run(None, {"x": channels_last})[0]
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)


def test_an_onnx_model_is_refused_for_this_target(tmp_path: Path) -> None:
    onnx_path = Path(__file__).parents[1] / "examples" / "digits" / "digits_cnn.onnx"
    out = tmp_path / "m.pte"
    with pytest.raises(LoadError, match="quantizes PyTorch programs"):
        requant.quantize(str(onnx_path), [{"x": np.zeros((1, 1, 8, 8), np.float32)}], target=TARGET, output=out)
    assert not out.exists()


def test_output_suffix_and_dynamic_configs_are_checked_before_any_work() -> None:
    with pytest.raises(ArgumentError, match="writes a .pte program"):
        Options.create(target=TARGET, output="model.onnx")
    with pytest.raises(ArgumentError, match="writes ONNX"):
        Options.create(target="onnxruntime-cpu", output="model.pte")
    with pytest.raises(ArgumentError, match="only the executorch-xnnpack target has such kernels"):
        Options.create(quantizer=Quantizer().set_global(INT8_DYNAMIC_LINEAR))
    zeros = np.zeros((1, 3, 8, 8), np.float32)  # without example_inputs, a sample that shows forward's inputs
    with pytest.raises(RequantError, match=r"the first calibration sample \(a, b\) does not fit .*example_inputs="):
        requant.quantize(make_residual_net(), [{"a": zeros, "b": zeros}], target=TARGET)


def test_cli_quantizes_a_saved_program(digits: Any, tmp_path: Path) -> None:
    net, _, calib, _, _ = digits
    program = torch.export.export(net, (torch.from_numpy(calib[:1]),))
    torch.export.save(program, tmp_path / "digits.pt2")
    np.savez(tmp_path / "calib.npz", x=calib[:32])
    cli = [sys.executable, "-m", "requant", "quantize", str(tmp_path / "digits.pt2"), "--target", TARGET,
           "--calib", str(tmp_path / "calib.npz"), "--no-measure"]  # fmt: skip
    page = tmp_path / "report.md"
    done = subprocess.run([*cli, "-o", str(tmp_path / "digits.pte"), "--report-md", str(page)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "executorch: " in done.stdout and (tmp_path / "digits.pte").stat().st_size > 10_000
    text = page.read_text()
    assert "## Ops inside XNNPACK delegates" in text and "| conv2d | aten.conv2d.default | kernel |" in text
    refused = subprocess.run([*cli, "-o", str(tmp_path / "digits.onnx")], capture_output=True, text=True)
    assert refused.returncode != 0 and "writes a .pte program" in refused.stderr
    assert not (tmp_path / "digits.onnx").exists()
