"""Decompositions: ops a target has no int8 kernel for, rewritten into ops it has, so they can be quantized.

A target lists the decompositions it wants (``SupportTable.decompositions``). The composite
quantizer's first run finds the nodes a non-float config selects that a decomposition applies
to; the decomposition rewrites them; the second run annotates the result. A node a
decomposition cannot take (``check`` gives the reason) stays as it is, and the report says why.

Each rewrite keeps the original output name, the node's name on the first new node, and the
node's metadata (module path and class) on every new node, so selections by name or module
still apply after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from requant.ir.annotations import replace_value
from requant.ir.queries import constant, fresh_name, graph_values
from requant.ir.requests import QuantizationSpec
from requant.passes._rewrite import adopt_name, drop_if_unused, new_initializer

if TYPE_CHECKING:
    from requant.quantizers.config import QuantizationConfig

__all__ = [
    "AVERAGE_POOL_AS_DEPTHWISE",
    "BATCHNORM_TO_MUL_ADD",
    "DIV_TO_MUL",
    "HARD_SIGMOID",
    "HARD_SWISH",
    "PAD_CONV_CHANNELS",
    "SPATIAL_MEAN",
    "SUB_TO_ADD",
    "Decomposition",
]


def _always(node: ir.Node, config: QuantizationConfig) -> bool:
    return True


@dataclass(frozen=True)
class Decomposition:
    """How to rewrite one op type; ``check`` returns why a node cannot be rewritten, or None.

    ``applies``: whether the rewrite is wanted at all for this node and its config (a rewrite
    that only makes a kernel faster is not wanted where it would not); a node it does not
    apply to is left alone without a word in the report.
    """

    op_type: str
    into: str
    why: str
    check: Callable[[ir.Node], str | None]
    rewrite: Callable[[ir.Node], list[ir.Node]]
    applies: Callable[[ir.Node, QuantizationConfig], bool] = _always

    def __str__(self) -> str:
        return f"{self.op_type} -> {self.into}"


def _replace(node: ir.Node, new_nodes: list[ir.Node]) -> list[ir.Node]:
    """Put ``new_nodes`` (a chain; the last one's output replaces ``node``'s) where ``node`` was."""
    graph = node.graph
    assert isinstance(graph, ir.Graph)
    old, new = node.outputs[0], new_nodes[-1].outputs[0]
    new.shape, new.type = old.shape, old.type
    names: set[str | None] = {n.name for n in graph}
    for i, n in enumerate(new_nodes):
        n.name = node.name if i == 0 else fresh_name(f"{node.name or node.op_type}_{n.op_type.lower()}", names)
        if n is not new_nodes[-1]:  # an elementwise step inside the chain: the output's shape and type
            step = n.outputs[0]
            base = f"{old.name or 'value'}_{n.op_type.lower()}"
            step.name = fresh_name(base, {v.name for v in graph_values(graph)})
            step.shape, step.type = old.shape, old.type
        n.metadata_props.update(node.metadata_props)
    adopt_name(old, new)
    graph.insert_after(node, new_nodes)
    replace_value(old, new)
    graph.remove(node, safe=True)
    return new_nodes


def _second_input_constant(node: ir.Node) -> str | None:
    if len(node.inputs) != 2 or constant(node.inputs[1]) is None:
        return f"its second input is not a constant: {node.op_type} of two activations has no int8 kernel"
    return None


def _with_constant(node: ir.Node, op_type: str, suffix: str, fn: Callable[[np.ndarray], np.ndarray]) -> list[ir.Node]:
    """``node(x, c)`` becomes ``op_type(x, fn(c))``, with ``fn(c)`` a new initializer."""
    graph, value = node.graph, node.inputs[1]
    data = constant(value)
    assert isinstance(graph, ir.Graph) and value is not None and data is not None
    replaced = new_initializer(graph, f"{value.name}_{suffix}", fn(np.asarray(data, np.float64)).astype(data.dtype))
    return _replace(node, [ir.Node("", op_type, inputs=[node.inputs[0], replaced], num_outputs=1)])


def _div_to_mul(node: ir.Node) -> list[ir.Node]:
    return _with_constant(node, "Mul", "reciprocal", lambda c: 1 / c)


def _sub_to_add(node: ir.Node) -> list[ir.Node]:
    return _with_constant(node, "Add", "negated", lambda c: -c)


def _batchnorm_check(node: ir.Node) -> str | None:
    training = node.attributes.get("training_mode")
    if training is not None and training.as_int():
        return "it is in training mode"
    if any(constant(v) is None for v in node.inputs[1:5]):
        return "its scale, bias, mean or variance is not a constant"
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) < 2:
        return "the rank of its input is unknown"
    return None


def _batchnorm_to_mul_add(node: ir.Node) -> list[ir.Node]:
    graph = node.graph
    assert isinstance(graph, ir.Graph)
    gamma, beta, mean, var = (np.asarray(constant(v), np.float64).reshape(-1) for v in node.inputs[1:5])
    epsilon = node.attributes.get("epsilon")
    scale = gamma / np.sqrt(var + (epsilon.as_float() if epsilon is not None else 1e-5))
    shift = beta - mean * scale
    x = node.inputs[0]
    assert x is not None and x.shape is not None
    shape = (-1,) + (1,) * (len(x.shape) - 2)  # broadcast over the channel axis (1)
    dtype = np.dtype(x.dtype.numpy()) if x.dtype is not None else np.dtype(np.float32)
    name = node.outputs[0].name or "bn"
    s = new_initializer(graph, f"{name}_scale", scale.reshape(shape).astype(dtype))
    t = new_initializer(graph, f"{name}_shift", shift.reshape(shape).astype(dtype))
    mul = ir.Node("", "Mul", inputs=[x, s], num_outputs=1)
    add = ir.Node("", "Add", inputs=[mul.outputs[0], t], num_outputs=1)
    return _replace(node, [mul, add])


def _channel_padding(node: ir.Node) -> int:
    """Zero input channels that make a one-group 2-d Conv's input channels a multiple of 4 (0: none needed)."""
    weight = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    group = node.attributes.get("group")
    if weight is None or weight.ndim != 4 or (group is not None and group.as_int() != 1):
        return 0
    return int(-weight.shape[1] % 4)


def _pad_applies(node: ir.Node, config: QuantizationConfig) -> bool:
    """MLAS's ConvSym kernel would take the padded conv (uint8 inputs, int8 weights with zero point 0,
    output channels a multiple of 8 and at least 16: the conditions ``requant.targets.kernels``
    names) and run it faster than the QGEMM it runs now.

    Measured on ONNX Runtime 1.31 (AVX2, one thread, 32 output channels, 112x112 input, stride 2;
    padded / unpadded latency, interleaved): 3x3 kernels 0.71-0.92 for 1 to 7 input channels, 1x1
    0.65-0.84; 5x5 and 7x7 kernels slower with few channels (7x7 with 3 channels, ResNet's stem:
    1.11; 1.29 at 224x224, 64 channels). So: at most 9 kernel positions and at least 2 input
    channels (a single channel gains little, 0.92 at 3x3, and nothing on small maps: 1.01 on an
    8x8 digit). Table in ``docs/targets.md``.
    """
    weight, inputs = config.weight, config.input_activation
    if not (isinstance(weight, QuantizationSpec) and isinstance(inputs, QuantizationSpec)):
        return False
    if weight.dtype != "int8" or not weight.symmetric or inputs.dtype != "uint8" or not _channel_padding(node):
        return False
    cout, cin, *window = np.shape(constant(node.inputs[1]))  # type: ignore[arg-type]
    return cout >= 16 and cout % 8 == 0 and cin >= 2 and int(np.prod(window)) <= 9


def _before_opset_11(node: ir.Node, what: str) -> str | None:
    """Why a rewrite that writes an op whose inputs were attributes before opset 11 cannot be done, or None."""
    graph = node.graph
    opset = graph.opset_imports.get("", 0) if isinstance(graph, ir.Graph) else 0
    if opset < 11:
        return f"opset {opset}: {what} before opset 11 (upgrade the model)"
    return None


def _pad_check(node: ir.Node) -> str | None:
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4:
        return "the rank of its input is unknown"
    return _before_opset_11(node, "Pad takes its pads as an attribute")


def _pad_conv(node: ir.Node) -> list[ir.Node]:
    """``Conv(x, w)`` becomes ``Conv(Pad(x), w')``: zero channels after x's, zero rows in w' for them.

    The Conv keeps its name, output and attributes; the Pad is named after it.
    """
    graph, x, w = node.graph, node.inputs[0], node.inputs[1]
    extra = _channel_padding(node)
    data = constant(w)
    assert isinstance(graph, ir.Graph) and x is not None and x.shape is not None and w is not None
    assert data is not None
    widths = [(0, 0), (0, extra), (0, 0), (0, 0)]
    padded_w = new_initializer(graph, f"{w.name}_padded", np.pad(data, widths))
    base = node.name or "conv"
    pads = new_initializer(graph, f"{base}_channel_pads", np.array([0, 0, 0, 0, 0, extra, 0, 0], np.int64))
    pad = ir.Node("", "Pad", inputs=[x, pads], num_outputs=1, name=f"{base}_pad")
    out = pad.outputs[0]
    out.name = fresh_name(f"{x.name or 'input'}_padded", {v.name for v in graph_values(graph)})
    dims: list[int | ir.SymbolicDim] = list(x.shape)
    dims[1] = int(data.shape[1]) + extra  # one group: the weight's input channels are the input's
    out.shape, out.type = ir.Shape(dims), x.type
    pad.metadata_props.update(node.metadata_props)
    graph.insert_before(node, pad)
    node.replace_input_with(0, out)
    node.replace_input_with(1, padded_w)
    if drop_if_unused(graph, w):
        padded_w.name = w.name  # the weight keeps the name users know
    return [pad, node]


def _hard_parameters(node: ir.Node) -> tuple[float, float]:
    """(alpha, beta) of a HardSigmoid (ONNX's defaults 0.2 and 0.5); HardSwish's are 1/6 and 1/2."""
    if node.op_type == "HardSwish":
        return 1 / 6, 0.5
    alpha, beta = node.attributes.get("alpha"), node.attributes.get("beta")
    return (alpha.as_float() if alpha is not None else 0.2), (beta.as_float() if beta is not None else 0.5)


def _hard_check(node: ir.Node) -> str | None:
    alpha, _ = _hard_parameters(node)
    if alpha <= 0:
        return f"its alpha ({alpha:g}) is not positive"
    return _before_opset_11(node, "Clip takes its bounds as attributes")


def _quantizes_activations(node: ir.Node, config: QuantizationConfig) -> bool:
    return isinstance(config.input_activation, QuantizationSpec)


def _hard_chain(node: ir.Node) -> list[ir.Node]:
    """``HardSigmoid(x) = alpha * Clip(x + beta / alpha, 0, 1 / alpha)`` (alpha > 0), and
    ``HardSwish(x) = x * HardSigmoid(x)`` with alpha 1/6, beta 1/2: an Add with its Clip (one
    QLinearAdd, the Clip in its output range), a Mul by a constant, and for HardSwish a Mul."""
    graph, x = node.graph, node.inputs[0]
    assert isinstance(graph, ir.Graph) and x is not None
    alpha, beta = _hard_parameters(node)
    dtype = np.dtype(x.dtype.numpy()) if x.dtype is not None else np.dtype(np.float32)
    base = node.outputs[0].name or node.op_type.lower()
    shift, low, high, scale = (
        new_initializer(graph, f"{base}_{name}", np.array(value, dtype))
        for name, value in (("shift", beta / alpha), ("low", 0.0), ("high", 1 / alpha), ("alpha", alpha))
    )
    add = ir.Node("", "Add", inputs=[x, shift], num_outputs=1)
    clip = ir.Node("", "Clip", inputs=[add.outputs[0], low, high], num_outputs=1)
    mul = ir.Node("", "Mul", inputs=[clip.outputs[0], scale], num_outputs=1)
    chain = [add, clip, mul]
    if node.op_type == "HardSwish":
        chain.append(ir.Node("", "Mul", inputs=[x, mul.outputs[0]], num_outputs=1))
    return _replace(node, chain)


def _spatial_mean_check(node: ir.Node) -> str | None:
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4:
        return "its input is not known to be 4-d"
    keepdims = node.attributes.get("keepdims")
    if keepdims is not None and not keepdims.as_int():
        return "keepdims=0 (GlobalAveragePool keeps them)"
    axes_attribute = node.attributes.get("axes")  # opset < 18
    axes = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    given = (
        axes_attribute.as_ints()
        if axes_attribute is not None
        else (axes.reshape(-1).tolist() if axes is not None else None)
    )
    if given is None or sorted(int(a) % 4 for a in given) != [2, 3]:
        return f"it averages over axes {given}, not the two spatial ones"
    return None


def _spatial_mean(node: ir.Node) -> list[ir.Node]:
    return _replace(node, [ir.Node("", "GlobalAveragePool", inputs=[node.inputs[0]], num_outputs=1)])


def _pool_attribute(node: ir.Node, name: str) -> list[int] | None:
    attribute = node.attributes.get(name)
    return list(attribute.as_ints()) if attribute is not None else None


def _average_pool_check(node: ir.Node) -> str | None:
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int):
        return "its input is not known to be 4-d with a fixed channel count"
    auto_pad = node.attributes.get("auto_pad")
    if auto_pad is not None and auto_pad.as_string() not in ("NOTSET", "VALID"):
        return f"auto_pad={auto_pad.as_string()} (a conv would pad differently)"
    ceil = node.attributes.get("ceil_mode")
    if ceil is not None and ceil.as_int():
        return "ceil_mode=1: its last windows hang over the edge"
    dilations = _pool_attribute(node, "dilations")
    if dilations is not None and any(d != 1 for d in dilations):
        return "dilated windows"
    pads = _pool_attribute(node, "pads") or [0, 0, 0, 0]
    counted = node.attributes.get("count_include_pad")
    if any(pads) and not (counted is not None and counted.as_int()):
        return "its padded windows divide by the elements inside the input (count_include_pad=0), not the window"
    return None


def _average_pool_as_conv(node: ir.Node) -> list[ir.Node]:
    """``AveragePool(x)`` becomes ``Conv(x, w)`` with one group per channel and every weight ``1 / (kh kw)``."""
    graph, x = node.graph, node.inputs[0]
    assert isinstance(graph, ir.Graph) and x is not None and x.shape is not None
    channels, window = x.shape[1], _pool_attribute(node, "kernel_shape") or [1, 1]
    assert isinstance(channels, int)  # _average_pool_check
    dtype = np.dtype(x.dtype.numpy()) if x.dtype is not None else np.dtype(np.float32)
    weight = np.full((channels, 1, *window), 1.0 / int(np.prod(window)), dtype)
    w = new_initializer(graph, f"{node.outputs[0].name or 'pool'}_window", weight)
    attributes = [ir.AttrInt64("group", channels), ir.AttrInt64s("kernel_shape", window)]
    for name in ("strides", "pads"):
        if (values := _pool_attribute(node, name)) is not None:
            attributes.append(ir.AttrInt64s(name, values))
    return _replace(node, [ir.Node("", "Conv", inputs=[x, w], attributes=attributes, num_outputs=1)])


AVERAGE_POOL_AS_DEPTHWISE = Decomposition(
    "AveragePool", "Conv (depthwise)",
    "ONNX Runtime's QLinearAveragePool is its slowest int8 op (a 3x3 window: 4.0 ns an element, 46x its float "
    "AveragePool); an average over a window is a depthwise conv with every weight 1/window (stored exactly: "
    "one int8 step times 127), which runs on MLAS's int8 depthwise kernel",
    _average_pool_check, _average_pool_as_conv, _quantizes_activations,
)  # fmt: skip
DIV_TO_MUL = Decomposition(
    "Div", "Mul", "no int8 Div kernel; dividing by a constant is multiplying by its reciprocal",
    _second_input_constant, _div_to_mul,
)  # fmt: skip
SUB_TO_ADD = Decomposition(
    "Sub", "Add", "no int8 Sub kernel; subtracting a constant is adding its negation",
    _second_input_constant, _sub_to_add,
)  # fmt: skip
BATCHNORM_TO_MUL_ADD = Decomposition(
    "BatchNormalization", "Mul -> Add", "no int8 batch norm kernel; at inference it is a per-channel Mul and Add",
    _batchnorm_check, _batchnorm_to_mul_add,
)  # fmt: skip
_HARD_WHY = (
    "no int8 {op} kernel (it would run in float between a DequantizeLinear and a QuantizeLinear); "
    "as int8 Add, Mul and Clip it is faster (a MobileNetV3-like block: 1.30 -> 1.13x float latency, SQNR 31.3 -> "
    "31.8 dB)"
)
HARD_SIGMOID = Decomposition(
    "HardSigmoid", "Add -> Clip -> Mul", _HARD_WHY.format(op="HardSigmoid"), _hard_check, _hard_chain,
    _quantizes_activations,
)  # fmt: skip
HARD_SWISH = Decomposition(
    "HardSwish", "Add -> Clip -> Mul -> Mul", _HARD_WHY.format(op="HardSwish"), _hard_check, _hard_chain,
    _quantizes_activations,
)  # fmt: skip
SPATIAL_MEAN = Decomposition(
    "ReduceMean", "GlobalAveragePool",
    "no int8 ReduceMean kernel; the mean over a 4-d tensor's two spatial axes (a squeeze-and-excitation "
    "block's pooling, as PyTorch exports adaptive_avg_pool2d(x, 1)) is GlobalAveragePool, which has one",
    _spatial_mean_check, _spatial_mean, _quantizes_activations,
)  # fmt: skip
PAD_CONV_CHANNELS = Decomposition(
    "Conv", "Pad -> Conv",
    "MLAS's fast int8 conv (ConvSym) needs input channels in multiples of 4; zero channels (zero point "
    "on the integers) and zero weights for them compute the same sums (a 3-channel stem: 0.53 -> 0.36 ms)",
    _pad_check, _pad_conv, _pad_applies,
)  # fmt: skip
