"""Front doors: everything a model can arrive as becomes one onnx-ir model here."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from requant.frontends.fixed import fix_inputs
from requant.frontends.onnx_loader import (
    LoadError,
    SaveError,
    load_onnx,
    load_onnx_text,
    save_bytes,
    save_onnx,
    save_text,
    serialized_size,
)
from requant.frontends.paths import check_outputs
from requant.frontends.torch_loader import load_torch, module_class, module_path

__all__ = [
    "LoadError",
    "SaveError",
    "check_outputs",
    "load",
    "load_onnx",
    "load_onnx_text",
    "load_torch",
    "module_class",
    "module_path",
    "save_bytes",
    "save_onnx",
    "save_text",
    "serialized_size",
]


def load(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto | ir.Model | Any,
    example_inputs: Sequence[Any] | Any | None = None,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    fixed_inputs: Mapping[str, Any] | None = None,
) -> ir.Model:
    """Load a model from wherever it comes: an ONNX file, bytes or proto, or a PyTorch module.

    A PyTorch module needs ``example_inputs`` (and may take ``dynamic_shapes``). ``fixed_inputs``:
    inputs that become constants of these values (:mod:`requant.frontends.fixed`).
    """
    if hasattr(source, "forward") and hasattr(source, "parameters"):
        if example_inputs is None:
            raise LoadError(f"loading the PyTorch module {type(source).__name__} needs example_inputs= "
                            "(requant.quantize takes them from the first calibration sample)")
        model = load_torch(source, example_inputs, dynamic_shapes)
    elif example_inputs is not None or dynamic_shapes is not None:
        raise LoadError("example_inputs and dynamic_shapes are for PyTorch modules, not ONNX models")
    else:
        model = load_onnx(source)
    if fixed_inputs:
        fix_inputs(model, fixed_inputs)
    return model
