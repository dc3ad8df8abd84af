"""Node finders: which nodes of a model a quantizer looks at.

Each finder has a readable ``repr`` (the reporter prints it), and they combine with
``&``, ``|`` and ``~``. Module finders read the module path and class the PyTorch front
door records on each node; for ONNX models they fall back to the node's name scope
(``/features/features.0/conv/Conv`` is in module ``features.0.conv``), as exporters
write it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx_ir as ir

from requant.ir.provenance import MODULE_CLASS_KEY, MODULE_PATH_KEY
from requant.ir.queries import op_name
from requant.ir.requests import RequestError

__all__ = [
    "All",
    "AnyOf",
    "Global",
    "ModulePath",
    "ModuleType",
    "NodeFinder",
    "NodeName",
    "Not",
    "OpType",
    "Predicate",
    "module_path_of",
]


def within(path: str, module: str) -> bool:
    """Whether module ``path`` is ``module`` or one of its submodules (``""`` is the whole model)."""
    return not module or path == module or path.startswith(module + ".")


def module_path_of(node: ir.Node) -> str | None:
    """The node's module path: recorded by the PyTorch front door, or read from its name scope."""
    recorded = node.metadata_props.get(MODULE_PATH_KEY)
    if recorded is not None:
        return recorded
    name = node.name or ""
    if not name.startswith("/") or name.count("/") < 2:
        return None
    path = ""
    for part in name.strip("/").split("/")[:-1]:  # the last part is the op
        path = part if not path or part.startswith(path + ".") else f"{path}.{part}"
    return path


class NodeFinder:
    """Selects nodes of a model's main graph, in graph order."""

    def matches(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def find(self, model: ir.Model) -> list[ir.Node]:
        return [node for node in model.graph if self.matches(node)]

    def __and__(self, other: NodeFinder) -> NodeFinder:
        return All((self, other))

    def __or__(self, other: NodeFinder) -> NodeFinder:
        return AnyOf((self, other))

    def __invert__(self) -> NodeFinder:
        return Not(self)


@dataclass(frozen=True, repr=False)
class Global(NodeFinder):
    """Every node."""

    def matches(self, node: ir.Node) -> bool:
        return True

    def __repr__(self) -> str:
        return "Global()"


@dataclass(frozen=True, init=False, repr=False)
class OpType(NodeFinder):
    """Nodes of these op types (standard domain unless written ``domain.Op``)."""

    op_types: tuple[str, ...]

    def __init__(self, *op_types: str) -> None:
        object.__setattr__(self, "op_types", tuple(op_types))

    def matches(self, node: ir.Node) -> bool:
        return op_name(node) in self.op_types

    def __repr__(self) -> str:
        return f"OpType({', '.join(self.op_types)})"


@dataclass(frozen=True, repr=False)
class NodeName(NodeFinder):
    """Nodes with this name, or whose name matches this regular expression (``regex=True``)."""

    name: str
    regex: bool = False

    def __post_init__(self) -> None:
        if self.regex:
            try:
                re.compile(self.name)
            except re.error as exc:
                raise RequestError(f"{self.name!r} is not a regular expression: {exc}") from None

    def matches(self, node: ir.Node) -> bool:
        if self.regex:
            return re.fullmatch(self.name, node.name or "") is not None
        return node.name == self.name

    def __repr__(self) -> str:
        return f"NodeName({self.name!r}{', regex=True' if self.regex else ''})"


@dataclass(frozen=True, repr=False)
class ModulePath(NodeFinder):
    """Nodes run by the module at this path or any of its submodules (``""`` is the whole model)."""

    path: str

    def matches(self, node: ir.Node) -> bool:
        path = module_path_of(node)
        return path is not None and within(path, self.path)

    def __repr__(self) -> str:
        return f"ModulePath({self.path!r})"


@dataclass(frozen=True, init=False, repr=False)
class ModuleType(NodeFinder):
    """Nodes run directly by a module of one of these classes (``Conv2d`` or ``torch.nn.modules.conv.Conv2d``)."""

    classes: tuple[str, ...]

    def __init__(self, *classes: str) -> None:
        object.__setattr__(self, "classes", tuple(classes))

    def matches(self, node: ir.Node) -> bool:
        recorded = node.metadata_props.get(MODULE_CLASS_KEY)
        return recorded is not None and any(recorded == c or recorded.endswith("." + c) for c in self.classes)

    def __repr__(self) -> str:
        return f"ModuleType({', '.join(self.classes)})"


@dataclass(frozen=True, repr=False)
class Predicate(NodeFinder):
    """Nodes for which ``fn(node)`` is true; ``description`` is what the report shows."""

    fn: Callable[[ir.Node], bool]
    description: str

    def matches(self, node: ir.Node) -> bool:
        return bool(self.fn(node))

    def __repr__(self) -> str:
        return f"Predicate({self.description})"


@dataclass(frozen=True, repr=False)
class _Combination(NodeFinder):
    finders: tuple[NodeFinder, ...]

    def __init__(self, finders: Iterable[NodeFinder]) -> None:
        object.__setattr__(self, "finders", tuple(finders))


class All(_Combination):
    """Nodes every finder selects."""

    def matches(self, node: ir.Node) -> bool:
        return all(f.matches(node) for f in self.finders)

    def __repr__(self) -> str:
        return " & ".join(f"({f!r})" if isinstance(f, AnyOf) else repr(f) for f in self.finders)


class AnyOf(_Combination):
    """Nodes any finder selects."""

    def matches(self, node: ir.Node) -> bool:
        return any(f.matches(node) for f in self.finders)

    def __repr__(self) -> str:
        return " | ".join(repr(f) for f in self.finders)


@dataclass(frozen=True, repr=False)
class Not(NodeFinder):
    """Nodes the finder does not select."""

    finder: NodeFinder

    def matches(self, node: ir.Node) -> bool:
        return not self.finder.matches(node)

    def __repr__(self) -> str:
        inner = repr(self.finder)
        return f"~({inner})" if isinstance(self.finder, (All, AnyOf)) else f"~{inner}"
