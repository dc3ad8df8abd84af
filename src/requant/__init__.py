"""requant: a post-training quantization compiler for neural networks."""

from requant.errors import QuantTypeError, RequantError

__all__ = ["QuantTypeError", "RequantError", "__version__"]
__version__ = "0.1.0"
