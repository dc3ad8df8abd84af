"""``requant opt``: passes from the command line, as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODEL = """<ir_version: 10, opset_import: ["" : 21]>
g (float[N,3] X) => (float[N,2] Y) {
    W = Constant <value = float[3,2] {1,-1,2,-2,3,-3}> ()
    m = MatMul(X, W)
    i = Identity(m)
    Y = Relu(i)
}
"""


def opt(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "requant", "opt", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_prints_the_ir_after_a_pipeline(tmp_path: Path) -> None:
    (tmp_path / "m.onnxtxt").write_text(MODEL)
    result = opt(str(tmp_path / "m.onnxtxt"), "-p", "constants-to-initializers,remove-identity")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        'module ir_version=10 opsets={"": 21}',
        "graph g(%X: tensor<Nx3xf32>) -> (%Y: tensor<Nx2xf32>) {",
        "  %W: tensor<3x2xf32> = initializer dense<[[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]]>",
        "  %m: ? = MatMul(%X, %W)",
        "  %Y: tensor<Nx2xf32> = Relu(%m)",
        "  return %Y",
        "}",
    ]


def test_stdin_print_after_all_and_timing() -> None:
    result = opt("-", "-p", "remove-identity,infer-shapes", "--print-ir-after-all", "--time-passes", stdin=MODEL)
    assert result.returncode == 0, result.stderr
    assert "// ----- IR after remove-identity -----" in result.stderr
    assert "// ----- IR after infer-shapes -----" in result.stderr
    assert "remove-identity (changed)" in result.stderr and "total" in result.stderr
    assert "%m: tensor<Nx2xf32> = MatMul(%X, %W)" in result.stdout


def test_saves_and_reloads(tmp_path: Path) -> None:
    (tmp_path / "m.onnxtxt").write_text(MODEL)
    result = opt(str(tmp_path / "m.onnxtxt"), "-p", "canonicalize", "-o", str(tmp_path / "out.onnx"))
    assert result.returncode == 0, result.stderr
    again = opt(str(tmp_path / "out.onnx"), "-p", "remove-identity")
    assert "Relu" in again.stdout and "Identity" not in again.stdout


def test_errors_exit_1_and_write_nothing(tmp_path: Path) -> None:
    (tmp_path / "m.onnxtxt").write_text(MODEL)
    result = opt(str(tmp_path / "m.onnxtxt"), "-p", "canonicalise", "-o", str(tmp_path / "out.onnx"))
    assert result.returncode == 1
    assert "unknown pass 'canonicalise' (did you mean 'canonicalize'?)" in result.stderr
    assert not (tmp_path / "out.onnx").exists()
    broken = opt("-", "-p", "canonicalize", stdin="<ir_version: 10> g (float X) => (float Y) { Y = Relu(X ")
    assert broken.returncode == 1 and "could not parse standard input as ONNX text syntax" in broken.stderr
    missing = opt(str(tmp_path / "none.onnx"), "-p", "canonicalize")
    assert missing.returncode == 1 and "no model file at" in missing.stderr
