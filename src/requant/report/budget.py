"""An accuracy budget: keep float the fewest int8 kernels that bring the drop within it.

The drop is measured on the evaluation data, by one of three metrics:

- ``accuracy``: float accuracy minus int8 accuracy (needs labels);
- ``top1``: one minus the top-1 agreement of the two models' first outputs;
- ``cosine``: one minus the mean cosine similarity of the first outputs (embeddings).

The default is ``accuracy`` when the evaluation data has labels, else ``top1``.

Two families of kernel sets are tried (:func:`fewest_of`):

- ``ranked``: the ``k`` most effective kernels, ranked by their measured effect
  (:func:`effect_ranking`): how much the first output's SQNR against the float model rises when
  that kernel alone computes in float, in ONNX Runtime with every other kernel fused as it is (a
  kernel that saturates on this CPU shows);
- ``first``: the first ``k`` kernels in graph order, one float region from the model's inputs.
  Errors made early are carried through every later layer, and one region has one float/int8
  boundary: on MobileNetV2 (bench data, top-1 disagreement 0.103) its first 3 kernels float gave
  0.080 at 0.70x float latency, where the 21 most effective, scattered, gave 0.060 at 1.60x (every
  boundary a DequantizeLinear, a QuantizeLinear and a layout change).

``k`` grows by doubling for both families at once, then each family that met the budget is
bisected below the smallest ``k`` met; each try is a quantization and an evaluation (every try is
in the report; a set of kernels is tried once, whichever family names it). The fewest kernels
win, and on a tie the ``first`` region (fewer boundaries). It assumes that keeping more kernels
float never raises the drop, and effects measured one at a time do not add up; both show in the
report's tries (measured on MobileNetV2: scattered float kernels made the top-1 disagreement
*worse*, 0.103 -> 0.120 with 16, before it fell).
ONNX Runtime's CPU provider has no fast 16-bit kernel (a uint16 convolution runs in float between
conversions), so on its targets a kernel is promoted straight to float.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.provenance import QUANTIZES_KEY
from requant.ir.queries import DEFAULT_DOMAINS, clamp_bounds, dequantized_constant
from requant.ir.traits import WEIGHTED

__all__ = [
    "FAMILIES",
    "METRICS",
    "BudgetError",
    "BudgetStep",
    "choose_metric",
    "drop",
    "effect_ranking",
    "fewest",
    "fewest_of",
]

METRICS = ("accuracy", "top1", "cosine")
_NAMES = {"accuracy": "accuracy drop", "top1": "top-1 disagreement", "cosine": "1 - cosine"}


class BudgetError(RequantError):
    """An accuracy budget that cannot be measured as asked (no labels for ``accuracy``...)."""


def choose_metric(metric: str | None, has_labels: bool) -> str:
    """The metric to use: the one asked for, or ``accuracy`` with labels and ``top1`` without."""
    if metric is None:
        return "accuracy" if has_labels else "top1"
    if metric not in METRICS:
        raise BudgetError(f"the budget's metric {metric!r} is not one of {', '.join(METRICS)}")
    if metric == "accuracy" and not has_labels:
        raise BudgetError("the budget's metric 'accuracy' needs labels in the evaluation data ('labels')")
    return metric


def drop(evaluation: Mapping[str, float], metric: str) -> float:
    """How much the int8 model loses on ``metric``, from an evaluation record (``requant.quantize``'s)."""
    if metric == "accuracy":
        return evaluation["float_accuracy"] - evaluation["int8_accuracy"]
    if metric == "top1":
        return 1.0 - evaluation["top1_agreement"]
    return 1.0 - evaluation["cosine_similarity"]


def describe(metric: str) -> str:
    return _NAMES[metric]


# the families of kernel sets a budget tries, and what each means (the report's words)
FAMILIES = {
    "ranked": "the most effective kernels (measured one at a time)",
    "first": "the first kernels in graph order (one float region from the inputs)",
}


@dataclass
class BudgetStep:
    """One try: ``kept_float`` kernels kept float (``family``'s first ones), and the drop measured."""

    kept_float: int
    drop: float
    nodes: list[str] = field(default_factory=list)
    family: str = "ranked"


def fewest(count: int, within: Callable[[int], bool]) -> int | None:
    """The smallest ``k`` in ``[1, count]`` with ``within(k)``, by doubling then bisection (each ``k``
    tried once); None when not even ``count`` is within."""
    found = fewest_of(["only"], count, lambda _, k: within(k))
    return None if found is None else found[1]


def fewest_of(families: Sequence[str], count: int, within: Callable[[str, int], bool]) -> tuple[str, int] | None:
    """The family and smallest ``k`` in ``[1, count]`` with ``within(family, k)``: ``k`` doubles for
    every family at once until one is within, then each family within there is bisected below it
    (each pair tried once). The smallest ``k`` wins; a tie goes to the family named last. None
    when no family is within even at ``count``."""
    tried: dict[tuple[str, int], bool] = {}

    def ok(family: str, k: int) -> bool:
        if (family, k) not in tried:
            tried[family, k] = within(family, k)
        return tried[family, k]

    if count < 1:
        return None
    bad, k = 0, 1
    while True:
        k = min(k, count)
        hits = [f for f in families if ok(f, k)]
        if hits or k == count:
            break
        bad, k = k, 2 * k
    best: tuple[str, int] | None = None
    for family in hits:
        low, good = bad, k  # not within at ``low`` (or 0), within at ``good``
        while good - low > 1:
            middle = (good + low) // 2
            if ok(family, middle):
                good = middle
            else:
                low = middle
        if best is None or good <= best[1]:
            best = (family, good)
    return best


# kernels requant writes itself in ONNX Runtime's integer form (the rest stay DequantizeLinear -> op)
WRITTEN_INT8 = ("MatMulIntegerToFloat", "DynamicQuantizeLSTM")


def int8_kernels(model: ir.Model) -> list[str]:
    """The names of ``model``'s int8 kernels, in graph order: a weighted op (``traits.WEIGHTED``) whose
    weight is dequantized from a constant, or one requant wrote in ONNX Runtime's integer form (a
    linear layer with a float output, an LSTM). The budget's candidates: the convolutions and Gemms
    that bias correction measures, and these (the linear layers of a transformer)."""
    names = []
    for node in model.graph:
        if not node.name:
            continue
        if node.domain == "com.microsoft" and node.op_type in WRITTEN_INT8:
            names.append(node.name)
            continue
        spec = WEIGHTED.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if spec is not None and len(node.inputs) > spec[0] and dequantized_constant(node.inputs[spec[0]]):
            names.append(node.name)
    return names


def _float_variant(
    quantized: onnx.ModelProto,
    floats: Mapping[str, onnx.TensorProto],
    kernel: str,
    bounds: Mapping[str, tuple[float, float]],
) -> onnx.ModelProto | None:
    """``quantized`` with one kernel computing in float: its input read before its QuantizeLinear, its
    weight and bias the float model's (the kernel's output keeps its quantization). None if the
    kernel is not ``DequantizeLinear -> op`` on its input and weight."""
    producer = {out: node for node in quantized.graph.node for out in node.output}
    node = next((n for n in quantized.graph.node if n.name == kernel), None)
    if node is None or len(node.input) < 2:
        return None
    if node.op_type == "MatMulIntegerToFloat":
        return _float_matmul(quantized, node, producer, bounds)
    dq = producer.get(node.input[0])
    q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if q is None or q.op_type != "QuantizeLinear" or any(n not in floats for n in node.input[1:3] if n):
        return None
    stored = {t.name: t for t in quantized.graph.initializer}
    for name in (n for n in node.input[1:3] if n):  # the float model's weight must be the one quantized
        reader = producer.get(name)
        source = stored.get(reader.input[0]) if reader is not None and reader.op_type == "DequantizeLinear" else None
        if source is None or list(source.dims) != list(floats[name].dims):
            return None  # a weight a decomposition reshaped (zero channels for a padded input)
    variant = onnx.ModelProto()
    variant.CopyFrom(quantized)
    target = next(n for n in variant.graph.node if n.name == kernel)
    source = _float_input(variant, q, bounds)
    if source is None:
        return None
    target.input[0] = source
    for index in (1, 2):
        if index < len(target.input) and target.input[index]:
            name = f"{target.input[index]}_requant_float"
            tensor = onnx.TensorProto()
            tensor.CopyFrom(floats[target.input[index]])
            tensor.name = name
            variant.graph.initializer.append(tensor)
            target.input[index] = name
    return variant


def clamps(float_model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """The float model's ReLU and Clip outputs with their bounds (constant ones), by value name."""
    found = {}
    for node in ir.serde.deserialize_model(float_model).graph:  # its tensors read lazily: ~10 ms
        bounds = clamp_bounds(node)
        if bounds is not None:
            found[str(node.outputs[0].name)] = bounds
    return found


def _float_input(variant: onnx.ModelProto, q: onnx.NodeProto, bounds: Mapping[str, tuple[float, float]]) -> str | None:
    """The float value a kernel reads in its float variant: the QuantizeLinear's input or, where
    requant dropped a clamp that quantization makes redundant (a ReLU or ReLU6 before it: the node
    records the float value it stands for, ``requant.quantizes``), that input clamped as the float
    model clamps it (``bounds``: :func:`clamps`), the Clip added to ``variant``. Without the clamp
    the kernel read values the float model never gives it (MobileNetV2's convs after a ReLU6: large
    negative effects); clamping to the quantized type's range instead would also undo a too-narrow
    range's clipping, which is the quantization error measured. None if the clamp is not known."""
    stands_for = next((p.value for p in q.metadata_props if p.key == QUANTIZES_KEY), None)
    if stands_for is None:
        return str(q.input[0])
    if stands_for not in bounds:
        return None
    names = [f"{q.output[0]}_requant_float_{end}" for end in ("low", "high")]
    for name, bound in zip(names, bounds[stands_for], strict=True):
        variant.graph.initializer.append(onnx.numpy_helper.from_array(np.array(bound, np.float32), name))
    clamped = f"{q.output[0]}_requant_float_input"
    position = next(i for i, n in enumerate(variant.graph.node) if list(n.output) == list(q.output))
    variant.graph.node.insert(position, onnx.helper.make_node("Clip", [q.input[0], *names], [clamped]))
    return clamped


def _float_matmul(
    quantized: onnx.ModelProto,
    node: onnx.NodeProto,
    producer: Mapping[str, onnx.NodeProto],
    bounds: Mapping[str, tuple[float, float]],
) -> onnx.ModelProto | None:
    """``quantized`` with one ``MatMulIntegerToFloat`` (what requant writes for a linear layer with a
    float output) computing in float: ``MatMul`` of its input read before its QuantizeLinear and its
    weight dequantized, plus its bias. Its weights are the int8 ones, dequantized: the float model's
    differ (smoothed ones, or none at all for a model whose linear layers requant scaled), so the
    effect is that of quantizing the layer's input and computing in integers, not of the weight's own
    rounding. None if the input is not a QuantizeLinear's output or the weight, its scale or zero point
    are not constants."""
    q = producer.get(node.input[0])
    stored = {t.name: t for t in quantized.graph.initializer}
    names = list(node.input) + [""] * (7 - len(node.input))
    weight, scale, zero, bias = names[1], names[3], names[5], names[6]
    if q is None or q.op_type != "QuantizeLinear" or weight not in stored or scale not in stored:
        return None
    if zero and zero not in stored:
        return None
    ints = onnx.numpy_helper.to_array(stored[weight]).astype(np.float64)
    offset = onnx.numpy_helper.to_array(stored[zero]).astype(np.float64) if zero else 0.0
    dequantized = ((ints - offset) * onnx.numpy_helper.to_array(stored[scale]).astype(np.float64)).astype(np.float32)
    variant = onnx.ModelProto()
    variant.CopyFrom(quantized)
    source = _float_input(variant, q, bounds)
    if source is None:
        return None
    position, target = next((i, n) for i, n in enumerate(variant.graph.node) if n.name == node.name)
    float_weight = f"{weight}_requant_float"
    variant.graph.initializer.append(onnx.numpy_helper.from_array(dequantized, float_weight))
    out = target.output[0]
    product = f"{out}_requant_float_product" if bias else out
    replacement = [onnx.helper.make_node("MatMul", [source, float_weight], [product], name=f"{node.name}_float")]
    if bias:
        replacement.append(onnx.helper.make_node("Add", [product, bias], [out], name=f"{node.name}_float_bias"))
    del variant.graph.node[position]
    for offset_in_graph, new in enumerate(replacement):
        variant.graph.node.insert(position + offset_in_graph, new)
    return variant


def effect_ranking(
    quantized: onnx.ModelProto,
    float_model: onnx.ModelProto,
    kernels: Sequence[str],
    samples: Sequence[Mapping[str, np.ndarray]],
    make_session: Callable[[onnx.ModelProto], Any],
    weights: Mapping[str, onnx.TensorProto] | None = None,
) -> list[tuple[str, float]]:
    """Each kernel's measured effect: how much the first output's SQNR against the float model rises
    (dB) on ``samples`` when that kernel alone computes in float, largest first. Kernels that cannot
    be made float this way come last (effect -inf). ``weights``: the kernels' float weights and biases
    as they were quantized, by name, where they differ from ``float_model``'s (smoothed, equalized:
    with the original ones, an equalized depthwise conv would read scaled channels with unscaled
    weights)."""
    floats = {t.name: t for t in float_model.graph.initializer} | dict(weights or {})
    bounds = clamps(float_model)
    reference = make_session(float_model)
    expected = [np.asarray(reference.run(None, dict(s))[0], np.float64) for s in samples]
    signal = sum(float((e**2).sum()) for e in expected)

    def sqnr(model: onnx.ModelProto) -> float:
        run = make_session(model)
        noise = sum(float(((np.asarray(run.run(None, dict(s))[0], np.float64) - e) ** 2).sum())
                    for s, e in zip(samples, expected, strict=True))  # fmt: skip
        return 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf

    base = sqnr(quantized)
    effects = []
    for kernel in kernels:
        variant = _float_variant(quantized, floats, kernel, bounds)
        effects.append((kernel, sqnr(variant) - base if variant is not None else -math.inf))
    return sorted(effects, key=lambda e: (-e[1], e[0]))
