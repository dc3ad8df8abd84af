"""Import onnx-ir without importing sympy, which it only needs for symbolic-dimension arithmetic.

onnx-ir 1.1 imports ``sympy`` when it is imported (``onnx_ir/_core.py``) and builds a table of five
sympy functions (``onnx_ir/_symbolic_shapes.py``); importing sympy is 0.35-0.5 s, half of
``import requant.api`` and more than quantizing the bundled digits model. requant never does
arithmetic on symbolic dimensions, so while onnx-ir is imported, ``sympy`` is a stand-in module: the
table gets functions that call sympy's when called, and any other attribute imports the real sympy.
The stand-in leaves ``sys.modules`` as soon as onnx-ir is imported, so ``import sympy`` anywhere else
(torch uses it) gets the real module. When sympy or onnx-ir is already imported, nothing is done.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["import_onnx_ir"]

# The sympy names onnx-ir 1.1 reads while it is imported (its symbolic-expression parser's table).
_TABLE_NAMES = frozenset({"Max", "Min", "floor", "sqrt", "Mod"})


class _Sympy(types.ModuleType):
    """Stands for ``sympy`` until an attribute is needed, then forwards to the real module."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if sys.modules.get("sympy") is self and name in _TABLE_NAMES:
            return _deferred(name)
        value = getattr(_real_sympy(self), name)
        setattr(self, name, value)
        return value


def _real_sympy(proxy: types.ModuleType) -> types.ModuleType:
    if sys.modules.get("sympy") is proxy:
        del sys.modules["sympy"]
    return importlib.import_module("sympy")


def _deferred(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module("sympy"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def import_onnx_ir() -> None:
    """Import ``onnx_ir`` with sympy deferred (see the module's docstring)."""
    if "onnx_ir" in sys.modules or "sympy" in sys.modules:
        return
    proxy = _Sympy("sympy")
    sys.modules["sympy"] = proxy
    try:
        importlib.import_module("onnx_ir")
    finally:
        if sys.modules.get("sympy") is proxy:
            del sys.modules["sympy"]
