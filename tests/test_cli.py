"""The ``requant type`` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from requant.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "requant", *args], capture_output=True, text=True, timeout=60)


def test_type_prints_canonical_text_and_fields() -> None:
    result = run("type", "!quant.uniform<ui8<1:255>:f32, 0.0186:114>")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "!quant.uniform<u8<1:255>:f32, 1.860000e-02:114>",
        "  kind           UniformQuantizedType",
        "  storage        u8",
        "  storage range  [1, 255]",
        "  expressed      f32",
        "  scale          0.0186",
        "  zero point     114",
    ]


def test_type_names_what_mlir_accepts_but_no_target_can_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["type", "!quant.uniform<i8:f32, 2.0:128>"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "!quant.uniform<i8:f32, 2.000000e+00:128>"
    assert lines[-1].split()[:2] == ["unusable", "zero"] and "out of storage type i8 range [-128, 127]" in lines[-1]


def test_type_error_exits_1_with_mlir_message() -> None:
    result = run("type", "!quant.uniform<i8:f32, 3>")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "requant type: error: 1:24: unexpected decimal integer literal for a floating point value "
        "(add a trailing dot to make the literal a float)",
        "  !quant.uniform<i8:f32, 3>",
        "                         ^",
    ]


def test_tensor_is_checked_against_its_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["type", "tensor<2x?x!quant.uniform<i8:f32:0, {0.5, 0.25:3}>>"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [
        "tensor<2x?x!quant.uniform<i8:f32:0, {5.000000e-01,2.500000e-01:3}>>",
        "  shape          2x?",
    ]
    assert main(["type", "tensor<3x!quant.uniform<i8:f32:0, {0.5, 0.25}>>"]) == 1
    assert "quantized dimension size does not match number of scales" in capsys.readouterr().err


def test_sub_channel_shows_grid_and_normal_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["type", "!quant.uniform<i4:f16:{0:1, 1:32}, {{0.1}, {0.2:-1}}>"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "!quant.uniform<i4:f16:{0:1, 1:32}, {{9.997550e-02}, {1.999510e-01:-1}}>"
    assert "  block sizes    axis 0: 1, axis 1: 32" in lines
    assert "  scale grid     2x1" in lines
    # per-axis scales print as doubles: the f16 values need all their digits there
    assert "  normalized     !quant.uniform<i4:f16:0, {0.0999755859375,0.199951171875:-1}>" in lines


def test_usage_errors_exit_2() -> None:
    assert run().returncode == 2
    assert run("nonsense").returncode == 2


def test_a_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run needs no --calib nor -o, and writes neither the model nor a report it is given; its plan is the
    annotation a run makes (the digits CNN: its 3 kernels and their Relu/MaxPool/Reshape, its shape arithmetic
    float), and a flow it cannot plan is refused by name."""
    digits = str(Path(__file__).parent.parent / "examples" / "digits" / "digits_cnn.onnx")
    out, page = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["quantize", digits, "--dry-run", "-o", str(out), "--report-json", str(page)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:5] == [
        "dry run: nothing calibrated, nothing written",
        "target: onnxruntime-cpu",
        "preset: INT8_PER_CHANNEL_WEIGHTS (linear layers: 1, convolutions: 2; int8 kernels)",
        "method: auto (minmax and mean_minmax, the closer to float on held-out calibration samples kept; "
        "stem_percentile for a detector)",
        "would quantize: 7 of 11 nodes (Conv x2, Gemm x1, MaxPool x1, Relu x2, Reshape x1)",
    ]
    assert "  node_Shape_0: Shape is in no pattern of ONNXRUNTIME_CPU_SUPPORT" in printed
    assert not list(tmp_path.iterdir())
    assert main(["quantize", digits, "--dry-run", "--method", "minmax", "--preset", "INT8_PER_TENSOR"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "method: minmax" in printed and printed[2].startswith("preset: INT8_PER_TENSOR")
    assert main(["quantize", digits, "--dry-run", "--target", "executorch-xnnpack"]) != 0
    assert "--dry-run plans the ONNX targets' runs" in capsys.readouterr().err


def test_a_terminated_quantize_removes_its_temporary_files_and_writes_nothing(tmp_path: Path) -> None:
    """SIGTERM (``timeout``, a cancelled job) during calibration: the command unwinds, removing the model copy
    each calibration session writes to a temporary folder (it had stayed: 105 MB of a YOLO's), leaves no output,
    says so in one line and exits 143."""
    import os
    import signal
    import time

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, (cin, cout) in enumerate([(3, 32), (32, 32), (32, 32), (32, 8)]):
        inits.append(numpy_helper.from_array(rng.normal(0, 0.2, (cout, cin, 3, 3)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]  # fmt: skip
        x = f"r{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 160, 160])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 8, 160, 160])], inits)  # fmt: skip
    model = tmp_path / "convs.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), model)
    np.savez(tmp_path / "calib.npz", x=rng.uniform(0, 1, (256, 3, 160, 160)).astype(np.float32))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    out = tmp_path / "q.onnx"
    process = subprocess.Popen([sys.executable, "-m", "requant", "quantize", str(model), "-o", str(out), "--calib",
                                str(tmp_path / "calib.npz"), "--no-measure"], env={**os.environ, "TMPDIR": str(temporary)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(temporary.glob("requant-calibrate-*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.005)
    assert list(temporary.glob("requant-calibrate-*")), "no calibration session seen"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "requant quantize: terminated: temporary files removed, nothing half written"
    assert "Traceback" not in stderr
    # (a dependency leaves a 51-byte ".ses" file in TMPDIR on every run, terminated or not: not requant's)
    assert not list(temporary.glob("requant-*")) and not out.exists() and not list(tmp_path.glob(".q.onnx*"))
