"""Front doors: everything a model can arrive as becomes one onnx-ir model here."""

from requant.frontends.onnx_loader import LoadError, SaveError, load_onnx, load_onnx_text, save_onnx

__all__ = ["LoadError", "SaveError", "load_onnx", "load_onnx_text", "save_onnx"]
