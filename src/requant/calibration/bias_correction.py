"""Bias correction: give back to each int8 kernel's bias the mean its quantization shifted.

Rounding weights and inputs shifts a kernel's output by a mean amount per output channel (Nagel
et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", 2019); the next
kernels read the shifted values, and across MobileNetV2's 52 convolutions the shifts add up. The
correction is measured, not derived: on a few calibration samples, the quantized model runs with,
beside each corrected kernel, the float kernel on the *same* input before its QuantizeLinear (the
float weights and bias), and

    bias' = bias - mean over samples and positions of (quantized output - float output)

per output channel, written back into the int32 bias. Each kernel's own error is measured on the
inputs the quantized network gives it, so all kernels are corrected in one pass without counting
an earlier kernel's shift again.

A kernel is corrected when ONNX Runtime runs it as an int8 kernel with an int32 bias: a ``Conv``
or ``Gemm`` whose input is ``DequantizeLinear(QuantizeLinear(x))`` and whose weight and bias are
dequantized constants. The quantized model (QDQ) is changed in place; nothing else is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.data import first_samples
from requant.calibration.observers import CalibrationError, Observer
from requant.calibration.runner import Progress, collect
from requant.ir.queries import dequantized_constant, fresh_name, graph_values
from requant.ir.traits import LAYOUT_ONLY, data_inputs

__all__ = ["KERNELS", "BiasCorrection", "BiasSums", "correct_biases", "float_parameters"]

KERNELS = ("Conv", "Gemm")  # output channels on axis 1 of the output, an int32 bias on input 2
DEFAULT_SAMPLES = 64  # means settle quickly: MobileNetV2 with 32, 64 and 200 samples gave the same KL


@dataclass(frozen=True)
class BiasCorrection:
    """One int8 kernel against its float version on the same inputs: its node, channels, the mean
    shift of its outputs (mean and largest over channels, float units; given back to the bias when
    ``corrected``), and its local SQNR (float output energy over the energy of the difference, dB:
    the error of this kernel's own quantization, input and weights, before the bias correction)."""

    node: str
    channels: int
    mean_shift: float
    max_shift: float
    sqnr_db: float
    corrected: bool = True
    samples: int = 0  # the calibration samples it was measured on


@dataclass
class _Sum(Observer):
    """The sum over samples of what the probe computed on each: a kernel's per-channel sums, sums of
    squares or element counts; accumulated in float64."""

    total: npt.NDArray[np.float64] | None = None
    # one sample a run: with outputs this small the runner would stack 64, whose intermediate tensors
    # (MobileNetV2: 100 MB each) made a run 10x slower than 64 alone, and whose float kernels sum in
    # another order, so the check that a stacked run agrees with its samples alone failed anyway
    batchable = False

    def update(self, array: npt.NDArray[Any]) -> None:
        sums = array.astype(np.float64)
        self.total = sums if self.total is None else self.total + sums


@dataclass
class BiasSums:
    """What a bias-correction pass has summed: per kernel (by node name), its four running sums, over
    the first ``samples`` samples of its data. A later pass on the same QDQ model (before correction)
    and the same data starts from them and runs only the samples after: ``method="auto"`` corrects the
    chosen candidate on all samples after measuring it on the first few, and its float64 sums are
    added in the same order either way, so the biases are those of a pass from the start."""

    samples: int = 0
    sums: dict[str, tuple[_Sum, _Sum, _Sum, _Sum]] = field(default_factory=dict)


class _Measures(NamedTuple):
    """The probe's outputs for one kernel, per sample: the sums over rows and positions of (quantized
    - float) per output channel ``[C]``, of its squares, of the float output's squares, and its
    number of elements."""

    shift: str
    noise: str
    signal: str
    elements: str


class _Kernel(NamedTuple):
    node: ir.Node
    x_float: ir.Value  # its input before QuantizeLinear
    bias_dq: ir.Node
    pad: ir.Node | None  # an integer Pad between the QuantizeLinear and the DequantizeLinear


def float_parameters(model: ir.Model) -> dict[str, ir.TensorProtocol]:
    """The float weights and biases of the kernels, by value name: taken before materialization."""
    out = {}
    for node in model.graph:
        if node.op_type in KERNELS:
            for value in node.inputs[1:3]:
                if value is not None and value.const_value is not None and value.name:
                    out[value.name] = value.const_value
    return out


def _candidates(model: ir.Model, floats: Mapping[str, ir.TensorProtocol]) -> list[_Kernel]:
    """Each kernel to correct, with its input before QuantizeLinear and the bias's DequantizeLinear."""
    found = []
    for node in model.graph:
        if node.op_type not in KERNELS or len(node.inputs) < 3:
            continue
        x, w, b = node.inputs[0], node.inputs[1], node.inputs[2]
        dq = x.producer() if x is not None else None
        q = dq.inputs[0].producer() if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] else None
        pad = None
        if q is not None and q.op_type == "Pad" and q.inputs[0] is not None:  # on the integers (backends.qdq)
            pad, q = q, q.inputs[0].producer()
        bias_dq = dequantized_constant(b)
        if q is None or q.op_type != "QuantizeLinear" or q.inputs[0] is None or bias_dq is None:
            continue
        if dequantized_constant(w) is None or str(w.name) not in floats or str(b.name) not in floats:  # type: ignore[union-attr]
            continue
        if bias_dq.inputs[0].const_value.dtype != ir.DataType.INT32:  # type: ignore[union-attr]
            continue
        found.append(_Kernel(node, q.inputs[0], bias_dq, pad))
    return found


def _float_source(value: ir.Value, added: list[ir.Node]) -> ir.Value:
    """``value`` as the float model computes it. Where requant quantized before a tree of layout-only
    ops (a Focus stem's Slices and Concat), ``value`` is such an op over dequantized values: the same
    op over their float sources instead (appended to ``added``), so the float kernel reads the input
    unrounded, as it does where the input is quantized right before the kernel."""
    node = value.producer()
    if node is None or node.op_type not in LAYOUT_ONLY:
        return value
    inputs = list(node.inputs)
    for i in data_inputs(node):
        dq = inputs[i].producer() if inputs[i] is not None else None  # type: ignore[union-attr]
        q = dq.inputs[0].producer() if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] else None
        if q is not None and q.op_type == "QuantizeLinear" and q.inputs[0] is not None:
            inputs[i] = _float_source(q.inputs[0], added)
    if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
        return value
    attributes = {a.name: a.value for a in node.attributes.values()}
    copy = ir.node(node.op_type, inputs, attributes, domain=node.domain, num_outputs=len(node.outputs))
    added.append(copy)
    return copy.outputs[value.index() or 0]  # the same output of the copy (a Split has several)


def _probe(
    model: ir.Model, kernels: list[_Kernel], floats: Mapping[str, ir.TensorProtocol]
) -> tuple[ir.Model, list[_Measures]]:
    """A copy of ``model`` computing, per kernel, its float version on the same input and what bias
    correction reads of the two: reduced in the graph to a few numbers per sample (fetching every
    kernel's whole outputs, and reducing them in NumPy, took most of the time)."""
    probe = model.clone()  # its tensors shared: the probe renames none of them, only adds its own
    opset = probe.opset_imports.get("", 13)
    position = {id(n): i for i, n in enumerate(model.graph)}
    nodes = list(probe.graph)
    values = {str(v.name): v for v in graph_values(probe.graph)}
    taken: set[str | None] = set(values)

    def constant(name: str, array: npt.NDArray[Any]) -> ir.Value:
        value = ir.Value(name=fresh_name(name, taken), const_value=ir.Tensor(array))
        probe.graph.register_initializer(value)
        return value

    flat_shape = constant("channels_flat", np.array([0, 0, -1], np.int64))
    axes = constant("rows_and_positions", np.array([0, 2], np.int64))

    def channel_sums(x: ir.Value) -> ir.Node:  # ReduceSum's axes are an input from opset 13
        if opset >= 13:
            return ir.node("ReduceSum", [x, axes], {"keepdims": 0})
        return ir.node("ReduceSum", [x], {"axes": [0, 2], "keepdims": 0})

    measures = []
    for kernel, x_float, _, pad in kernels:
        original = nodes[position[id(kernel)]]
        rebuilt: list[ir.Node] = []
        x = _float_source(values[str(x_float.name)], rebuilt)
        probe.graph.extend(rebuilt)
        if pad is not None:  # the same zero channels, in float
            padded = ir.node("Pad", [x, values[str(pad.inputs[1].name)]])  # type: ignore[union-attr]
            probe.graph.append(padded)
            x = padded.outputs[0]
        params = []
        for value in kernel.inputs[1:3]:
            assert value is not None and value.name is not None
            # a tensor of its own: naming a value renames its tensor, and this one may be the caller's
            params.append(constant(f"{value.name}_float", floats[value.name].numpy()))
        attributes = {a.name: a.value for a in original.attributes.values()}
        reference = ir.node(kernel.op_type, [x, *params], attributes)
        diff = ir.node("Sub", [original.outputs[0], reference.outputs[0]])
        flat = ir.node("Reshape", [diff.outputs[0], flat_shape])  # [N, C, positions]
        size = ir.node("Size", [diff.outputs[0]])
        # over every axis (ONNX Runtime reduces all axes 7x faster than two of them)
        outputs = [
            channel_sums(flat.outputs[0]),
            ir.node("ReduceSumSquare", [diff.outputs[0]], {"keepdims": 0}),
            ir.node("ReduceSumSquare", [reference.outputs[0]], {"keepdims": 0}),
            ir.node("Cast", [size.outputs[0]], {"to": ir.DataType.FLOAT}),
        ]
        base = kernel.name or kernel.op_type
        names = []
        for node, what in zip(outputs, ("bias_shift", "noise", "signal", "elements"), strict=True):
            node.outputs[0].name = fresh_name(f"{base}_{what}", taken)
            names.append(str(node.outputs[0].name))
        probe.graph.extend([reference, diff, flat, size, *outputs])
        measures.append(_Measures(*names))
    return probe, measures


def correct_biases(
    model: ir.Model,
    floats: Mapping[str, ir.TensorProtocol],
    data: Any,
    samples: int = DEFAULT_SAMPLES,
    progress: Progress | None = None,
    apply: bool = True,
    sums: BiasSums | None = None,
) -> list[BiasCorrection]:
    """Measure the int8 kernels of ``model`` (QDQ) on the first ``samples`` samples of ``data`` (fewer
    for large inputs: :func:`~requant.calibration.data.samples_for`) and, with ``apply``, correct their
    int32 biases (in place).

    ``sums``: what an earlier pass on this model (uncorrected) and data summed, to start from (its
    samples are not run again); it is left holding this pass's sums."""
    kernels = _candidates(model, floats)
    if not kernels or samples <= 0:
        return []
    subset = first_samples(model, data, samples)
    sums = sums if sums is not None else BiasSums()
    nodes = [str(k.node.name) for k in kernels]
    if sums.samples > len(subset) or (sums.samples and set(sums.sums) != set(nodes)):
        sums.samples, sums.sums = 0, {}  # not a start of this pass: from the beginning
    probe, measures = _probe(model, kernels, floats)
    kept = [sums.sums.get(node) or (_Sum(), _Sum(), _Sum(), _Sum()) for node in nodes]
    observers = {
        name: observer for m, four in zip(measures, kept, strict=True) for name, observer in zip(m, four, strict=True)
    }
    if sums.samples < len(subset):
        # every ONNX Runtime rewrite (NCHWc float convs; the fake-quantized pairs stay unfused): the sums move in
        # their last digits only, and EfficientNet-Lite0's probe ran 0.4-0.5 s faster over its 72 samples (its 5x5
        # depthwise convs); the other bench models within noise (PP-OCRv4's detector +0.1 s)
        collect(probe, subset[sums.samples :], observers, progress, optimize=True)
    sums.samples, sums.sums = len(subset), dict(zip(nodes, kept, strict=True))
    done = []
    for (kernel, _, bias_dq, _), names in zip(kernels, measures, strict=True):
        total, noise, signal, elements = (observers[name].total for name in names)
        if total is None or noise is None or signal is None or elements is None or not elements:
            continue
        shift = total / (elements / len(total))  # elements / channels: the positions summed
        if not np.isfinite(shift).all() or not math.isfinite(signal):
            raise CalibrationError(
                f"kernel '{kernel.name}': the float model's output there is not finite (or overflows float32 "
                "when squared) on the calibration samples; its bias cannot be measured: check the data's scale"
            )
        sqnr = 10 * np.log10(signal / noise) if noise > 0 and signal > 0 else float("inf")
        if apply:
            quantized = bias_dq.inputs[0]
            assert quantized is not None and quantized.const_value is not None
            scale = bias_dq.inputs[1].const_value.numpy().astype(np.float64)  # type: ignore[union-attr]
            old = quantized.const_value.numpy().astype(np.float64)
            info = np.iinfo(np.int32)
            new = np.clip(np.round(old - shift / scale), info.min, info.max).astype(np.int32)
            quantized.const_value = ir.tensor(new, name=quantized.name)
        magnitude = np.abs(shift)
        done.append(
            BiasCorrection(
                str(kernel.name),
                len(shift),
                float(magnitude.mean()),
                float(magnitude.max()),
                float(sqnr),
                apply,
                len(subset),
            )
        )
    return done
