"""Questions about nodes and values that passes, targets and quantizers all ask."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

__all__ = ["DEFAULT_DOMAINS", "constant", "is_op"]

DEFAULT_DOMAINS = ("", "ai.onnx")


def is_op(node: ir.Node, op_type: str) -> bool:
    """Whether ``node`` is the standard ONNX operator ``op_type``."""
    return node.op_type == op_type and node.domain in DEFAULT_DOMAINS


def constant(value: ir.Value | None) -> npt.NDArray[np.generic] | None:
    """The value's data if it is a constant (an initializer or a ``Constant`` node's output)."""
    if value is None:
        return None
    if value.const_value is not None and (value.is_initializer() or value.producer() is None):
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and is_op(producer, "Constant") and "value" in producer.attributes:
        tensor = producer.attributes["value"].as_tensor()
        return tensor.numpy()
    return None
