"""Inputs given once for all: a graph input becomes a constant (an initializer) before canonicalization.

A model whose control flow depends on an input that is really a setting (silero-vad's sample rate,
read by the ``If`` that holds the whole model) keeps its kernels in the ``If``'s branches, which
requant leaves float; with the input a constant, the condition folds and the branch taken joins the
main graph. The fixed inputs' names are kept in the model's metadata (``FIXED_KEY``): samples may
still hold them (they are not fed), and the quantized model no longer takes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from requant.frontends.onnx_loader import LoadError

__all__ = ["FIXED_KEY", "fix_inputs", "fixed_inputs"]

FIXED_KEY = "requant.fixed_inputs"


def fix_inputs(model: ir.Model, values: Mapping[str, Any]) -> None:
    """Make each named graph input of ``model`` a constant holding its given value (changed in place);
    a :class:`LoadError` naming the input when there is none of that name or the value does not fit."""
    graph = model.graph
    by_name = {str(v.name): v for v in graph.inputs}
    for name, given in values.items():
        value = by_name.get(name)
        if value is None:
            raise LoadError(f"fixed input '{name}': the model has no input of that name (its inputs: "
                            f"{', '.join(sorted(by_name))})")  # fmt: skip
        dtype = value.dtype.numpy() if value.dtype is not None else None
        try:
            array = np.asarray(given, dtype=dtype)
        except (TypeError, ValueError) as error:
            raise LoadError(f"fixed input '{name}': {given!r} is not a {value.dtype} value ({error})") from None
        shape = value.shape
        if shape is not None and (
            array.ndim != len(shape)
            or any(isinstance(d, int) and d != n for d, n in zip(shape, array.shape, strict=True))
        ):
            raise LoadError(
                f"fixed input '{name}': the model takes shape {list(shape)}, the value has {list(array.shape)}"
            )
        graph.inputs.remove(value)
        value.const_value = ir.Tensor(np.ascontiguousarray(array), name=name)
        value.shape = ir.Shape(array.shape)
        graph.register_initializer(value)
    if values:
        model.metadata_props[FIXED_KEY] = ",".join(sorted({*fixed_inputs(model), *values}))


def fixed_inputs(model: ir.Model) -> set[str]:
    """The names of the inputs fixed in ``model`` (its metadata)."""
    text = model.metadata_props.get(FIXED_KEY, "")
    return {name for name in text.split(",") if name}
