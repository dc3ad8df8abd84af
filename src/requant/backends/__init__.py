"""Backends: write quantization decisions out for a target (QDQ ONNX first)."""

from requant.backends.qdq import ExportError, finish_qdq, materialize_qdq

__all__ = ["ExportError", "finish_qdq", "materialize_qdq"]
