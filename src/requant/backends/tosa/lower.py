"""Lowering a QDQ model to integer TOSA: each node by its op's function (:data:`LOWERINGS`), on
static shapes found by running the model once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from requant.backends.tosa.elementwise import UNARY, add_op, mul, sub_op, table
from requant.backends.tosa.kernels import conv, conv_transpose, gemm, matmul
from requant.backends.tosa.lowering import Lowering, q_params
from requant.backends.tosa.movement import (
    clamp,
    concat,
    gather,
    identity,
    pad,
    reshape,
    resize,
    slice_op,
    transpose_op,
)
from requant.backends.tosa.normalization import l2_normalize, layer_norm, softmax
from requant.backends.tosa.pooling import (
    argmax,
    average_pool,
    global_average_pool,
    max_pool,
    reduce,
)
from requant.backends.tosa.program import (
    KERNELS,
    ROUNDING,
    SHAPE_OPS,
    Array,
    Edge,
    Tensor,
    TosaError,
    TosaProgram,
    named,
)
from requant.ir.queries import constant

LOWERINGS: dict[str, Callable[[Lowering, ir.Node], None]] = {
    # kernels: int32 sums rescaled to the next int8 tensor
    "Conv": conv, "ConvTranspose": conv_transpose, "Gemm": gemm, "MatMul": matmul,
    # data movement and ops bound to one type: int8 values moved
    "Reshape": reshape, "Flatten": reshape, "Squeeze": reshape, "Unsqueeze": reshape, "Transpose": transpose_op,
    "Identity": identity, "Pad": pad, "Slice": slice_op, "Concat": concat, "Gather": gather, "Resize": resize,
    "Relu": clamp, "Clip": clamp,
    # pools and reductions
    "MaxPool": max_pool, "AveragePool": average_pool, "GlobalAveragePool": global_average_pool,
    "ReduceMean": reduce, "ReduceSum": reduce, "ReduceMax": reduce,
    # elementwise: sums on an int32 scale, products, tables of one-input functions
    "Add": add_op, "Sub": sub_op, "Mul": mul, **{op: table for op in UNARY},
    # normalizations
    "Softmax": softmax, "LayerNormalization": layer_norm, "LpNormalization": l2_normalize,
}  # fmt: skip


def _static_shapes(
    model: ir.Model, given: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, Array]]:
    """Every value's shape with the inputs' batch fixed to 1 and their other dynamic dimensions as
    ``given`` (by input name: a sample's shape), and the values of its integer tensors (shape
    arithmetic, an exporter's gather indices): the model runs once in ONNX Runtime on zeros (shape
    inference does not follow an exporter's shape arithmetic into a Reshape)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    from requant.runtime import cpu_session

    proto = ir.to_proto(model)
    feeds = {}
    for graph_input in proto.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        shape = []
        sample = (given or {}).get(graph_input.name)
        for i, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif i == 0:
                shape.append(1)
            elif sample is not None and len(sample) == len(dims):
                shape.append(int(sample[i]))
            else:
                raise TosaError(
                    f"input '{graph_input.name}' has a dynamic dimension {i} and no sample gives it: TOSA programs "
                    "have static shapes (export the model with that dimension fixed)"
                )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
        feeds[graph_input.name] = np.zeros(shape, dtype)
    known = {o.name for o in proto.graph.output}
    inferred = onnx.shape_inference.infer_shapes(proto)  # element types the model may not state
    types = {i.name: i.type.tensor_type.elem_type for i in inferred.graph.value_info if i.type.HasField("tensor_type")}
    types.update({str(v.name): int(v.dtype) for n in model.graph for v in n.outputs if v.dtype is not None})
    for name in (o for n in proto.graph.node for o in n.output if o and o not in known):
        if types.get(name):
            proto.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = cpu_session(proto.SerializeToString(), options)
    outputs = [o.name for o in session.get_outputs()]
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    integers = {}
    for name, array in zip(outputs, session.run(outputs, feeds), strict=True):
        shapes[name] = tuple(np.shape(array))
        if np.asarray(array).dtype.kind in "iu" and np.size(array) <= 1 << 16:
            integers[name] = np.asarray(array)
    return shapes, integers


def _indices_only(value: ir.Value) -> bool:
    """An integer input read only as the indices of Gathers (and by shape arithmetic)."""
    integer = value.dtype in (ir.DataType.INT64, ir.DataType.INT32)
    uses = [u for u in value.uses() if u.node.op_type not in SHAPE_OPS]
    return integer and bool(uses) and all(u.node.op_type == "Gather" and u.idx == 1 for u in uses)


def _computed_from_indices(model: ir.Model) -> set[str]:
    """The values computed from an input of indices (their values depend on what the host gives)."""
    found = {str(v.name) for v in model.graph.inputs if _indices_only(v)}
    for node in model.graph:
        if any(v is not None and str(v.name) in found for v in node.inputs):
            found |= {str(o.name) for o in node.outputs}
    return found


def _reads_dequantized(node: ir.Node) -> bool:
    producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


def lower_to_tosa(
    model: ir.Model, rounding: str = "single_round", shapes: Mapping[str, tuple[int, ...]] | None = None
) -> TosaProgram:
    """The integer TOSA program of a QDQ ``model`` (requant's output), batch 1; its rescales round as
    ``rounding`` says (``single_round``, TOSA's; ``double_round``, TFLite's: TOSA's extension).
    ``shapes``: the inputs' shapes by name (a calibration sample's), for dimensions the model leaves
    dynamic after the batch: the program is for that size."""
    if rounding not in ROUNDING:
        raise TosaError(f"rounding must be one of {', '.join(ROUNDING)}, got {rounding!r}")
    _check_integer_only(model)
    static, integers = _static_shapes(model, shapes)
    for name in _computed_from_indices(model):  # ran on zeros: not what the program computes from its inputs
        integers.pop(name, None)
    lowering = Lowering(model.graph, static, integers)
    inputs, arguments = _inputs(model, lowering)
    for node in model.graph:
        _lower_node(node, lowering)
    outputs, results = _outputs(model, lowering)
    types = {
        str(v.name): str(t)
        for v in (n.outputs[0] for n in model.graph if n.op_type == "QuantizeLinear")
        if (t := v.meta.get("requant.quant_type")) is not None
    }
    return TosaProgram(inputs, outputs, lowering.ops, arguments, results, types, rounding)


def _check_integer_only(model: ir.Model) -> None:
    """Integer-only: a node computing on float values is an error, named."""
    for node in model.graph:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", *SHAPE_OPS):
            continue
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if value is None or value.dtype != ir.DataType.FLOAT or constant(value) is not None:
                continue
            if producer is None or producer.op_type != "DequantizeLinear":
                if producer is not None and producer.op_type in KERNELS and node.op_type in ("Relu", "Clip"):
                    continue  # an activation lowered with its kernel
                if producer is not None and producer.op_type == "Add" and node.op_type in ("Add", "Sub"):
                    continue  # a residual stream (int32)
                raise TosaError(
                    f"node '{named(node)}' ({node.op_type}) computes in float: its input '{value.name}' is not "
                    "quantized, and the tosa-int8 target is integer-only",
                    named(node),
                )


def _inputs(model: ir.Model, lowering: Lowering) -> tuple[list[Edge], list[str]]:
    """The function's arguments: each model input quantized (read through one QuantizeLinear), or an
    input of indices as i32 (token ids: rows of a table gathered at run time)."""
    inputs: list[Edge] = []
    arguments: list[str] = []
    for value in model.graph.inputs:
        uses = [u.node for u in value.uses()]
        shape = lowering.shape_of(value)
        name = f"%arg{len(arguments)}"
        if _indices_only(value):
            arguments.append(name)
            inputs.append(Edge(str(value.name), shape, 1.0, 0, "i32"))
            lowering.index_inputs[str(value.name)] = Tensor(name, shape, 1.0, 0)
            continue
        quantizers = [n for n in uses if n.op_type == "QuantizeLinear"]
        if len(quantizers) != 1 or any(n.op_type not in ("QuantizeLinear", *SHAPE_OPS) for n in uses):
            raise TosaError(f"input '{value.name}' is not read through one QuantizeLinear (the function takes int8)")
        scale, zp = q_params(quantizers[0])
        arguments.append(name)
        inputs.append(Edge(str(value.name), shape, scale, zp))
        lowering.tensors[str(quantizers[0].outputs[0].name)] = Tensor(name, shape, scale, zp)
    return inputs, arguments


def _lower_node(node: ir.Node, lowering: Lowering) -> None:
    """``node`` lowered by its op's function, or skipped: conversions, shape arithmetic, an activation
    written with its kernel."""
    if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.op_type in SHAPE_OPS:
        return
    if node.op_type == "Pad" and node.inputs[0] is not None and str(node.inputs[0].name) in lowering.tensors:
        pad(lowering, node)  # requant's Pad on the integers
        return
    if node.op_type == "ArgMax" and _reads_dequantized(node):
        argmax(lowering, node)  # of int8 values: indices
        return
    if all(o.dtype is not None and o.dtype != ir.DataType.FLOAT for o in node.outputs):
        return  # shape arithmetic (int64): the shapes are static here
    if node.op_type in ("Relu", "Clip") and node.inputs[0] is not None:
        producer = node.inputs[0].producer()
        if producer is not None and producer.op_type in KERNELS:
            return  # written with its kernel
    lower = LOWERINGS.get(node.op_type)
    if lower is None:
        raise TosaError(f"node '{named(node)}' ({node.op_type}): the tosa-int8 backend does not lower this op yet")
    lower(lowering, node)


def _outputs(model: ir.Model, lowering: Lowering) -> tuple[list[Edge], list[str]]:
    """The function's results: each model output as int8 (NCHW), or an ArgMax's i32 indices."""
    outputs: list[Edge] = []
    results: list[str] = []
    for value in model.graph.outputs:
        if str(value.name) in lowering.indices:  # an ArgMax's: i32 indices, not quantized
            index, shape = lowering.indices[str(value.name)]
            outputs.append(Edge(str(value.name), shape, 1.0, 0, "i32"))
            results.append(index)
            continue
        dq = value.producer()
        found = lowering.tensors.get(str(dq.inputs[0].name)) if dq is not None and dq.inputs[0] is not None else None
        if dq is None or dq.op_type != "DequantizeLinear" or found is None:
            raise TosaError(
                f"output '{value.name}' is not a dequantized int8 tensor (the function returns int8, or an ArgMax's "
                "indices)"
            )
        found = lowering.nchw(found)
        outputs.append(Edge(str(value.name), found.shape, found.scale, found.zero_point))
        results.append(found.name)
    return outputs, results
