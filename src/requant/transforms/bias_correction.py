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
an earlier kernel's shift again. A pointwise convolution is linear in its input and each output
position reads its own: after the first samples (its local SQNR's, ``SQNR_VALUES``) the sum of its
output's difference is ``W_q sum(x_q) - W sum(x)`` plus the biases' difference per position, from
its two inputs' sums per channel, and its float version is not run.

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

from requant.calibration.data import samples_for
from requant.calibration.observers import CalibrationError, Observer
from requant.calibration.runner import Progress, collect
from requant.calibration.samples import first_samples
from requant.ir.queries import dequantized_constant, fresh_name, graph_values
from requant.ir.traits import LAYOUT_ONLY, data_inputs

__all__ = ["KERNELS", "BiasCorrection", "BiasSums", "correct_biases", "float_parameters"]

KERNELS = ("Conv", "Gemm")  # output channels on axis 1 of the output, an int32 bias on input 2
DEFAULT_SAMPLES = 64  # means settle quickly: MobileNetV2 with 32, 64 and 200 samples gave the same KL
# a pointwise convolution (most of a conv net's kernels, and its costliest) is measured against its float
# version computed in full beside it, for its local SQNR, on the first samples holding this many input
# values (16 3x224x224 images; every sample of smaller ones), and at least 8 (``samples_for``; PP-OCRv4's
# detector: its worst kernel's SQNR on 2 of its 736x992 pages was 12.4 dB, on 8 10.5); after them its
# mean shift comes from the sums of its two inputs alone (it is linear: no float kernel to run). Other
# kernels are measured in full on every sample. EfficientNet-Lite0's probe: 22 -> 14 ms a sample after
# the first 16 (float 9 ms); its kernels' SQNR on 8, 16 and 32 samples: at most 1.11, 0.68 and 0.28 dB
# from that on 64
SQNR_VALUES = 16 * 3 * 224 * 224


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
    samples: int = 0  # the calibration samples its mean shift was measured on
    sqnr_samples: int = 0  # the first of them its SQNR was measured on


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
    """What a bias-correction pass has summed: per kernel (by node name), its running sums by what they
    are (``_Measures``), over the first ``samples`` samples of its data. A later pass on the same QDQ
    model (before correction) and the same data starts from them and runs only the samples after:
    ``method="auto"`` corrects the chosen candidate on all samples after measuring it on the first
    few, and its float64 sums are added in the same order either way, so the biases are those of a
    pass from the start."""

    samples: int = 0
    sums: dict[str, dict[str, _Sum]] = field(default_factory=dict)


# The probe's outputs for one kernel, by what they are, each summed over the samples (a ``_Sum``):
# with its float version beside it: "shift", the sums over rows and positions of (quantized - float) per
# output channel [C]; "elements", the output's number of elements; "noise" and "signal", the sums of
# the difference's squares and of the float output's. Without it (a pointwise convolution after the
# first samples): "float_sums" and "sums", the sums of its float and its quantized input over rows and
# positions per input channel [C], and "input_elements", the input's number of elements
_Measures = dict[str, str]


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


def _pointwise(node: ir.Node) -> bool:
    """Whether ``node`` is a 1x1 convolution with stride 1 and no padding (each output position reads
    its own input position), its weight dequantized per tensor or per output channel."""
    dq = dequantized_constant(node.inputs[1]) if node.op_type == "Conv" and len(node.inputs) > 1 else None
    if dq is None or dq.inputs[0] is None or len(dq.inputs) < 2 or dq.inputs[1] is None:
        return False
    shape = tuple(dq.inputs[0].const_value.shape.numpy())  # type: ignore[union-attr]  # a constant
    scale = dq.inputs[1].const_value
    per_tensor = scale is not None and scale.shape.rank() == 0
    return (
        len(shape) == 4
        and shape[2:] == (1, 1)
        and dq.attributes.get("block_size") is None
        and (per_tensor or dq.attributes.get_int("axis", 1) in (0, -4))
        and node.attributes.get_string("auto_pad", "NOTSET") in ("NOTSET", "VALID")
        and all(s == 1 for s in node.attributes.get_ints("strides", [1, 1]) or [1, 1])
        and not any(node.attributes.get_ints("pads", [0, 0, 0, 0]) or [0])
    )


def _probe(
    model: ir.Model, kernels: list[_Kernel], floats: Mapping[str, ir.TensorProtocol], full: bool = True
) -> tuple[ir.Model, list[_Measures]]:
    """A copy of ``model`` computing what bias correction reads of each kernel, reduced in the graph to
    a few numbers per sample (fetching every kernel's whole outputs, and reducing them in NumPy, took
    most of the time): its float version on the same input beside it, for the shift and the SQNR;
    but, unless ``full``, for a pointwise convolution only the sums of its two inputs per channel (see
    ``_Measures``), from which the shift follows without running the float kernel."""
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
    positions = constant("rows_and_pixels", np.array([0, 2, 3], np.int64))

    def summed(x: ir.Value, over: ir.Value) -> ir.Node:  # ReduceSum's axes are an input from opset 13
        if opset >= 13:
            return ir.node("ReduceSum", [x, over], {"keepdims": 0})
        listed = [int(a) for a in over.const_value.numpy()]  # type: ignore[union-attr]  # a constant
        return ir.node("ReduceSum", [x], {"axes": listed, "keepdims": 0})

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
        outputs: dict[str, ir.Node] = {}
        added: list[ir.Node] = []
        if not full and _pointwise(kernel) and original.inputs[0] is not None:  # W sum(x): the inputs' sums
            outputs["float_sums"] = summed(x, positions)
            outputs["sums"] = summed(original.inputs[0], positions)
            size = ir.node("Size", [original.inputs[0]])
            added.append(size)
            outputs["input_elements"] = ir.node("Cast", [size.outputs[0]], {"to": ir.DataType.FLOAT})
        else:
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
            added += [reference, diff, flat, size]
            outputs["shift"] = summed(flat.outputs[0], axes)
            outputs["elements"] = ir.node("Cast", [size.outputs[0]], {"to": ir.DataType.FLOAT})
            # over every axis (ONNX Runtime reduces all axes 7x faster than two of them)
            outputs["noise"] = ir.node("ReduceSumSquare", [diff.outputs[0]], {"keepdims": 0})
            outputs["signal"] = ir.node("ReduceSumSquare", [reference.outputs[0]], {"keepdims": 0})
        base = kernel.name or kernel.op_type
        names = {}
        for what, node in outputs.items():
            node.outputs[0].name = fresh_name(f"{base}_{what}", taken)
            names[what] = str(node.outputs[0].name)
        probe.graph.extend([*added, *outputs.values()])
        measures.append(names)
    return probe, measures


def _dequantized(dq: ir.Node) -> npt.NDArray[np.float64]:
    """What a ``DequantizeLinear`` of constants computes (in float32, as ONNX Runtime does)."""
    stored, scale = (v.const_value.numpy() for v in dq.inputs[:2])  # type: ignore[union-attr]  # constants
    zero = dq.inputs[2].const_value.numpy() if len(dq.inputs) > 2 and dq.inputs[2] is not None else 0  # type: ignore[union-attr]
    shape = [1] * stored.ndim
    if np.ndim(scale):
        shape[dq.attributes.get_int("axis", 1) % stored.ndim] = -1
    difference = stored.astype(np.float32) - np.reshape(zero, shape).astype(np.float32)
    return (difference * np.reshape(scale, shape).astype(np.float32)).astype(np.float64)


def _shift_from_sums(
    kernel: _Kernel, floats: Mapping[str, ir.TensorProtocol], sums: Mapping[str, _Sum]
) -> tuple[npt.NDArray[np.float64], float]:
    """A pointwise convolution's sum over rows and positions of (quantized - float) output per channel,
    and its output's elements, from the sums of its inputs per channel: ``W_q s_q - W s_f``, plus the
    biases' difference once per row and position."""
    node = kernel.node
    w_value, b_value = node.inputs[1], node.inputs[2]
    assert w_value is not None and b_value is not None and w_value.name and b_value.name
    w_dq = dequantized_constant(w_value)
    assert w_dq is not None  # _candidates checked it
    w_q, b_q = _dequantized(w_dq), _dequantized(kernel.bias_dq)
    w_f = floats[w_value.name].numpy().astype(np.float64)
    b_f = floats[b_value.name].numpy().astype(np.float64)
    s_q, s_f, size = (sums[what].total for what in ("sums", "float_sums", "input_elements"))
    assert s_q is not None and s_f is not None and size is not None
    groups = node.attributes.get_int("group", 1)
    out_channels, reads = w_q.shape[0], w_q.shape[1]  # a group's input channels

    def applied(w: npt.NDArray[np.float64], s: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
        by_group = w.reshape(groups, out_channels // groups, reads)
        return (by_group @ s.astype(np.float64).reshape(groups, reads, 1)).reshape(-1)

    positions = float(size) / len(s_q)  # rows times pixels, each read once
    total = applied(w_q, s_q) - applied(w_f, s_f) + positions * (b_q - b_f)
    return total, positions * out_channels


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
    int32 biases (in place). A pointwise convolution's local SQNR is measured on the first of them that
    hold ``SQNR_VALUES`` input values, at least 8 (all of them for small inputs; 16 of
    3x224x224), other kernels' on all (``BiasCorrection.sqnr_samples``).

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
    kept = [sums.sums.setdefault(node, {}) for node in nodes]
    # every ONNX Runtime rewrite (NCHWc float convs; the fake-quantized pairs stay unfused): the sums move in
    # their last digits only, and EfficientNet-Lite0's probe ran 0.4-0.5 s faster over its 72 samples (its 5x5
    # depthwise convs); the other bench models within noise (PP-OCRv4's detector +0.1 s)
    first = samples_for(sum(int(np.size(a)) for a in subset[0].values()), len(subset), SQNR_VALUES)
    for full, end in ((True, first), (False, len(subset))):
        if sums.samples >= end:
            continue
        probe, measures = _probe(model, kernels, floats, full)
        observers = {}
        for names, measured in zip(measures, kept, strict=True):
            for what, name in names.items():
                observers[name] = measured.setdefault(what, _Sum())
            if "noise" in names:  # how many samples its SQNR is over (a count, summed like the rest)
                measured.setdefault("sqnr_samples", _Sum()).update(np.array(end - sums.samples))
        collect(probe, subset[sums.samples : end], observers, progress, optimize=True)
        sums.samples = end
    found = (
        _corrected(kernel, floats, measured, apply, len(subset)) for kernel, measured in zip(kernels, kept, strict=True)
    )
    return [c for c in found if c is not None]


def _corrected(
    kernel: _Kernel, floats: Mapping[str, ir.TensorProtocol], measured: dict[str, Any], apply: bool, samples: int
) -> BiasCorrection | None:
    """What ``kernel``'s sums say (None when nothing was summed), its bias corrected with ``apply``."""
    total, elements, noise, signal = (
        measured[what].total if what in measured else None for what in ("shift", "elements", "noise", "signal")
    )
    if total is None or noise is None or signal is None or elements is None or not elements:
        return None
    if "sums" in measured:  # the samples after the first ones, from the inputs' sums
        more, count = _shift_from_sums(kernel, floats, measured)
        total, elements = total + more, elements + count
    shift = total / (elements / len(total))  # elements / channels: the positions summed
    if not np.isfinite(shift).all() or not math.isfinite(signal):
        raise CalibrationError(
            f"kernel '{kernel.node.name}': the float model's output there is not finite (or overflows float32 "
            "when squared) on the calibration samples; its bias cannot be measured: check the data's scale"
        )
    sqnr = 10 * np.log10(signal / noise) if noise > 0 and signal > 0 else float("inf")
    if apply:
        quantized = kernel.bias_dq.inputs[0]
        assert quantized is not None and quantized.const_value is not None
        scale = kernel.bias_dq.inputs[1].const_value.numpy().astype(np.float64)  # type: ignore[union-attr]
        old = quantized.const_value.numpy().astype(np.float64)
        info = np.iinfo(np.int32)
        new = np.clip(np.round(old - shift / scale), info.min, info.max).astype(np.int32)
        quantized.const_value = ir.tensor(new, name=quantized.name)
    magnitude = np.abs(shift)
    sqnr_samples = int(measured["sqnr_samples"].total)  # with "noise", always
    return BiasCorrection(str(kernel.node.name), len(shift), float(magnitude.mean()), float(magnitude.max()),
                          float(sqnr), apply, samples, sqnr_samples)  # fmt: skip
