"""Quantizers: requests, configs and presets (node finders, pattern matching and the reporter to come).

The request types are defined in :mod:`requant.ir.requests` (they are annotations on the IR)
and re-exported here, where users meet them.
"""

from requant.ir.requests import (
    DTYPES,
    GRANULARITIES,
    KNOWN_OBSERVERS,
    DerivedSpec,
    FixedSpec,
    NoQuant,
    QuantizationSpec,
    Request,
    RequestError,
    SharedSpec,
    parse_request,
    register_observer,
)
from requant.quantizers.config import (
    A16W8,
    INT4_BLOCKWISE_WEIGHTS,
    INT8_PER_CHANNEL_WEIGHTS,
    INT8_PER_TENSOR,
    PRESETS,
    DerivedBias,
    QuantizationConfig,
)

__all__ = [
    "A16W8",
    "DTYPES",
    "GRANULARITIES",
    "INT4_BLOCKWISE_WEIGHTS",
    "INT8_PER_CHANNEL_WEIGHTS",
    "INT8_PER_TENSOR",
    "KNOWN_OBSERVERS",
    "PRESETS",
    "DerivedBias",
    "DerivedSpec",
    "FixedSpec",
    "NoQuant",
    "QuantizationConfig",
    "QuantizationSpec",
    "Request",
    "RequestError",
    "SharedSpec",
    "parse_request",
    "register_observer",
]
