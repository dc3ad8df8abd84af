"""The PyTorch front door: export through dynamo, module paths and classes kept, same numbers in ONNX Runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant
from requant.frontends import LoadError, load_onnx, module_class, module_path, save_onnx
from requant.ir import print_model
from requant.ir.verifier import verify_model
from requant.passes import get_passes, run_passes

torch = pytest.importorskip("torch")
nn = torch.nn


def ort_run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    return np.asarray(session.run(None, {model.graph.inputs[0].name: x})[0])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Any) -> Any:
        return nn.functional.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(Block(), Block())
        self.features[1].conv = nn.Conv2d(4, 4, 3, padding=1)
        self.features[1].bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Any) -> Any:
        return self.head(self.features(x).mean(dim=(2, 3)))


def test_module_paths_and_classes_survive_canonicalize() -> None:
    torch.manual_seed(0)
    net = Net()
    for bn in (net.features[0].bn, net.features[1].bn):  # non-trivial statistics, so folding shows
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    net.train()
    x = torch.randn(2, 3, 8, 8)
    model = requant.load(net, example_inputs=(x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert net.training  # the training flag is restored
    model, _ = run_passes(model, get_passes("canonicalize"))
    verify_model(model)
    ops = {(n.op_type, module_path(n), module_class(n)) for n in model.graph}
    assert ("Conv", "features.0.conv", "torch.nn.modules.conv.Conv2d") in ops
    assert ("Conv", "features.1.conv", "torch.nn.modules.conv.Conv2d") in ops
    assert ("Relu", "features.1", f"{__name__}.Block") in ops  # F.relu belongs to its module
    assert ("Gemm", "head", "torch.nn.modules.linear.Linear") in ops
    assert not any(n.op_type == "BatchNormalization" for n in model.graph)  # folded by requant
    assert str(model.graph.inputs[0].shape[0]) == "batch"
    net.eval()
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(ort_run(model, x.numpy()), expected, rtol=1e-4, atol=1e-5)


def test_export_failure_carries_the_exporters_message() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: Any) -> Any:
            return x[x > 0].reshape(-1, int((x > 0).sum().item()) or 1).sum(dim=1)

    with pytest.raises(LoadError, match=r"torch.onnx.export \(dynamo\) failed for module DataDependent"):
        requant.load(DataDependent(), example_inputs=(torch.randn(4),))


def test_a_wrongly_shaped_example_is_one_line_naming_the_op_and_the_shapes() -> None:
    """torch logs screens of stack traces (every failed fake-tensor op's) and raises an exception with colour codes
    and advice on filing issues for a Linear given a wrong example; requant's error is the exception torch
    summarizes and the example's shapes, and nothing else reaches the terminal (run apart: pytest's own log
    capture would hide torch's printing)."""
    script = (
        "import numpy, torch, requant\n"
        "net, x = torch.nn.Sequential(torch.nn.Linear(16, 8)), torch.randn(1, 12)\n"
        "for run in (lambda: requant.load(net, example_inputs=(x,)), lambda: requant.quantize(net, [x.numpy()], "
        "target='executorch-xnnpack', measure=False)):\n"
        "    try:\n"
        "        run()\n"
        "    except requant.RequantError as e:\n"
        "        print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    why = "RuntimeError: a and b must have same reduction dim, but got [1, 12] X [16, 8]. (example inputs: [1, 12] float32)"
    assert done.stdout.strip().splitlines() == [  # the executorch target's export (torch.export) says it the same way
        f"torch.onnx.export (dynamo) failed for module Sequential: {why}",
        f"torch.export.export failed for module Sequential: {why}",
    ]
    assert "Traceback" not in done.stderr and "\x1b[" not in done.stderr and "torchvision" not in done.stderr, done.stderr


def test_wrong_arguments() -> None:
    with pytest.raises(LoadError, match="needs example_inputs="):
        requant.load(nn.Linear(2, 2))
    with pytest.raises(LoadError, match="expected a torch.nn.Module"):
        from requant.frontends import load_torch

        load_torch(object(), (torch.randn(1),))


def test_digits_cnn_trains_exports_and_runs_the_same(tmp_path: Path) -> None:
    from tests.models.digits import digits_split, train_digits_cnn

    net, accuracy = train_digits_cnn()
    assert accuracy > 0.95, accuracy  # a real model, not a random one
    _, _, x_test, y_test = digits_split()
    batch = torch.export.Dim("batch")
    model = requant.load(net, example_inputs=(torch.from_numpy(x_test[:4]),), dynamic_shapes=({0: batch},))
    model, _ = run_passes(model, get_passes("canonicalize"))
    verify_model(model)
    text = print_model(model)
    assert text.count("= Conv(") == 2 and "BatchNormalization" not in text and "Dropout" not in text
    save_onnx(model, tmp_path / "digits.onnx")
    again = load_onnx(tmp_path / "digits.onnx")
    with torch.no_grad():
        expected = net(torch.from_numpy(x_test)).numpy()
    got = ort_run(again, x_test)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert float((got.argmax(1) == y_test).mean()) == accuracy


def test_torchs_full_text_is_the_errors_detail_and_verbose_prints_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one line stays the message; torch's whole report (no colour codes) is ``detail``, which the command
    line prints after the line with ``--verbose`` and otherwise points to."""
    from requant.cli import main, quantize_cmd

    with pytest.raises(LoadError) as caught:
        requant.load(nn.Sequential(nn.Linear(16, 8)), example_inputs=(torch.randn(1, 12),))
    error = caught.value
    assert "\n" not in str(error) and "must have same reduction dim" in error.detail and "\x1b[" not in error.detail
    assert len(error.detail.splitlines()) > 5  # torch's report: its steps, the exception, its advice

    def failing(args: object) -> int:
        raise error

    monkeypatch.setattr(quantize_cmd, "run", failing)  # the export inside a run: its error, as the CLI gets it
    digits = str(Path(__file__).parent.parent / "examples" / "digits" / "digits_cnn.onnx")
    assert main(["quantize", digits, "-o", "x.onnx", "--calib", "c.npz"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"requant quantize: error: {error}\n") and "requant --verbose" in err and error.detail not in err
    assert main(["--verbose", "quantize", digits, "-o", "x.onnx", "--calib", "c.npz"]) == 1
    assert error.detail in capsys.readouterr().err
