"""The README's two commands: the first one (the main job) runs and says what it did.

CI runs the second one (`make test`) from a clean clone, so by the time this test runs the
environment is exactly what a newcomer gets; this test then runs the first one as written.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent


def readme_commands() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "the README starts with a ```sh block of commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_the_two_commands() -> None:
    assert readme_commands() == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci  # CI runs the README's test command


def test_the_main_job_runs_as_written() -> None:
    result = subprocess.run(readme_commands()[0].split(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    accuracy = re.search(r"accuracy: float ([\d.]+), int8 ([\d.]+)", out)
    assert accuracy is not None, out
    assert float(accuracy.group(2)) >= float(accuracy.group(1)) - 0.01
    assert "int8 kernels: 3 (QGemm x1, QLinearConv x2)" in out
    assert (ROOT / "build" / "digits_cnn_int8.onnx").is_file()
