"""The tests whose outcome depends on the CPU, run again as on a CPU without VNNI.

On a CPU with VNNI, ONNX Runtime's uint8 x int8 kernels add exactly, so the tests that check
requant's model of int16 pair saturation against ONNX Runtime (``tests/host.py``) would only ever
check the VNNI side there. This runs them once more in a child pytest under
``bench/ort_without_vnni.py``'s copy of ONNX Runtime, whose CPU dispatch takes the AVX2 kernels:
every CI machine then checks both kernel models against ONNX Runtime's own kernels. On a CPU without
VNNI the suite itself already runs them that way (skipped here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host import MASKED, PAIRS_SATURATE

ROOT = Path(__file__).parent.parent
DEPENDS_ON_THE_CPU = [
    "tests/test_kernel_model.py",
    "tests/test_budget.py::test_a_budget_keeps_the_fewest_worst_kernels_float",
    "tests/test_compare.py::test_it_sees_what_the_int8_kernels_compute_saturation_included",
    "tests/test_lstm.py::test_lstm_weights_are_encoded_so_no_pair_saturates_without_vnni",
    "tests/test_quantize.py::test_lint_finds_the_kernels_that_can_saturate_and_their_worst_error",
]


@pytest.mark.skipif(PAIRS_SATURATE or MASKED, reason="this ONNX Runtime already runs the kernels without VNNI")
def test_the_cpu_dependent_tests_pass_with_the_kernels_of_a_cpu_without_vnni(tmp_path: Path) -> None:
    made = subprocess.run([sys.executable, str(ROOT / "bench" / "ort_without_vnni.py"), str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *DEPENDS_ON_THE_CPU],
                         cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    # under the copy, the VNNI-only skip is gone and the saturating budget test runs
    assert "saturate only on CPUs without VNNI" not in run.stdout
    assert " passed" in run.stdout.splitlines()[-1]
