"""Backends: write quantization decisions out for a target (QDQ ONNX first)."""

from requant.backends.qdq import ExportError, materialize_qdq

__all__ = ["ExportError", "materialize_qdq"]
