"""Materialize types as QDQ ONNX: what ONNX Runtime (and TensorRT, OpenVINO) fuse into int8 kernels.

- A weight or bias (an initializer with a type) is stored quantized (int8, int4, int32...) and
  read through a ``DequantizeLinear``: per tensor, per axis (``axis``) or blocked (``axis``,
  ``block_size``).
- An activation with a type gets ``QuantizeLinear -> DequantizeLinear`` right after it is
  produced; its consumers read the dequantized value, so ``DQ -> op -> Q`` patterns appear around
  every kernel for the runtime to fuse. A graph output keeps its name on the dequantized value.
  ``Shape`` and ``Size`` need no numbers: they read an int8 kernel's quantized output (a second
  reader of the kernel's float output would keep ONNX Runtime from fusing it; a dequantized copy
  would cost a ``DequantizeLinear`` at run time), and a float op's output as it is.
- Identical types share one pair of scale and zero-point initializers.
- An LSTM with quantized weights becomes ONNX Runtime's ``DynamicQuantizeLSTM``
  (:mod:`requant.backends.dynamic_lstm`): no runtime fuses ``DequantizeLinear -> LSTM``.
- Exporters' debugging metadata (stack traces, FX nodes) and the requests, resolved into types
  by then, are dropped: they can outweigh the int8 weights. Module paths and types stay.

Models whose types need opset 21 (16-bit or 4-bit storage, blocked weights) are converted up
with ONNX's version converter first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.backends.dynamic_lstm import write_dynamic_lstms
from requant.backends.matmul_to_float import write_matmul_integer_to_float
from requant.errors import RequantError
from requant.ir.annotations import (
    iter_values,
    quant_type,
    replace_value,
    set_parameter_type,
    set_quant_type,
    set_request,
    stored_values,
)
from requant.ir.provenance import QUANTIZES_KEY, RESCALE_KEY
from requant.ir.queries import clamp_bounds, constant, fresh_name, graph_values, is_op, pads_with_zero
from requant.passes._rewrite import drop_if_unused, with_opset
from requant.quantizers.pattern_quantizer import ANNOTATED_KEY, asks_for_int8
from requant.quantizers.shared import SharedSpecQuantizer
from requant.types import (
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    UniformType,
    qcast,
)

__all__ = ["ExportError", "finish_qdq", "materialize_qdq"]

log = logging.getLogger("requant.backends")

STORAGE_DTYPES: dict[str, ir.DataType] = {
    "i8": ir.DataType.INT8,
    "u8": ir.DataType.UINT8,
    "i16": ir.DataType.INT16,
    "u16": ir.DataType.UINT16,
    "i32": ir.DataType.INT32,
    "i4": ir.DataType.INT4,
    "u4": ir.DataType.UINT4,
}
_FLOATS = {"f32": np.float32, "f16": np.float16, "f64": np.float64}
_UNIFORM = (UniformQuantizedType, UniformQuantizedPerAxisType, UniformQuantizedSubChannelType)


class ExportError(RequantError):
    """A type that ONNX's QuantizeLinear/DequantizeLinear cannot express."""


@dataclass(frozen=True)
class _Params:
    scale: ir.Value
    zero_point: ir.Value
    attributes: dict[str, int]


def _needed_opset(types: list[UniformType]) -> int:
    needed = 13
    for t in types:
        if t.storage in ("i16", "u16", "i4", "u4") or isinstance(t, UniformQuantizedSubChannelType):
            needed = 21
    return needed


def _arrays(t: UniformType, name: str) -> tuple[npt.NDArray[Any], npt.NDArray[Any], dict[str, int]]:
    float_type = _FLOATS.get(t.expressed)
    if float_type is None:
        raise ExportError(f"value '{name}': ONNX scales are float32, float16 or double, not {t.expressed}")
    if t.storage not in STORAGE_DTYPES:
        raise ExportError(f"value '{name}': ONNX has no {t.storage} quantized type ({', '.join(STORAGE_DTYPES)})")
    narrow = t.storage in ("i8", "u8") and (t.storage_min, t.storage_max) in ((-127, 127), (1, 255))
    if t.has_storage_bounds and not narrow:
        log.info("value '%s': storage bounds %s are kept by the scale choice, not by ONNX", name, t)
    storage = t.storage_type.numpy_dtype
    if isinstance(t, UniformQuantizedType):
        return np.array(t.scale, float_type), np.array(t.zero_point, storage), {}
    if isinstance(t, UniformQuantizedPerAxisType):
        return np.array(t.scales, float_type), np.array(t.zero_points, storage), {"axis": t.axis}
    blocked = [(axis, size) for axis, size in t.block_sizes if size > 1]
    if len(blocked) != 1:
        raise ExportError(f"value '{name}': ONNX blocks exactly one axis; this type blocks {len(blocked)}: {t}")
    axis, size = blocked[0]
    attributes = {"axis": axis, "block_size": size}
    return t.scales.astype(float_type), t.zero_points.astype(storage), attributes


def _tensor(array: npt.NDArray[Any], dtype: ir.DataType, name: str) -> ir.TensorProtocol:
    if dtype in (ir.DataType.INT4, ir.DataType.UINT4):
        return ir.Tensor(array, dtype=dtype, name=name)
    return ir.Tensor(np.array(array, order="C", copy=True), name=name)  # (ascontiguousarray makes 0-d 1-d)


class _Builder:
    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.cache: dict[UniformType, _Params] = {}
        self.taken: set[str | None] = {v.name for v in graph_values(graph)}

    def name(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def initializer(self, base: str, array: npt.NDArray[Any], dtype: ir.DataType | None = None) -> ir.Value:
        name = self.name(base)
        tensor = _tensor(array, dtype or ir.DataType.from_numpy(array.dtype), name)
        value = ir.Value(
            name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype), const_value=tensor
        )
        self.graph.register_initializer(value)
        return value

    def params(self, t: UniformType, owner: str) -> _Params:
        if t not in self.cache:  # types compare by value: equal types share their initializers
            scale, zero_point, attributes = _arrays(t, owner)
            self.cache[t] = _Params(
                self.initializer(f"{owner}_scale", scale),
                self.initializer(f"{owner}_zero_point", zero_point, STORAGE_DTYPES[t.storage]),
                attributes,
            )
        return self.cache[t]

    def node(self, op: str, inputs: list[ir.Value], attributes: dict[str, int], out: str) -> ir.Node:
        attrs = [ir.AttrInt64(k, v) for k, v in attributes.items()]
        node = ir.Node("", op, inputs=inputs, attributes=attrs, num_outputs=1)
        node.outputs[0].name = self.name(out)
        return node


def _weight(builder: _Builder, value: ir.Value, t: UniformType, first: ir.Node) -> None:
    assert value.const_value is not None
    name = str(value.name)
    chosen = stored_values(value)  # a weight encoding's integers (requant.encoding.weight_encoding)
    stored = chosen.astype(t.storage_type.numpy_dtype) if chosen is not None else qcast(value.const_value.numpy(), t)
    quantized = builder.initializer(f"{name}_quantized", stored, STORAGE_DTYPES[t.storage])
    set_parameter_type(quantized, t)
    params = builder.params(t, name)
    dq = builder.node("DequantizeLinear", [quantized, params.scale, params.zero_point], params.attributes, f"{name}_dq")
    out = dq.outputs[0]
    out.type, out.shape = value.type, value.shape
    builder.graph.insert_before(first, dq)
    del builder.graph.initializers[name]
    replace_value(value, out)
    out.name = name  # consumers read the weight under its own name
    set_quant_type(out, None)


_READS_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _int8_nodes(graph: ir.Graph) -> set[int] | None:
    """The nodes whose ports carry quantized values: int8 kernels, the data movement between them, and
    the rescales propagation put before an op bound to one type.

    None when no quantizer marked any node (types set by hand): then every consumer of a typed
    value reads it quantized. (Not "nodes with a quantized output": a float op's output gets a
    type when an int8 kernel reads it.)
    """
    shared = SharedSpecQuantizer().describe()
    marks = [(n, n.metadata_props.get(ANNOTATED_KEY, "")) for n in graph]
    if not any(by for _, by in marks):
        return None
    return {id(n) for n, by in marks if asks_for_int8(by) or by == shared or RESCALE_KEY in n.metadata_props}


def _activation(builder: _Builder, value: ir.Value, t: UniformType, first: ir.Node, int8: set[int] | None) -> None:
    name = str(value.name)
    uses = [u for u in value.uses() if not any(is_op(u.node, op) for op in _READS_SHAPE_ONLY)]
    was_output = value.is_graph_output()
    producer = value.producer()
    if int8 is not None and (producer is None or id(producer) not in int8):
        # a float op's output: its float consumers (a residual sum beside a linear layer) keep
        # reading it unquantized; only int8 kernels read the dequantized value. (An int8 kernel's
        # output has no float value once ONNX Runtime fuses its QuantizeLinear: all read that.)
        uses = [u for u in uses if id(u.node) in int8]
        was_output = False
    if not uses and not was_output:
        return  # only float ops or its shape read it: nothing to quantize
    params = builder.params(t, name)
    q = builder.node("QuantizeLinear", [value, params.scale, params.zero_point], params.attributes, f"{name}_quantized")
    quantized = q.outputs[0]
    quantized.type = ir.TensorType(STORAGE_DTYPES[t.storage])
    quantized.shape = value.shape
    dq = builder.node("DequantizeLinear", [quantized, params.scale, params.zero_point], params.attributes, f"{name}_dq")
    out = dq.outputs[0]
    out.type, out.shape = value.type, value.shape
    if producer is not None:
        builder.graph.insert_after(producer, [q, dq])
    else:
        builder.graph.insert_before(first, [q, dq])
    for use in uses:
        use.node.replace_input_with(use.idx, out)
    if producer is not None and (int8 is None or id(producer) in int8):
        # an int8 kernel's output: its shape is read from the quantized value, so the kernel's only reader
        # is its QuantizeLinear (ONNX Runtime fuses no op whose output has another reader)
        for use in [u for u in value.uses() if any(is_op(u.node, op) for op in _READS_SHAPE_ONLY)]:
            use.node.replace_input_with(use.idx, quantized)
    if was_output:
        for i, output in enumerate(builder.graph.outputs):
            if output is value:
                builder.graph.outputs[i] = out
        value.name, out.name = builder.name(f"{name}_float"), name
    set_quant_type(quantized, t)


_DEBUG_KEYS = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.onnxscript.rewriter.rule_name", "namespace")


def _strip_debug_metadata(model: ir.Model) -> None:
    """Drop exporters' debugging text (stack traces, FX nodes) and resolved requests from the output.

    They can outweigh an int8 model's weights; requant's own module path and class, and the
    quantized types, stay.
    """
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key in _DEBUG_KEYS:
            node.metadata_props.pop(key, None)
    for value in iter_values(model.graph):
        set_request(value, None)


def materialize_qdq(model: ir.Model) -> ir.Model:
    """Write every type on the main graph's values as QuantizeLinear/DequantizeLinear; returns the model.

    The returned model may be a new object (when the opset had to be raised).
    """
    graph = model.graph
    write_dynamic_lstms(model)  # first: their weights' types are written there, not as QDQ
    typed = [(v, t) for v in graph_values(graph) if isinstance(t := quant_type(v), _UNIFORM)]
    if not typed:
        return model
    needed = _needed_opset([t for _, t in typed])
    current = model.opset_imports.get("", 0)
    if current < needed:
        log.info("raising the opset from %d to %d for the quantized types (ONNX's version converter)", current, needed)
        return materialize_qdq(with_opset(model, needed))
    _strip_debug_metadata(model)
    builder = _Builder(graph)
    first = next(iter(graph))
    int8 = _int8_nodes(graph)
    for value, t in typed:
        if value.const_value is not None and value.is_initializer() and not value.is_graph_input():
            _weight(builder, value, t, first)
            first = next(iter(graph))
        elif value.const_value is None:
            _activation(builder, value, t, first, int8)
            first = next(iter(graph))
    for node in [n for n in graph if is_op(n, "Pad")]:
        _pad_integers(node)
    graph.sort()
    return model


def finish_qdq(model: ir.Model) -> None:
    """The rewrites that keep ONNX Runtime's int8 fusions whole, after the QDQ graph is final (bias
    correction measures on the graph as written: its float references read the clamped values):
    clamps their QuantizeLinear makes redundant go, a Relu after a float-output int8 MatMul becomes a
    Max, a float-output int8 MatMul with a bias becomes ONNX Runtime's MatMulIntegerToFloat with it
    (:mod:`requant.backends.matmul_to_float`), other 3-d int8 MatMuls keep their bias Add apart, and
    Muls by a positive constant between conversions fold into a scale, and a float kernel that ONNX
    Runtime would quantize itself is kept from it. The same numbers, or closer to float (a folded
    Mul's product is not rounded again). The scales and zero points these rewrites leave unread go
    (ONNX Runtime warned about each one at every load: 128 on PP-OCRv4's recognizer)."""
    graph = model.graph
    for node in [n for n in graph if is_op(n, "Relu") or is_op(n, "Clip")]:
        _drop_clamp(node)
    builder = _Builder(graph)
    for node in [n for n in graph if is_op(n, "Relu")]:
        _relu_after_float_output(builder, node)
    write_matmul_integer_to_float(model)
    for node in [n for n in graph if is_op(n, "MatMul")]:
        _keep_matmul_apart(builder, node)
    for node in [n for n in graph if is_op(n, "Mul")]:
        _fold_scalar_mul(builder, node)
    for node in [n for n in graph if any(is_op(n, op) for op in _WEIGHTS_QUANTIZED_BY_ORT)]:
        _keep_float_weights_float(builder, node)
    for value in list(graph.initializers.values()):
        drop_if_unused(graph, value)


def _int8_matmul(node: ir.Node) -> bool:
    """A MatMul whose two inputs are dequantized: one ONNX Runtime fuses into an int8 kernel."""
    readers = [v.producer() if v is not None else None for v in node.inputs[:2]]
    return (
        is_op(node, "MatMul")
        and len(readers) == 2
        and all(r is not None and is_op(r, "DequantizeLinear") for r in readers)
    )


def _relu_after_float_output(builder: _Builder, relu: ir.Node) -> None:
    """A Relu after an int8 MatMul with a float output (MatMulIntegerToFloat) becomes ``Max(x, 0)``:
    the same numbers, and ONNX Runtime then fuses the MatMul.

    ONNX Runtime's QDQ selectors take a Relu or Clip after a kernel as a clamp its QuantizeLinear
    makes redundant; with no QuantizeLinear after it (the output is float), the selection fails and
    the MatMul runs in float between DequantizeLinears (measured: MatMul -> Relu -> Tanh, 0 int8
    kernels; with Max, MatMulIntegerToFloat). A Relu whose output is a graph output escapes that
    search and is left as it is."""
    source = relu.inputs[0]
    kernel = source.producer() if source is not None else None
    out = relu.outputs[0]
    if source is None or kernel is None or not _int8_matmul(kernel) or out.is_graph_output():
        return
    if not out.uses() or all(is_op(u.node, "QuantizeLinear") for u in out.uses()):
        return  # a quantized output: the fused kernel clamps it (or the Relu went already)
    dtype = source.dtype.numpy() if source.dtype is not None else np.float32
    zero = builder.initializer(f"{relu.name or 'relu'}_zero", np.zeros((), dtype))
    relu.op_type = "Max"
    relu.resize_inputs(2)
    relu.replace_input_with(1, zero)


def _constant_number(value: ir.Value) -> npt.NDArray[Any] | None:
    """A constant's value, or a dequantized constant's (``DequantizeLinear`` of an initializer)."""
    data = constant(value)
    reader = value.producer()
    if data is not None or reader is None or not is_op(reader, "DequantizeLinear"):
        return data
    stored = constant(reader.inputs[0])
    scale = constant(reader.inputs[1]) if len(reader.inputs) > 1 else None
    zero = constant(reader.inputs[2]) if len(reader.inputs) > 2 else None
    if stored is None or scale is None or stored.size != 1:
        return None
    offset = np.asarray(zero, np.float64) if zero is not None else 0.0
    return (np.asarray(stored, np.float64) - offset) * np.asarray(scale, np.float64)


def _fold_scalar_mul(builder: _Builder, mul: ir.Node) -> None:
    """``DequantizeLinear(q; s, z) -> Mul(c) -> QuantizeLinear -> DequantizeLinear`` with ``c > 0`` one
    number becomes ``DequantizeLinear(q; c s, z)``: the product, exactly, read from the same integers.

    A QLinearMul saved (a decomposed HardSwish's or HardSigmoid's 1/6), and one rounding less; the
    readers' fused kernels take the scale ``c s``. Left alone when the product is read in float or is
    a graph output."""
    inputs = [v for v in mul.inputs if v is not None]
    if len(inputs) != 2 or mul.outputs[0].is_graph_output():
        return
    for source, other in (inputs, inputs[::-1]):
        dq = source.producer()
        factor = _constant_number(other)
        if dq is None or not is_op(dq, "DequantizeLinear") or factor is None or factor.size != 1:
            continue
        c = float(factor.reshape(-1)[0])
        scale = constant(dq.inputs[1]) if len(dq.inputs) > 1 else None
        if not (np.isfinite(c) and c > 0) or scale is None or dq.inputs[0] is None:
            continue
        uses = list(mul.outputs[0].uses())
        q = uses[0].node if len(uses) == 1 else None
        if q is None or not is_op(q, "QuantizeLinear") or q.outputs[0].is_graph_output():
            continue
        readers = [u.node for u in q.outputs[0].uses()]
        if not readers or not all(is_op(r, "DequantizeLinear") for r in readers):
            continue
        if any(r.attributes.get("axis") is not None for r in (dq, *readers)):
            continue  # per tensor only: the readers' axis would have to follow
        base = f"{dq.inputs[1].name if dq.inputs[1] is not None else 'scale'}_times_{mul.name or 'mul'}"
        folded = builder.initializer(base, (np.asarray(scale, np.float64) * c).astype(scale.dtype))
        for reader in readers:
            _follow_moves(reader, (q.inputs[1], q.inputs[2]), (folded, dq.inputs[2] if len(dq.inputs) > 2 else None))
        for reader in readers:
            reader.replace_input_with(0, dq.inputs[0])
            reader.replace_input_with(1, folded)
            if len(dq.inputs) > 2 and dq.inputs[2] is not None:
                if len(reader.inputs) < 3:
                    reader.resize_inputs(3)
                reader.replace_input_with(2, dq.inputs[2])
        graph = builder.graph
        graph.remove([q, mul], safe=True)
        if not dq.outputs[0].uses() and not dq.outputs[0].is_graph_output():
            graph.remove(dq, safe=True)
        return


# ops ONNX Runtime runs on the integers when the parameters before and after them are the same
_MOVES_INTEGERS = frozenset({"MaxPool", "Resize", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})


def _follow_moves(
    dq: ir.Node, shared: tuple[ir.Value | None, ir.Value | None], folded: tuple[ir.Value, ir.Value | None]
) -> None:
    """After ``dq`` reads the integers before a folded Mul (``folded``: its scale and zero point): the
    data-movement ops it feeds re-quantize with the parameters they shared with their input
    (``shared``); they take ``folded`` too, so ONNX Runtime still runs them on the integers (a MaxPool
    after a folded HardSwish ran in float between a DequantizeLinear and a QuantizeLinear of different
    scales, a rounding more). Follows chains of them."""
    for use in list(dq.outputs[0].uses()):
        move = use.node
        if use.idx != 0 or not any(is_op(move, op) for op in _MOVES_INTEGERS) or move.outputs[0].is_graph_output():
            continue
        quantizers = [u.node for u in move.outputs[0].uses()]
        if not quantizers or not all(
            is_op(n, "QuantizeLinear") and len(n.inputs) == 3 and (n.inputs[1], n.inputs[2]) == shared
            for n in quantizers
        ):
            continue
        for node in quantizers + [u.node for n in quantizers for u in n.outputs[0].uses()]:
            if is_op(node, "QuantizeLinear") or (is_op(node, "DequantizeLinear") and len(node.inputs) == 3):
                node.replace_input_with(1, folded[0])
                node.replace_input_with(2, folded[1])
                if is_op(node, "DequantizeLinear"):
                    _follow_moves(node, shared, folded)


# ONNX Runtime 1.31's WeightBiasQuantization gives a float Conv, ConvTranspose or Gemm whose input a
# DequantizeLinear with one scale makes per-tensor int8 weights (and an int32 bias), which its QDQ
# fusion then runs as an int8 kernel when a QuantizeLinear follows; its QDQPropagationTransformer first
# moves such a DequantizeLinear forward past these ops (onnxruntime/core/optimizer/qdq_transformer)
_WEIGHTS_QUANTIZED_BY_ORT = ("Conv", "ConvTranspose", "Gemm")
_DEQUANTIZE_MOVES_PAST = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})


def _keep_float_weights_float(builder: _Builder, node: ir.Node) -> None:
    """A Conv, ConvTranspose or Gemm with a float weight stays float in ONNX Runtime: where its input
    is a per-tensor DequantizeLinear, directly or through ops ONNX Runtime moves the DequantizeLinear
    past (``_DEQUANTIZE_MOVES_PAST``), that path gets a DequantizeLinear of its own that writes the
    same scale and zero point once per index of a static axis (``axis``), which neither rewrite takes.

    Found on PP-OCRv4's recognizer with kernels kept float by an accuracy budget: ``DequantizeLinear
    -> Reshape -> Transpose -> Conv`` with a float weight ran as a QLinearConv with full-range
    per-tensor int8 weights (11 int16 pairs could saturate on CPUs without VNNI). Without a static
    axis of two or more the path is left as it is (``requant lint`` counts such a kernel as int8)."""
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    if weight is None or weight.producer() is not None or weight.const_value is None:
        return  # a quantized weight (DequantizeLinear) or a computed one
    if weight.dtype != ir.DataType.FLOAT:
        return
    reader, value = node, node.inputs[0]
    while value is not None and (producer := value.producer()) is not None:
        if is_op(producer, "DequantizeLinear"):
            break
        if producer.op_type not in _DEQUANTIZE_MOVES_PAST or producer.domain not in ("", "ai.onnx"):
            return
        reader, value = producer, producer.inputs[0]
    dq = value.producer() if value is not None else None
    if value is None or dq is None or not is_op(dq, "DequantizeLinear") or dq.attributes.get("axis") is not None:
        return
    scale = constant(dq.inputs[1]) if len(dq.inputs) > 1 else None
    zero = constant(dq.inputs[2]) if len(dq.inputs) > 2 else None
    stored = dq.inputs[0]
    if scale is None or scale.size != 1 or stored is None or stored.shape is None:
        return
    axis = next((i for i, d in enumerate(stored.shape) if isinstance(d, int) and d >= 2), None)
    if axis is None:
        return
    size = stored.shape[axis]
    assert isinstance(size, int)
    inputs = [stored, builder.initializer(f"{stored.name}_scale_on_axis", np.full(size, scale.reshape(-1)[0]))]
    if zero is not None:
        inputs.append(builder.initializer(f"{stored.name}_zero_point_on_axis", np.full(size, zero.reshape(-1)[0])))
    own = builder.node("DequantizeLinear", inputs, {"axis": axis}, f"{value.name}_for_float")
    own.outputs[0].shape, own.outputs[0].type = value.shape, value.type
    dq.append(own)
    for use in [u for u in value.uses() if u.node is reader]:
        reader.replace_input_with(use.idx, own.outputs[0])
    if not value.uses() and not value.is_graph_output():
        builder.graph.remove(dq, safe=True)


def _keep_matmul_apart(builder: _Builder, matmul: ir.Node) -> None:
    """An int8 ``MatMul`` with a float output and a float bias ``Add`` after it, on inputs of more than
    two dimensions: its bias becomes ``[1, N]`` (the same sum), which ONNX Runtime's MatMul + Add ->
    Gemm rewrite does not take, so the MatMul stays a MatMulIntegerToFloat.

    With a bias of shape ``[N]`` and a static input shape, ONNX Runtime rewrites the pair into
    ``Reshape -> Gemm -> Reshape`` before its QDQ fusion, and a Gemm with a float output and a float
    bias has no int8 kernel: it runs in float between DequantizeLinears (measured on a [1, 128, 384]
    feed-forward layer: 1.10x float latency; 0.69x with the bias as [1, N]). A bias Add whose sum
    is only quantized (read by QuantizeLinear alone) is left as it is: that Gemm becomes a QGemm.
    """
    a = matmul.inputs[0]
    if a is None or a.shape is None or len(a.shape) <= 2 or not all(isinstance(d, int) for d in a.shape):
        return  # 2-d, or a dynamic shape: ONNX Runtime leaves the pair alone
    if not _int8_matmul(matmul):
        return
    uses = list(matmul.outputs[0].uses())
    if len(uses) != 1 or not is_op(uses[0].node, "Add") or matmul.outputs[0].is_graph_output():
        return
    add = uses[0].node
    out = add.outputs[0]
    if not out.is_graph_output() and all(is_op(u.node, "QuantizeLinear") for u in out.uses()):
        return
    index = 1 - uses[0].idx
    bias = add.inputs[index]
    data = constant(bias)
    if bias is None or data is None or data.ndim != 1:
        return
    if len(bias.uses()) == 1 and bias.is_initializer() and not bias.is_graph_input():
        bias.const_value = ir.Tensor(data.reshape(1, -1), name=bias.name)  # the same name, as a row
        bias.shape = ir.Shape([1, len(data)])
    else:
        add.replace_input_with(index, builder.initializer(f"{bias.name}_row", data.reshape(1, -1)))


def _quantizes_to(x: float, t: UniformQuantizedType) -> int:
    """ONNX's QuantizeLinear of one float32 value (round half to even)."""
    if not np.isfinite(x):
        return t.storage_min if x < 0 else t.storage_max
    q = np.rint(np.float32(x) / np.float32(t.scale)) + t.zero_point
    return int(np.clip(q, t.storage_min, t.storage_max))


def _drop_clamp(node: ir.Node) -> None:
    """A Relu or Clip that ends an int8 kernel, read only by QuantizeLinears that clamp where it
    does, goes: the same numbers (``Q(clip(x, lo, hi)) == Q(x)`` for every x when ``lo`` quantizes
    to the lowest stored value and ``hi`` to the highest: a Relu before a zero point of 0).

    ONNX Runtime drops such a Relu itself, but only after rewriting a 3-d ``MatMul -> Add`` into
    ``Reshape -> Gemm -> Reshape``; the Relu then sits between the Gemm and its QuantizeLinear and
    the Gemm runs in float (measured: a [1, 6, 32] linear layer + Relu).
    """
    source, out = node.inputs[0], node.outputs[0]
    producer = source.producer() if source is not None else None
    uses = list(out.uses())
    bounds = clamp_bounds(node)
    if source is None or producer is None or is_op(producer, "DequantizeLinear") or bounds is None:
        return  # a standalone Relu (DequantizeLinear -> Relu) is not part of a kernel
    if not uses or out.is_graph_output():
        return
    for use in uses:
        t = quant_type(use.node.outputs[0]) if is_op(use.node, "QuantizeLinear") and use.idx == 0 else None
        if not isinstance(t, UniformQuantizedType):
            return
        if _quantizes_to(bounds[0], t) != t.storage_min or _quantizes_to(bounds[1], t) != t.storage_max:
            return
    for use in uses:
        use.node.replace_input_with(0, source)
        use.node.metadata_props[QUANTIZES_KEY] = str(out.name)  # what it stands for (requant compare reads it)
    graph = node.graph
    assert isinstance(graph, ir.Graph)
    bounds_values = [v for v in node.inputs[1:] if v is not None]
    graph.remove(node, safe=True)
    for value in bounds_values:  # a Clip's bounds, if nothing else reads them
        drop_if_unused(graph, value)


def _pad_integers(pad: ir.Node) -> None:
    """``DequantizeLinear -> Pad -> QuantizeLinear`` with one type on both sides becomes
    ``Pad -> DequantizeLinear`` on the integers, padding with the zero point.

    The same numbers (a zero point stands for 0 exactly); ONNX Runtime would run the float Pad
    between the two conversions (measured on a 224x224 RGB input: 0.19 ms for the three, 0.01 ms
    for the Pad on bytes).
    """
    source, out = pad.inputs[0], pad.outputs[0]
    dq = source.producer() if source is not None else None
    uses = list(out.uses())
    if dq is None or not is_op(dq, "DequantizeLinear") or len(uses) != 1 or out.is_graph_output():
        return
    q = uses[0].node
    if not is_op(q, "QuantizeLinear") or list(q.inputs[1:]) != list(dq.inputs[1:]) or len(dq.inputs) < 3:
        return
    if not pads_with_zero(pad):
        return
    if len(pad.inputs) < 3:
        pad.resize_inputs(3)
    pad.replace_input_with(0, dq.inputs[0])
    pad.replace_input_with(2, dq.inputs[2])  # the zero point: dequantized, exactly 0
    quantized = q.outputs[0]
    out.type, out.shape = quantized.type, quantized.shape
    set_quant_type(out, quant_type(quantized))
    replace_value(quantized, out)
    graph = pad.graph
    assert isinstance(graph, ir.Graph)
    graph.remove(q, safe=True)
    if not dq.outputs[0].uses() and not dq.outputs[0].is_graph_output():
        graph.remove(dq, safe=True)
