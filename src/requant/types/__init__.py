"""Quantized types in MLIR's ``quant`` dialect syntax, and their numeric kernels.

This package imports nothing else of requant's but :mod:`requant.errors`.
"""

from requant.types.floats import FLOAT_FORMATS, FloatFormat
from requant.types.numerics import ROUNDING_MODES, dcast, qcast, scast
from requant.types.params import from_range, storage_bounds, with_scales
from requant.types.quantized import (
    AnyQuantizedType,
    CalibratedQuantizedType,
    QuantizedType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    UniformType,
    normalize,
)
from requant.types.storage import StorageType
from requant.types.syntax import parse_type
from requant.types.tensor import TensorType, parse_tensor_type, verify_cast, verify_container

__all__ = [
    "FLOAT_FORMATS",
    "ROUNDING_MODES",
    "AnyQuantizedType",
    "CalibratedQuantizedType",
    "FloatFormat",
    "QuantizedType",
    "StorageType",
    "TensorType",
    "UniformQuantizedPerAxisType",
    "UniformQuantizedSubChannelType",
    "UniformQuantizedType",
    "UniformType",
    "dcast",
    "from_range",
    "normalize",
    "parse_tensor_type",
    "parse_type",
    "qcast",
    "scast",
    "storage_bounds",
    "verify_cast",
    "verify_container",
    "with_scales",
]
