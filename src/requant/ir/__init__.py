"""requant's graph IR: onnx-ir models with quantization annotations, a printer and a verifier."""

from requant.ir.annotations import (
    AnnotationError,
    check_annotation,
    check_request,
    load_annotations,
    quant_type,
    replace_value,
    request,
    set_quant_type,
    set_request,
    tensor_type_of,
    transfer_annotation,
)
from requant.ir.printer import print_graph, print_model, type_text
from requant.ir.requests import (
    DerivedSpec,
    FixedSpec,
    NoQuant,
    QuantizationSpec,
    Request,
    RequestError,
    SharedSpec,
    parse_request,
)

__all__ = [
    "AnnotationError",
    "DerivedSpec",
    "FixedSpec",
    "NoQuant",
    "QuantizationSpec",
    "Request",
    "RequestError",
    "SharedSpec",
    "check_annotation",
    "check_request",
    "load_annotations",
    "parse_request",
    "print_graph",
    "print_model",
    "quant_type",
    "replace_value",
    "request",
    "set_quant_type",
    "set_request",
    "tensor_type_of",
    "transfer_annotation",
    "type_text",
]
