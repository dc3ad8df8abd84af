"""Annotations on onnx-ir values, through typed functions.

Two kinds: a quantized type ("this value is quantized with this ``!quant``
type", :func:`set_quant_type`) and a quantization request ("quantize this value
so", :func:`set_request`, see :mod:`requant.ir.requests`). Each lives in
``value.meta`` (the object, while a pipeline runs) and is mirrored as text into
``value.metadata_props`` (``requant.type``, ``requant.request``), so a saved
model keeps it and :func:`load_annotations` brings it back after a reload.

onnx-ir does not carry metadata over when a rewrite replaces a value: use
:func:`replace_value` (or :func:`transfer_annotation`) in passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.errors import QuantTypeError, RequantError
from requant.ir.requests import NoQuant, QuantizationSpec, Request, RequestError, parse_request
from requant.types import FLOAT_FORMATS, QuantizedType, TensorType, UniformQuantizedType, parse_type, verify_container

__all__ = [
    "ELEMENT_NAMES",
    "PROP_KEY",
    "REQUEST_KEY",
    "AnnotationError",
    "check_annotation",
    "check_request",
    "element_name",
    "iter_values",
    "load_annotations",
    "quant_type",
    "replace_value",
    "request",
    "set_parameter_type",
    "set_quant_type",
    "set_request",
    "set_stored_values",
    "stored_values",
    "tensor_type_of",
    "transfer_annotation",
]

PROP_KEY = "requant.type"
REQUEST_KEY = "requant.request"
_META_KEY = "requant.quant_type"
_META_REQUEST = "requant.request"
_META_STORED = "requant.stored_values"

# ONNX element types in MLIR's spelling (the ones a quantized type can describe).
ELEMENT_NAMES: dict[ir.DataType, str] = {
    ir.DataType.FLOAT: "f32",
    ir.DataType.FLOAT16: "f16",
    ir.DataType.BFLOAT16: "bf16",
    ir.DataType.DOUBLE: "f64",
    ir.DataType.FLOAT8E4M3FN: "f8E4M3FN",
    ir.DataType.FLOAT8E4M3FNUZ: "f8E4M3FNUZ",
    ir.DataType.FLOAT8E5M2: "f8E5M2",
    ir.DataType.FLOAT8E5M2FNUZ: "f8E5M2FNUZ",
    ir.DataType.FLOAT4E2M1: "f4E2M1FN",
    ir.DataType.INT8: "i8",
    ir.DataType.UINT8: "u8",
    ir.DataType.INT16: "i16",
    ir.DataType.UINT16: "u16",
    ir.DataType.INT32: "i32",
    ir.DataType.UINT32: "u32",
    ir.DataType.INT64: "i64",
    ir.DataType.UINT64: "u64",
    ir.DataType.INT4: "i4",
    ir.DataType.UINT4: "u4",
    ir.DataType.BOOL: "i1",
}


class AnnotationError(RequantError):
    """An annotation does not fit its value (dtype, rank, shape)."""


def element_name(dtype: ir.DataType | None) -> str | None:
    """MLIR's spelling of an ONNX element type, or None when it has none here."""
    return None if dtype is None else ELEMENT_NAMES.get(dtype)


def tensor_type_of(value: ir.Value, element: QuantizedType | str | None = None) -> TensorType:
    """The value's type as a ``TensorType`` (symbolic and unknown dimensions are dynamic)."""
    if element is None:
        element = element_name(value.dtype) or "?"
    if value.shape is None:
        return TensorType(element, None, "unranked")
    dims = tuple(d if isinstance(d, int) else None for d in value.shape)
    return TensorType(element, dims, "ranked")


def _short(t: QuantizedType, limit: int = 160) -> str:
    """A type's text for a message: whole, or cut with how much was left out (a per-channel type
    repeats every scale: tens of kilobytes for a large weight)."""
    text = str(t)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def check_annotation(value: ir.Value, t: QuantizedType) -> None:
    """Raise :class:`AnnotationError` unless ``t`` can describe ``value``.

    A float value must have ``t``'s expressed type; an integer value (stored
    values) must have its storage width and signedness. Per-axis and
    sub-channel types must satisfy the integrity rules against the shape. A type MLIR accepts but
    no target can store (``t.problems()``: a zero point outside the storage type, a block axis given
    twice) is refused here, not when it is parsed.
    """
    dtype = element_name(value.dtype)
    where = f"value '{value.name}'"
    for problem in t.problems():
        raise AnnotationError(f"{where}: annotation {_short(t)} is MLIR's but unusable for a target: {problem}")
    if dtype in FLOAT_FORMATS:
        expressed = t.expressed  # type: ignore[attr-defined]  # every quantized type has one (Any: maybe None)
        if expressed is not None and expressed != dtype:
            raise AnnotationError(f"{where} is {dtype} but its annotation {_short(t)} expresses {expressed}")
    elif dtype is not None:
        storage = getattr(t, "storage", None)
        if storage != dtype:
            raise AnnotationError(f"{where} holds {dtype} values but its annotation {_short(t)} does not store {dtype}")
    try:
        verify_container(tensor_type_of(value, t))
    except QuantTypeError as exc:
        raise AnnotationError(f"{where} of type {tensor_type_of(value)}: annotation {_short(t)}: {exc}") from None


def quant_type(value: ir.Value) -> QuantizedType | None:
    """The value's quantized type, or None."""
    t = value.meta.get(_META_KEY)
    return t if isinstance(t, QuantizedType) else None


def _store(value: ir.Value, meta_key: str, prop_key: str, annotation: object, text: bool = True) -> None:
    """Keep ``annotation`` in ``value.meta`` and (with ``text``) its text in ``metadata_props``; None removes both."""
    value.metadata_props.pop(prop_key, None)
    if annotation is None:
        value.meta.pop(meta_key, None)
    else:
        value.meta[meta_key] = annotation
        if text:
            value.metadata_props[prop_key] = str(annotation)


def set_quant_type(value: ir.Value, t: QuantizedType | None, text: bool = True) -> None:
    """Annotate ``value`` with ``t`` (checked against it); None removes the annotation.

    ``text=False`` keeps the type in memory only, without its text in ``metadata_props`` (so a
    saved model does not carry it).
    """
    if t is not None:
        if not isinstance(t, QuantizedType):
            raise TypeError(f"expected a quantized type from requant.types, got {type(t).__name__}")
        check_annotation(value, t)
    _store(value, _META_KEY, PROP_KEY, t, text)


def set_parameter_type(value: ir.Value, t: QuantizedType) -> None:
    """``set_quant_type`` for a kernel's weight or bias, with the text kept only for a per-tensor type.

    A per-channel type's text repeats every scale in decimal (~1 MB of EfficientNet-Lite0's 6.1 MB,
    and about 10 us a scale to print: ~0.2 s a candidate on MobileNetV2's 18,056 bias scales); the scale and
    zero-point initializers the QDQ writer puts beside the weight hold the same numbers. In memory
    (``value.meta``) the type stays."""
    set_quant_type(value, t, text=isinstance(t, UniformQuantizedType))


def stored_values(value: ir.Value) -> npt.NDArray[np.integer[Any]] | None:
    """The integers a quantized constant is to be stored as, when a step chose them (a weight
    encoding that is not plain rounding); None: ``qcast`` with its type decides."""
    stored = value.meta.get(_META_STORED)
    return stored if isinstance(stored, np.ndarray) else None


def set_stored_values(value: ir.Value, stored: npt.NDArray[np.integer[Any]] | None) -> None:
    """Fix the integers ``value`` (a constant with a quantized type) is stored as; None removes them.
    In memory only: the saved model holds them as the quantized initializer itself."""
    if stored is None:
        value.meta.pop(_META_STORED, None)
        return
    if value.const_value is None or tuple(stored.shape) != tuple(value.const_value.shape.numpy()):
        raise AnnotationError(f"value '{value.name}': stored values of shape {stored.shape} do not fit it")
    value.meta[_META_STORED] = stored


def request(value: ir.Value) -> Request | None:
    """The value's quantization request, or None."""
    r = value.meta.get(_META_REQUEST)
    return r if isinstance(r, Request) else None


def check_request(value: ir.Value, r: Request) -> None:
    """Raise :class:`AnnotationError` unless ``r`` can apply to ``value`` (float, axis within its rank)."""
    where = f"value '{value.name}'"
    dtype = element_name(value.dtype)
    if dtype is not None and dtype not in FLOAT_FORMATS and not isinstance(r, NoQuant):
        raise AnnotationError(f"{where} holds {dtype} values: only float values can be asked to be quantized ({r})")
    if isinstance(r, QuantizationSpec) and r.axis is not None and value.shape is not None:
        rank = len(value.shape)
        if not -rank <= r.axis < rank:
            raise AnnotationError(f"{where} has rank {rank}: axis {r.axis} of {r} is out of range")


def set_request(value: ir.Value, r: Request | None) -> None:
    """Ask for ``value`` to be quantized as ``r`` (checked against it); None removes the request."""
    if r is not None:
        if not isinstance(r, Request):
            raise TypeError(
                f"expected a quantization request (QuantizationSpec, SharedSpec...), got {type(r).__name__}"
            )
        check_request(value, r)
    _store(value, _META_REQUEST, REQUEST_KEY, r)


def transfer_annotation(source: ir.Value, target: ir.Value) -> None:
    """Give ``target`` the annotations (quantized type, request) of ``source``, where it has none."""
    t = quant_type(source)
    if t is not None and quant_type(target) is None:
        set_quant_type(target, t, text=PROP_KEY in source.metadata_props)  # a weight's may have none
    r = request(source)
    if r is not None and request(target) is None:
        set_request(target, r)


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Replace every use of ``old`` by ``new``, graph outputs included, keeping what is known.

    ``new`` gets ``old``'s annotation, type and shape where it has none. If
    ``old`` is a graph output, ``new`` takes its place there and its name, so
    the model's interface does not change; an unnamed ``new`` takes the name too.
    """
    transfer_annotation(old, new)
    was_output = old.is_graph_output()
    if new.type is None:  # what is known of the old value stays known
        new.type = old.type
    if new.shape is None:
        new.shape = old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if (was_output or not new.name) and old.name:  # the surviving value keeps the name users know
        name = old.name
        old.name = None
        new.name = name


def iter_values(graph: ir.Graph | ir.Function) -> Iterator[ir.Value]:
    """Every value of a graph and its subgraphs: inputs, initializers, node outputs."""
    yield from graph.inputs
    if isinstance(graph, ir.Graph):
        yield from graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from attr.as_graph().inputs
                yield from attr.as_graph().initializers.values()
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    yield from sub.inputs
                    yield from sub.initializers.values()


def load_annotations(model: ir.Model) -> int:
    """Parse ``requant.type`` and ``requant.request`` metadata back into annotations; returns the count."""
    kinds: list[tuple[str, Callable[[str], Any], Callable[[ir.Value, Any], None]]] = [
        (PROP_KEY, parse_type, set_quant_type),
        (REQUEST_KEY, parse_request, set_request),
    ]
    count = 0
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for graph in graphs:
        for value in iter_values(graph):
            for key, parse, store in kinds:
                text = value.metadata_props.get(key)
                if text is None:
                    continue
                try:
                    store(value, parse(text))
                except (QuantTypeError, RequestError) as exc:
                    raise AnnotationError(f"value '{value.name}' has an invalid {key} {text!r}: {exc}") from None
                count += 1
    return count
