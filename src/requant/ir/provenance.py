"""Where a node came from: the PyTorch module path and class a front door recorded on it."""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["MODULE_CLASS_KEY", "MODULE_PATH_KEY", "module_class", "module_path"]

MODULE_PATH_KEY = "requant.module_path"
MODULE_CLASS_KEY = "requant.module_class"


def module_path(node: ir.Node) -> str | None:
    """The module path recorded for ``node`` (``features.0.conv``; ``""`` for the root), or None."""
    return node.metadata_props.get(MODULE_PATH_KEY)


def module_class(node: ir.Node) -> str | None:
    """The module class recorded for ``node`` (``torch.nn.modules.conv.Conv2d``), or None."""
    return node.metadata_props.get(MODULE_CLASS_KEY)
