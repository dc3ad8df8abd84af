"""Where a node came from: the PyTorch module path and class a front door recorded on it, and which
float value a QuantizeLinear quantizes when its input is not that value (a clamp it makes redundant
was dropped: ``requant.backends.qdq``)."""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["MODULE_CLASS_KEY", "MODULE_PATH_KEY", "QUANTIZES_KEY", "module_class", "module_path", "quantizes"]

MODULE_PATH_KEY = "requant.module_path"
MODULE_CLASS_KEY = "requant.module_class"
QUANTIZES_KEY = "requant.quantizes"


def module_path(node: ir.Node) -> str | None:
    """The module path recorded for ``node`` (``features.0.conv``; ``""`` for the root), or None."""
    return node.metadata_props.get(MODULE_PATH_KEY)


def module_class(node: ir.Node) -> str | None:
    """The module class recorded for ``node`` (``torch.nn.modules.conv.Conv2d``), or None."""
    return node.metadata_props.get(MODULE_CLASS_KEY)


def quantizes(node: ir.Node) -> str:
    """The name of the float value a QuantizeLinear quantizes: recorded, or its input's."""
    recorded = node.metadata_props.get(QUANTIZES_KEY)
    if recorded:
        return recorded
    return str(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else ""
