"""``compare``: a float model and a quantized one (QDQ, from requant or another tool), tensor by tensor.

Each ``QuantizeLinear`` of the quantized model with constant parameters marks a tensor both models
compute: its input is the float tensor of that name (or the value requant recorded on it, where it
dropped a clamp the QuantizeLinear makes redundant: :func:`requant.ir.provenance.quantizes`), or,
when that name is not the float model's and the QuantizeLinear reads ``Mul(x, constant)`` (the
per-channel scale of smoothing: requant's, or NNCF's SmoothQuant), the float tensor ``x`` times that
constant. A tensor whose channels requant's equalization scaled (recorded on it:
:func:`requant.ir.provenance.channel_factors`) is divided by its factors before it is compared. Both
models run on the same samples; the quantized one as ONNX Runtime fuses it (its int8 kernels,
saturation included: the QuantizeLinear outputs are what the fused kernels produce), its integers
dequantized here with the QuantizeLinear's scale and zero point. Per tensor: SQNR (float energy over error energy, dB),
cosine similarity, largest error, and the quantized type; and each tensor's *own* loss: how far
its SQNR falls below the worst of the tensors it is computed from (where the error jumps).

Statistics are running sums: memory does not grow with the number of samples.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir

from requant.calibration.data import check_exists
from requant.calibration.samples import iter_samples
from requant.errors import RequantError
from requant.frontends import load_onnx
from requant.ir.provenance import channel_factors, quantizes
from requant.ir.queries import constant, is_op
from requant.report.agreement import overlap
from requant.report.latency import session
from requant.runtime import SessionError

log = logging.getLogger("requant")

__all__ = ["CompareError", "TensorComparison", "compare"]


class CompareError(RequantError):
    """The two models cannot be compared (no tensor in common, different inputs)."""


@dataclass
class TensorComparison:
    """One tensor both models compute."""

    name: str
    quantized_as: str  # the QuantizeLinear's storage type, scale and zero point
    sqnr_db: float = math.inf
    cosine: float = 1.0
    max_error: float = 0.0
    own_loss_db: float = 0.0  # SQNR of its worst source tensor minus its own (>= 0: the error grew here)
    sources: list[str] = field(default_factory=list)
    position: int = 0  # where its QuantizeLinear is in the quantized model's graph (0: first)
    _signal: float = 0.0
    _noise: float = 0.0
    _dot: float = 0.0
    _quantized_energy: float = 0.0

    def update(self, reference: np.ndarray, got: np.ndarray) -> None:
        reference, got = overlap(reference, got)  # a size that depends on the values: where both computed
        a, b = reference.astype(np.float64).ravel(), got.astype(np.float64).ravel()
        self._signal += float(a @ a)
        self._noise += float((a - b) @ (a - b))
        self._dot += float(a @ b)
        self._quantized_energy += float(b @ b)
        self.max_error = max(self.max_error, float(np.max(np.abs(a - b), initial=0.0)))

    def finish(self) -> None:
        self.sqnr_db = 10 * math.log10(self._signal / self._noise) if self._noise > 0 and self._signal > 0 else math.inf
        norms = math.sqrt(self._signal * self._quantized_energy)
        self.cosine = self._dot / norms if norms > 0 else 1.0

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class _Mark(NamedTuple):
    """A QuantizeLinear: its output, parameters, when it reads ``Mul(x, constant)``, that ``x`` and the
    constant (``scaled``), and the factors equalization scaled its input's channels by (``factors``)."""

    output: str
    scale: np.ndarray
    zero: np.ndarray
    axis: int | None
    scaled: tuple[str, np.ndarray] | None = None
    factors: np.ndarray | None = None


def _scaled(value: ir.Value) -> tuple[str, np.ndarray] | None:
    """(x, c) when ``value`` is ``Mul(x, c)`` with ``c`` constant and ``x`` not."""
    mul = value.producer()
    if mul is None or not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for x, c in (mul.inputs, mul.inputs[::-1]):
        factor = constant(c)
        if x is not None and factor is not None and constant(x) is None:
            return str(x.name), np.asarray(factor, np.float64)
    return None


def _quantized_tensors(model: ir.Model) -> dict[str, _Mark]:
    """Float tensor name -> its mark, for each QuantizeLinear of an activation with constant parameters."""
    found: dict[str, _Mark] = {}
    for node in model.graph:
        if not is_op(node, "QuantizeLinear") or node.inputs[0] is None or node.inputs[0].const_value is not None:
            continue
        scale = constant(node.inputs[1]) if len(node.inputs) > 1 else None
        zero = constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if scale is None:
            continue
        axis = node.attributes.get("axis")
        zero_point = zero if zero is not None else np.zeros_like(scale, dtype=np.uint8)
        on_axis = axis.as_int() if axis is not None else None
        factors = channel_factors(node.inputs[0])
        mark = _Mark(str(node.outputs[0].name), scale, zero_point, on_axis, _scaled(node.inputs[0]), factors)
        found.setdefault(quantizes(node), mark)
    return found


def _with_outputs(model: ir.Model, names: list[str]) -> bytes:
    proto = ir.to_proto(model)
    present = {o.name for o in proto.graph.output}
    for name in names:
        if name not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
    return proto.SerializeToString()  # type: ignore[no-any-return]


def _quantized_session(model: ir.Model, outputs: list[str]) -> tuple[Any, bool]:
    """A session of ``model`` with ``outputs`` exposed, and whether ONNX Runtime's QDQ fusions had to be off for
    it. A quantized value made a graph output changes those fusions, and some then fail (NNCF's per-channel
    activation scales reaching a QLinearAdd, which takes one scale: PP-OCR's detector); without them each op
    runs in float between its conversions, which rounds as the int8 kernels do up to float sums. The model as
    given must load, else its own refusal is raised."""
    exposed = _with_outputs(model, outputs)
    try:
        return session(exposed), False
    except SessionError:
        session(_with_outputs(model, []))  # the model as given: its own error, when it has one
    return session(exposed, fused=False), True


def _sources(model: ir.Model, names: set[str]) -> dict[str, list[str]]:
    """For each compared tensor, the compared tensors it is computed from (through uncompared ones)."""
    producer = {str(o.name): n for n in model.graph for o in n.outputs}
    found: dict[str, list[str]] = {}
    for name in names:
        seen, stack, sources = set(), [name], []
        while stack:
            node = producer.get(stack.pop())
            if node is None:
                continue
            for value in node.inputs:
                key = str(value.name) if value is not None else ""
                if value is None or key in seen or value.const_value is not None or not _floating(value):
                    continue  # constants and shape arithmetic carry no error
                seen.add(key)
                if key in names:
                    sources.append(key)
                else:
                    stack.append(key)
        found[name] = sorted(sources)
    return found


# what tools call a quantized graph output's float value (the output itself keeps NAME, now the
# DequantizeLinear's): requant NAME_float, ONNX Runtime's quantize_static NAME_QuantizeLinear_Input
RENAMED_OUTPUTS = ("_float", "_QuantizeLinear_Input")


def _float_name(name: str, float_names: set[str]) -> str:
    """The float model's name for the quantized model's tensor ``name``: itself, or the graph output a
    tool renamed it from (``RENAMED_OUTPUTS``)."""
    if name in float_names:
        return name
    return next((name.removesuffix(s) for s in RENAMED_OUTPUTS if name.removesuffix(s) in float_names), name)


def _floating(value: ir.Value) -> bool:
    return value.dtype is None or value.dtype.is_floating_point()


def compare(float_model: Any, quantized_model: Any, data: Any, samples: int | None = None) -> list[TensorComparison]:
    """Every tensor both models compute, worst SQNR first (see the module's docstring)."""
    check_exists(data, "comparison")  # before loading anything
    reference, quantized = load_onnx(float_model), load_onnx(quantized_model)
    marks = _quantized_tensors(quantized)
    float_names = {str(v.name) for n in reference.graph for v in n.outputs}
    float_names |= {str(v.name) for v in reference.graph.inputs}
    marks = {_float_name(n, float_names): m for n, m in marks.items()}
    for name, mark in list(marks.items()):  # a smoothed input: the float tensor before its per-channel Mul
        if name not in float_names and mark.scaled is not None and mark.scaled[0] in float_names:
            marks.setdefault(mark.scaled[0], marks.pop(name))
    common = [name for name in marks if name in float_names]
    if not common:
        raise CompareError(
            "the quantized model quantizes no tensor the float model computes (compared by name: the input of "
            "each QuantizeLinear); is it a QDQ model of this float model?"
        )
    results = {name: TensorComparison(name, _describe(marks[name], name), position=i) for i, name in enumerate(common)}
    inputs = {str(v.name) for v in reference.graph.inputs}
    computed = [name for name in common if name not in inputs]  # the inputs' values are the sample's
    float_run = session(_with_outputs(reference, computed))
    quant_run, unfused = _quantized_session(quantized, [marks[n].output for n in common])
    if unfused:
        log.warning("ONNX Runtime refuses the quantized model with its quantized values as outputs (it loads it as "
                    "given): compared with its QDQ fusions off, each op in float between its conversions")  # fmt: skip
    for sample in itertools.islice(iter_samples(reference, data, "comparison"), samples):
        f = dict(zip(computed, float_run.run(computed, sample), strict=True)) if computed else {}
        f.update({name: sample[name] for name in common if name in inputs})
        q = quant_run.run([marks[n].output for n in common], sample)
        for name, stored in zip(common, q, strict=True):
            mark = marks[name]
            smoothed = mark.scaled is not None and mark.scaled[0] == name
            expected = f[name] * mark.scaled[1] if smoothed else f[name]  # type: ignore[index]
            got = _dequantize(np.asarray(stored), mark.scale, mark.zero, mark.axis)
            if mark.factors is not None and got.ndim > 1 and got.shape[1] == mark.factors.size:
                got = got / mark.factors.reshape((-1,) + (1,) * (got.ndim - 2))  # equalization's, undone
            results[name].update(expected, got)
    for result in results.values():
        result.finish()
    for name, sources in _sources(reference, set(common)).items():
        result = results[name]
        result.sources = sources
        worst_source = min((results[s].sqnr_db for s in sources), default=math.inf)
        result.own_loss_db = worst_source - result.sqnr_db if math.isfinite(worst_source) else 0.0
    return sorted(results.values(), key=lambda r: (r.sqnr_db, r.name))


def _describe(mark: _Mark, name: str) -> str:
    scale, zero = mark.scale, mark.zero
    text = f"{zero.dtype}, scale {float(scale):.4g}, zero point {int(zero)}" if scale.size == 1 else (
        f"{zero.dtype}, {scale.size} scales on axis {mark.axis}")  # fmt: skip
    if mark.scaled is not None and mark.scaled[0] == name:
        text += f", times {mark.scaled[1].size} per-channel factors (smoothed)"
    if mark.factors is not None:
        text += f", {int((mark.factors != 1).sum())} of {mark.factors.size} channels scaled up (equalized)"
    return text


def _dequantize(stored: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int | None) -> np.ndarray:
    if scale.size > 1 and axis is not None:
        shape = [1] * stored.ndim
        shape[axis] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (stored.astype(np.float64) - zero.astype(np.float64)) * scale.astype(np.float64)
