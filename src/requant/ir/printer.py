"""``print_model``: a deterministic, MLIR-like text of a model, one op a line.

::

    module ir_version=10 opsets={"": 21}
    graph main(%X: tensor<Nx3xf32>) -> (%Y: tensor<Nx4x!quant.uniform<u8:f32, 2.000000e-02:3>>) {
      %W: tensor<3x4xf32> = initializer dense<[[1.0, 2.0, 3.0, 4.0], ...]>
      %M: tensor<Nx4xf32> = MatMul(%X, %W) loc("matmul_0")
      %Y: tensor<Nx4x!quant.uniform<u8:f32, 2.000000e-02:3>> = Relu(%M)
      return %Y
    }

- A value's type is printed where the value is defined (graph inputs, initializers,
  node outputs); symbolic dimensions keep their names, unknown ones print ``?``,
  an unknown rank ``*``. An annotated value shows its ``!quant`` type as the element type,
  and its quantization request (``#requant.spec<...>``) after the type.
- Attributes are printed sorted by name; subgraphs (``If``, ``Loop``, ``Scan``) are
  printed inside their node; local functions (logical kernels) follow the main graph.
- Tensors of at most 16 elements print their values; larger ones print their size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from requant.ir.annotations import element_name, quant_type, request
from requant.ir.queries import op_name

__all__ = ["print_graph", "print_model", "type_text"]

_MAX_INLINE = 16
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:/\-]+")


class _Namer:
    """Names for values; values with no name get ``%_0``, ``%_1``... in order of appearance."""

    def __init__(self) -> None:
        self._anonymous: dict[int, str] = {}

    def __call__(self, value: ir.Value | None) -> str:
        if value is None:
            return "none"
        name = value.name
        if not name:
            name = self._anonymous.setdefault(id(value), f"_{len(self._anonymous)}")
        return "%" + (name if _PLAIN_NAME.fullmatch(name) else json.dumps(name))


def _element(value: ir.Value) -> str:
    t = quant_type(value)
    if t is not None:
        return str(t)
    dtype = value.dtype
    if dtype is None:
        return "?"
    return element_name(dtype) or dtype.name.lower()


def _dims(shape: ir.Shape) -> str:
    parts = []
    for d in shape:
        if isinstance(d, int):
            parts.append(str(d))
        else:
            parts.append(d.value if isinstance(d, ir.SymbolicDim) and d.value else "?")
    return "".join(p + "x" for p in parts)


def type_text(value: ir.Value) -> str:
    """``tensor<Nx3xf32>``, ``tensor<*xf32>``, ``seq<...>`` or ``?``: the value's type as printed.

    A quantization request follows the type: ``tensor<Nx3xf32> #requant.spec<int8, ...>``.
    """
    r = request(value)
    return _type_only(value) if r is None else f"{_type_only(value)} {r}"


def _type_only(value: ir.Value) -> str:
    vtype = value.type
    if vtype is None:
        return f"tensor<*x{_element(value)}>" if quant_type(value) is not None else "?"
    if isinstance(vtype, ir.TensorType):
        if value.shape is None:
            return f"tensor<*x{_element(value)}>"
        return f"tensor<{_dims(value.shape)}{_element(value)}>"
    return str(vtype).lower()


def _number(x: object) -> str:
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (np.floating, float)):
        return str(np.float32(x)) if isinstance(x, float) else str(x)
    return str(x)


def _nested(array: np.ndarray) -> str:
    if array.ndim == 0:
        return _number(array[()])
    return "[" + ", ".join(_nested(a) if a.ndim else _number(a[()]) for a in array) + "]"


def _tensor(t: ir.TensorProtocol) -> str:
    dtype = element_name(t.dtype) or t.dtype.name.lower()
    shape = "".join(f"{d}x" for d in t.shape.numpy())
    size = int(np.prod(t.shape.numpy(), dtype=np.int64))
    if size > _MAX_INLINE:
        return f"dense<{size} elements> : tensor<{shape}{dtype}>"
    return f"dense<{_nested(t.numpy())}> : tensor<{shape}{dtype}>"


class _Printer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.name = _Namer()

    def emit(self, indent: int, text: str) -> None:
        self.lines.append("  " * indent + text)

    def attribute(self, attr: ir.Attr, indent: int) -> str:
        if attr.is_ref():
            return f"@{attr.ref_attr_name}"
        kind, value = attr.type, attr.value
        if kind == ir.AttributeType.FLOAT:
            return _number(np.float32(value))
        if kind in (ir.AttributeType.INT,):
            return str(value)
        if kind == ir.AttributeType.STRING:
            return json.dumps(value)
        if kind == ir.AttributeType.FLOATS:
            return "[" + ", ".join(_number(np.float32(v)) for v in value) + "]"
        if kind == ir.AttributeType.INTS:
            return "[" + ", ".join(str(v) for v in value) + "]"
        if kind == ir.AttributeType.STRINGS:
            return "[" + ", ".join(json.dumps(v) for v in value) + "]"
        if kind == ir.AttributeType.TENSOR:
            return _tensor(value)
        if kind == ir.AttributeType.TENSORS:
            return "[" + ", ".join(_tensor(v) for v in value) + "]"
        if kind == ir.AttributeType.GRAPH:
            return self.graph_block(value, "graph", indent)
        if kind == ir.AttributeType.GRAPHS:
            return "[" + ", ".join(self.graph_block(g, "graph", indent) for g in value) + "]"
        return str(value)

    def node(self, node: ir.Node, indent: int) -> None:
        outs = ", ".join(f"{self.name(o)}: {type_text(o)}" for o in node.outputs)
        op = op_name(node)
        if node.overload:
            op += f":{node.overload}"
        args = ", ".join(self.name(v) for v in node.inputs)
        text = f"{outs} = {op}({args})" if outs else f"{op}({args})"
        if node.attributes:
            items = [f"{k} = {self.attribute(node.attributes[k], indent + 1)}" for k in sorted(node.attributes)]
            text += " {" + ", ".join(items) + "}"
        if node.name:
            text += f" loc({json.dumps(node.name)})"
        for i, line in enumerate(text.split("\n")):
            self.lines.append(("  " * indent if i == 0 else "") + line)

    def body(self, graph: ir.Graph | ir.Function, indent: int) -> None:
        if isinstance(graph, ir.Graph):
            for value in graph.initializers.values():
                const = value.const_value
                data = "" if const is None else " " + _tensor(const).split(" : ")[0]
                self.emit(indent, f"{self.name(value)}: {type_text(value)} = initializer{data}")
        for node in graph:
            self.node(node, indent)
        self.emit(indent, "return " + ", ".join(self.name(o) for o in graph.outputs))

    def signature(self, values: Sequence[ir.Value]) -> str:
        return ", ".join(f"{self.name(v)}: {type_text(v)}" for v in values)

    def graph_block(self, graph: ir.Graph, keyword: str, indent: int) -> str:
        inner = _Printer()
        inner.name = self.name
        inputs, outputs = inner.signature(graph.inputs), inner.signature(graph.outputs)
        head = f"{keyword} {graph.name or '_'}({inputs}) -> ({outputs}) {{"
        inner.body(graph, indent + 1)
        return "\n".join([head, *inner.lines, "  " * indent + "}"])

    def function(self, func: ir.Function) -> None:
        name = f"{func.domain}::{func.name}" + (f":{func.overload}" if func.overload else "")
        params = ", ".join(f"{k}" for k in func.attributes)
        attrs = f" attributes [{params}]" if params else ""
        self.emit(0, f"func @{name}({self.signature(func.inputs)}) -> ({self.signature(func.outputs)}){attrs} {{")
        self.body(func, 1)
        self.emit(0, "}")


def _opsets(opsets: Iterable[tuple[str, int]]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in sorted(opsets)) + "}"


def print_graph(graph: ir.Graph) -> str:
    """The text of one graph (and its subgraphs)."""
    printer = _Printer()
    printer.lines.append(printer.graph_block(graph, "graph", 0))
    return "\n".join(printer.lines) + "\n"


def print_model(model: ir.Model) -> str:
    """The text of a model: a header line, the main graph, then its local functions."""
    printer = _Printer()
    header = f"module ir_version={model.ir_version} opsets={_opsets(model.opset_imports.items())}"
    printer.emit(0, header)
    printer.lines.append(printer.graph_block(model.graph, "graph", 0))
    for key in sorted(model.functions):
        printer.function(model.functions[key])
    return "\n".join(printer.lines) + "\n"
