"""requant's graph IR: onnx-ir models with quantization annotations, a printer and a verifier."""

from requant.ir.annotations import (
    AnnotationError,
    check_annotation,
    load_annotations,
    quant_type,
    replace_value,
    set_quant_type,
    tensor_type_of,
    transfer_annotation,
)
from requant.ir.printer import print_graph, print_model, type_text

__all__ = [
    "AnnotationError",
    "check_annotation",
    "load_annotations",
    "print_graph",
    "print_model",
    "quant_type",
    "replace_value",
    "set_quant_type",
    "tensor_type_of",
    "transfer_annotation",
    "type_text",
]
