"""An accuracy budget: keep float the int8 kernels that bring the drop within it at the least latency.

The drop is measured on the evaluation data, by one of three metrics:

- ``accuracy``: float accuracy minus int8 accuracy (needs labels);
- ``top1``: one minus the top-1 agreement of the two models' first outputs;
- ``cosine``: one minus the mean cosine similarity of the first outputs (embeddings);
- ``detections``: one minus the lower of recall and precision of int8's detections against float's,
  decoded with NMS as a detector's users decode them (:mod:`requant.report.detections`: YOLO's layouts).

The default is ``accuracy`` when the evaluation data has labels, else ``detections`` for a detector, else
``top1`` (the top-1 class of a detector's ``[1, 4 + C, 8400]`` output says nothing).

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

Each set is priced before it is tried (:func:`float_cost_us`, the target's ``CostModel.kernels``):
what its kernels cost in float instead of int8, and the crossing into each one whose input an int8
kernel writes (a conversion and ONNX Runtime's reorders: on ONNX Runtime's AVX2 kernels about 0.55
ns an element into a float 1x1 or depthwise conv, more than the depthwise conv itself). ``k``
doubles for both families at once; a family that meets the budget is bisected below (the smallest
``k`` that meets it), and the other goes on doubling while its next set is priced below the
cheapest found; the set priced least wins (then the fewer kernels, then the region). Each try is a
quantization and an evaluation (every try is in the report, with its price; a set of kernels is
tried once, whichever family names it). Without a cost model the fewest kernels win. It assumes
that keeping more kernels float never raises the drop, and effects measured one at a time do not
add up; both show in the report's tries (measured on MobileNetV2: scattered float kernels made the
top-1 disagreement *worse*, 0.103 -> 0.120 with 16, before it fell).
ONNX Runtime's CPU provider has no fast 16-bit kernel (a uint16 convolution runs in float between
conversions), so on its targets a kernel is promoted straight to float.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from requant.errors import RequantError
from requant.ir.provenance import QUANTIZES_KEY
from requant.ir.queries import (
    DEFAULT_DOMAINS,
    clamp_bounds,
    constant,
    dequantized_constant,
    kernel_macs,
    static_elements,
)
from requant.ir.traits import WEIGHTED
from requant.targets.costs import CostModel
from requant.targets.kernels import is_depthwise

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
    "float_cost_us",
    "kernel_class",
]

METRICS = ("accuracy", "top1", "cosine", "detections")
_NAMES = {"accuracy": "accuracy drop", "top1": "top-1 disagreement", "cosine": "1 - cosine",
          "detections": "1 - min(recall, precision) of float's detections"}  # fmt: skip


class BudgetError(RequantError):
    """An accuracy budget that cannot be measured as asked (no labels for ``accuracy``...)."""


def choose_metric(metric: str | None, has_labels: bool, detector: bool = False) -> str:
    """The metric to use: the one asked for, or ``accuracy`` with labels, ``detections`` for a ``detector``
    (a detection head among its outputs) and ``top1`` otherwise."""
    if metric is None:
        return "accuracy" if has_labels else "detections" if detector else "top1"
    if metric not in METRICS:
        raise BudgetError(f"the budget's metric {metric!r} is not one of {', '.join(METRICS)}")
    if metric == "accuracy" and not has_labels:
        raise BudgetError("the budget's metric 'accuracy' needs labels in the evaluation data ('labels', or a data "
                          "loader's (x, y) with class indices y)")  # fmt: skip
    if metric == "detections" and not detector:
        raise BudgetError("the budget's metric 'detections' needs a detector: no output of the model is a detection "
                          "head on the evaluation data (boxes and class scores, YOLO's [1, 4 + classes, anchors])")
    return metric


def drop(evaluation: Mapping[str, float], metric: str) -> float:
    """How much the int8 model loses on ``metric``, from an evaluation record (``requant.quantize``'s)."""
    if metric == "accuracy" and "float_accuracy" not in evaluation:  # a data loader's targets, not all class indices
        raise BudgetError("the budget's metric 'accuracy' needs a class index per prediction: the evaluation data's "
                          "targets are not all integers of one value per sample row")  # fmt: skip
    if metric == "accuracy":
        return evaluation["float_accuracy"] - evaluation["int8_accuracy"]
    if metric == "top1":
        return 1.0 - evaluation["top1_agreement"]
    if metric == "detections":
        return 1.0 - min(evaluation["recall"], evaluation["precision"])
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
    modelled_us: float = 0.0  # what keeping them float adds to a run, modelled (float_cost_us)


def fewest(count: int, within: Callable[[int], bool]) -> int | None:
    """The smallest ``k`` in ``[1, count]`` with ``within(k)``, by doubling then bisection (each ``k``
    tried once); None when not even ``count`` is within."""
    found = fewest_of(["only"], count, lambda _, k: within(k))
    return None if found is None else found[1]


def fewest_of(
    families: Sequence[str],
    count: int,
    within: Callable[[str, int], bool],
    cost: Callable[[str, int], float] | None = None,
) -> tuple[str, int] | None:
    """The family and ``k`` in ``[1, count]`` with ``within(family, k)`` whose ``cost(family, k)`` is
    least (by default ``k``: the fewest kernels); on a tie the smaller ``k``, then the family named
    last. ``k`` doubles for every family at once; a family within at some ``k`` is bisected below it
    (each pair tried once) and stops; the others go on doubling while their cost at the next ``k``
    is not above the best found (more kernels float cost more). None when no family is within even
    at ``count``."""
    tried: dict[tuple[str, int], bool] = {}
    price = cost or (lambda family, k: float(k))

    def ok(family: str, k: int) -> bool:
        if (family, k) not in tried:
            tried[family, k] = within(family, k)
        return tried[family, k]

    def key(pair: tuple[str, int]) -> tuple[float, int, int]:
        return price(*pair), pair[1], -list(families).index(pair[0])

    if count < 1:
        return None
    below = dict.fromkeys(families, 0)  # the largest k not within, per family
    doubling, k = list(families), 1
    while doubling:
        k = min(k, count)
        for family in list(doubling):
            found = [pair for pair, met in tried.items() if met]
            if found and price(family, k) > min(price(*pair) for pair in found):
                doubling.remove(family)  # every k from here costs more than what is within
            elif ok(family, k):
                low, good = below[family], k
                while good - low > 1:
                    middle = (good + low) // 2
                    if ok(family, middle):
                        good = middle
                    else:
                        low = middle
                doubling.remove(family)
            else:
                below[family] = k
        if k == count:
            break
        k *= 2
    met = [pair for pair, ok_ in tried.items() if ok_]
    return min(met, key=key) if met else None


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


def kernel_class(node: ir.Node) -> str | None:
    """The cost model's class of an int8 kernel (``targets.costs.KERNEL_CLASSES``): a 1x1 conv is
    ``pointwise``, a depthwise one ``depthwise``, any other conv ``dense``, a MatMul, Gemm or
    MatMulIntegerToFloat ``linear``; None for the rest (an LSTM: not modelled)."""
    if node.op_type in ("MatMul", "Gemm", "MatMulIntegerToFloat"):
        return "linear"
    shape = node.inputs[1].shape if node.op_type == "Conv" and node.inputs[1] is not None else None
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape):
        return None
    dims = tuple(d for d in shape if isinstance(d, int))
    if is_depthwise(dims, node.attributes.get_int("group", 1)):
        return "depthwise"
    return "pointwise" if all(d == 1 for d in dims[2:]) else "dense"


def float_cost_us(
    model: ir.Model, nodes: Collection[str], costs: CostModel, dims: Mapping[str, int] | None = None
) -> float:
    """What keeping ``nodes`` (int8 kernels of ``model``) float adds to a run, in modelled microseconds
    (``costs.kernels``): each one's float cost less its int8 cost, and the crossing of its input where
    an int8 kernel (not one of ``nodes``) writes it, through the ops between (one float region from
    the inputs has none; scattered kernels have one each). ``dims``: sizes of symbolic dimensions (a
    sequence's length; others count 1). A kernel the model has no class or shape for costs nothing."""
    dims = dims or {}
    kept = set(nodes)
    int8 = set(int8_kernels(model))
    by_name = {n.name: n for n in model.graph if n.name in kept}
    up_memo: dict[int, set[str]] = {}

    def is_kernel(node: ir.Node) -> bool:
        return node.op_type in WEIGHTED or (node.domain == "com.microsoft" and node.op_type in WRITTEN_INT8)

    def up(value: ir.Value) -> set[str]:  # the int8 kernels writing ``value``, through the ops between
        if id(value) not in up_memo:
            node, found = value.producer(), set[str]()
            up_memo[id(value)] = found
            if node is not None and node.name in int8:
                found.add(node.name)
            elif node is not None and not is_kernel(node):
                for v in node.inputs:
                    if v is not None and constant(v) is None:
                        found |= up(v)
        return up_memo[id(value)]

    total = 0.0
    for name in sorted(kept):
        node = by_name.get(name)
        kind = kernel_class(node) if node is not None else None
        price = costs.kernels.get(kind) if kind is not None else None
        macs = kernel_macs(node, dims) if node is not None and price is not None else None
        if node is None or price is None or macs is None:
            continue
        total += price.float_op.us(macs) - price.int8_op.us(macs)
        x = node.inputs[0]
        if x is not None and up(x) - kept:
            total += price.input_crossing.us(static_elements(x, dims) or 0)
    return total


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
