"""Importing requant stays light: onnx-ir's sympy is deferred until symbolic arithmetic needs it."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_importing_requant_does_not_import_sympy_and_symbolic_dims_still_compute() -> None:
    out = _run(
        "import sys, requant.api, onnx_ir as ir\n"
        "print('sympy' in sys.modules)\n"
        "d = ir.SymbolicDim('max(N, 3)')\n"  # parsing goes through onnx-ir's table of sympy functions
        "print(d + 1, (d * 2).value)\n"
        "import sympy\n"
        "print(type(sys.modules['sympy']).__name__, sympy.Symbol('x') + 1)"
    )
    assert out.splitlines() == ["False", "Max(3, N) + 1 2*Max(3, N)", "module x + 1"]


def test_sympy_imported_first_is_left_alone() -> None:
    out = _run("import sympy, sys, requant.api, onnx_ir._core as c\nprint(c.sympy is sys.modules['sympy'])")
    assert out == "True"
