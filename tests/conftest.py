"""Shared test settings: deterministic hypothesis runs, the golden-update switch, the MLIR oracle."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from requant.runtime import THREADS_VARIABLE
from tests.mlir_oracle import MlirOracle, mlir_available
from tests.models import EXPORTS_FOLDER

_MADE = pytest.StashKey[str]()

# The same examples on every run: CI is deterministic, failures reproduce.
settings.register_profile(
    "default", derandomize=True, deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist's workers, one thread each unless set otherwise (``REQUANT_THREADS=1``,
    ``OMP_NUM_THREADS=1``): ONNX Runtime's spinning thread per core and torch's pool in each worker made the
    heaviest ONNX Runtime tests 16 % slower and the torch ones 34 % (two at a time on 2 cores: 91 -> 79 s,
    88 -> 66 s). One folder for what the run builds once (``tests.models.once_per_run``: the torch exports, the tiny
    decoder's folders), shared by pytest-xdist's workers (they inherit it), removed when the process that
    made it ends."""
    if getattr(config.option, "numprocesses", None):  # workers share the cores: one thread each (inherited)
        os.environ.setdefault(THREADS_VARIABLE, "1")  # requant's ONNX Runtime sessions (requant.runtime)
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch's and OpenBLAS's pools
    if not os.environ.get(EXPORTS_FOLDER):
        os.environ[EXPORTS_FOLDER] = tempfile.mkdtemp(prefix="requant-test-exports-")
        config.stash[_MADE] = os.environ[EXPORTS_FOLDER]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_MADE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[EXPORTS_FOLDER]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files with the current output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def mlir() -> Iterator[MlirOracle]:
    reason = mlir_available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"MLIR bindings are part of the dev install but did not load: {reason}")
        pytest.skip(f"MLIR bindings not available: {reason}")
    oracle = MlirOracle()
    yield oracle
    oracle.close()
