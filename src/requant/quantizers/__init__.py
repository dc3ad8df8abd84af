"""Quantizers: requests, configs and presets, node finders, pattern matching, composition, decision records.

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
    DEFAULT_PRESET,
    INT4_BLOCKWISE_WEIGHTS,
    INT8_DYNAMIC_LINEAR,
    INT8_FLOAT_BIAS,
    INT8_FLOAT_OUTPUTS,
    INT8_PER_CHANNEL_WEIGHTS,
    INT8_PER_TENSOR,
    INT8_REDUCED_RANGE_WEIGHTS,
    LINEAR_DEFAULT_PRESET,
    PRESETS,
    UINT8_FLOAT_OUTPUTS,
    UINT8_PER_CHANNEL_WEIGHTS,
    DerivedBias,
    QuantizationConfig,
)
from requant.quantizers.finders import (
    All,
    AnyOf,
    Global,
    ModulePath,
    ModuleType,
    NodeFinder,
    NodeName,
    Not,
    OpType,
    Predicate,
)
from requant.quantizers.matcher import PatternMatcher
from requant.quantizers.pattern_quantizer import PatternQuantizer
from requant.quantizers.quantizer import FLOAT, Quantizer, QuantParams, StrictQuantizationError, module_params
from requant.quantizers.records import QuantizerReport
from requant.quantizers.shared import SharedSpecQuantizer

__all__ = [
    "A16W8",
    "DEFAULT_PRESET",
    "DTYPES",
    "FLOAT",
    "GRANULARITIES",
    "INT4_BLOCKWISE_WEIGHTS",
    "INT8_DYNAMIC_LINEAR",
    "INT8_FLOAT_BIAS",
    "INT8_FLOAT_OUTPUTS",
    "INT8_PER_CHANNEL_WEIGHTS",
    "INT8_PER_TENSOR",
    "INT8_REDUCED_RANGE_WEIGHTS",
    "KNOWN_OBSERVERS",
    "LINEAR_DEFAULT_PRESET",
    "PRESETS",
    "UINT8_FLOAT_OUTPUTS",
    "UINT8_PER_CHANNEL_WEIGHTS",
    "All",
    "AnyOf",
    "DerivedBias",
    "DerivedSpec",
    "FixedSpec",
    "Global",
    "ModulePath",
    "ModuleType",
    "NoQuant",
    "NodeFinder",
    "NodeName",
    "Not",
    "OpType",
    "PatternMatcher",
    "PatternQuantizer",
    "Predicate",
    "QuantParams",
    "QuantizationConfig",
    "QuantizationSpec",
    "Quantizer",
    "QuantizerReport",
    "Request",
    "RequestError",
    "SharedSpec",
    "SharedSpecQuantizer",
    "StrictQuantizationError",
    "module_params",
    "parse_request",
    "register_observer",
]
