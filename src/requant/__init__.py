"""requant: a post-training quantization compiler for neural networks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from requant._lazy_sympy import import_onnx_ir

import_onnx_ir()  # before any module of requant imports onnx_ir: it would import sympy (0.4 s)

from requant.errors import QuantTypeError, RequantError  # noqa: E402

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["QuantTypeError", "RequantError", "__version__", "compare", "load", "quantize"]
__version__ = "0.1.0"


def load(source: Any, example_inputs: Any = None, dynamic_shapes: Any = None) -> ir.Model:
    """Load a model (ONNX file, bytes, ``ModelProto``, or a PyTorch module with ``example_inputs``).

    See :func:`requant.frontends.load`; imported lazily so ``import requant`` stays light.
    """
    from requant.frontends import load as _load

    return _load(source, example_inputs, dynamic_shapes)


def quantize(model: Any, calibration_data: Any, **options: Any) -> Any:
    """Quantize ``model`` with ``calibration_data``: :func:`requant.pipeline.quantize` (imported lazily)."""
    from requant.pipeline import quantize as _quantize

    return _quantize(model, calibration_data, **options)


def compare(float_model: Any, quantized_model: Any, data: Any, samples: int | None = None) -> Any:
    """Every tensor a QDQ model quantizes against the float model's, worst SQNR first:
    :func:`requant.report.compare.compare` (imported lazily)."""
    from requant.report.compare import compare as _compare

    return _compare(float_model, quantized_model, data, samples)
