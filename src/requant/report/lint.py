"""QuantLint for ONNX Runtime: what the runtime really did with a QDQ model.

The model is loaded in ONNX Runtime with its optimized graph saved; that graph says which
kernels became int8 kernels and which stayed float between a DequantizeLinear and a
QuantizeLinear (the "quantized model is slower than float" complaint), which QuantizeLinear ->
DequantizeLinear pairs were left with nothing fused between them, which constants are
dequantized at run time instead of being consumed by an int8 kernel, which uint8 x int8 kernels
can saturate on x86 CPUs without VNNI (:mod:`requant.report.saturation`), and, for a model requant
wrote, which nodes a quantizer accepted (``requant.annotated_by`` on the node, for a config that
quantizes) that ONNX Runtime still runs as a float op.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]

from requant.quantizers.pattern_quantizer import ANNOTATED_KEY, KEPT_FLOAT_KEY, asks_for_int8
from requant.report.saturation import SaturationFinding, find_saturation
from requant.runtime import cpu_session
from requant.targets.kernels import HOST_MODELS, ONNXRUNTIME_X86, host_kernel_model, softmax_length

__all__ = ["INT8_KERNELS", "LintResult", "lint"]

INT8_KERNELS = frozenset(
    {
        "QLinearConv", "QLinearConvTranspose", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "MatMulNBits", "QGemm", "ConvInteger", "QLinearAdd",
        "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool", "QLinearGlobalAveragePool",
        "QLinearConcat", "QLinearSoftmax", "QLinearReduceMean", "QLinearWhere", "QAttention",
        "QEmbedLayerNormalization",
    }
)  # fmt: skip
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


@dataclass
class LintResult:
    """What ONNX Runtime made of the model."""

    int8_kernels: dict[str, int] = field(default_factory=dict)
    float_between_qdq: list[str] = field(default_factory=list)
    qdq_pairs: list[str] = field(default_factory=list)
    dequantized_constants: list[str] = field(default_factory=list)
    asked_but_float: list[str] = field(default_factory=list)
    kept_float: list[str] = field(default_factory=list)  # float between DQ and Q by a target's rule, with why
    op_counts: dict[str, int] = field(default_factory=dict)
    weighted_kernels: int = 0  # uint8 x int8 kernels with constant weights, checked for saturation
    can_saturate: list[SaturationFinding] = field(default_factory=list)  # on x86 CPUs without VNNI
    softmax_overflows: list[str] = field(default_factory=list)  # QLinearSoftmax whose top comes out as 0
    this_cpu: str = ""  # the kernel model of the CPU lint ran on (kernels.host_kernel_model)

    @property
    def clean(self) -> bool:
        """Nothing stayed float that should not have, no pair was left, and no kernel can saturate or overflow."""
        return not (
            self.float_between_qdq or self.qdq_pairs or self.asked_but_float or self.can_saturate
            or self.softmax_overflows
        )  # fmt: skip

    @property
    def fused(self) -> int:
        return sum(self.int8_kernels.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "int8_kernels": self.int8_kernels,
            "float_between_dequantize_and_quantize": self.float_between_qdq,
            "leftover_quantize_dequantize_pairs": self.qdq_pairs,
            "dequantized_constants": self.dequantized_constants,
            "asked_to_be_quantized_but_float": self.asked_but_float,
            "kept_float_by_decision": self.kept_float,
            "optimized_graph_ops": self.op_counts,
            "saturation": {
                "cpus": ONNXRUNTIME_X86.cpus,
                "kernels_checked": self.weighted_kernels,
                "can_saturate": [f.__dict__ for f in self.can_saturate],
                "this_cpu": self.this_cpu,
            },
            "softmax_can_overflow": self.softmax_overflows,
        }

    @classmethod
    def from_json(cls, section: Mapping[str, Any]) -> LintResult:
        """The result :meth:`to_json` wrote (a saved report's ``lint``)."""
        saturation = section["saturation"]
        return cls(
            dict(section["int8_kernels"]),
            list(section["float_between_dequantize_and_quantize"]),
            list(section["leftover_quantize_dequantize_pairs"]),
            list(section["dequantized_constants"]),
            list(section["asked_to_be_quantized_but_float"]),
            list(section["kept_float_by_decision"]),
            dict(section["optimized_graph_ops"]),
            int(saturation["kernels_checked"]),
            [SaturationFinding(**f) for f in saturation["can_saturate"]],
            list(section["softmax_can_overflow"]),
            str(saturation.get("this_cpu", "")),  # reports written before 2026-11-29 have none
        )

    def text(self) -> str:
        kernels = ", ".join(f"{k} x{v}" for k, v in sorted(self.int8_kernels.items())) or "none"
        lines = [f"int8 kernels: {self.fused} ({kernels})"]
        if self.float_between_qdq:
            lines.append(
                f"stayed float between DequantizeLinear and QuantizeLinear: {', '.join(self.float_between_qdq)}"
            )
        if self.qdq_pairs:
            lines.append(f"QuantizeLinear -> DequantizeLinear with nothing fused: {len(self.qdq_pairs)}")
        if self.asked_but_float:
            lines.append(
                f"asked to be quantized, but ONNX Runtime runs them in float: {', '.join(self.asked_but_float)}"
            )
        if self.kept_float:
            lines.append(f"kept float between DequantizeLinear and QuantizeLinear by decision: {len(self.kept_float)}")
        if self.dequantized_constants:
            lines.append(f"constants dequantized at run time: {len(self.dequantized_constants)}")
        if self.can_saturate:
            worst = max(self.can_saturate, key=lambda f: f.worst_accumulator_error)
            lines.append(
                f"can saturate on x86 CPUs without VNNI (int16 pair sums): {len(self.can_saturate)} of "
                f"{self.weighted_kernels} uint8 x int8 kernels; worst {worst.text()}"
            )
            host = HOST_MODELS.get(self.this_cpu)
            if host is not None:
                lines.append(
                    f"this CPU: {host.name}: "
                    + ("its sums are exact, these kernels do not saturate here" if host.exact else "one of those CPUs")
                )
        if self.softmax_overflows:
            lines.append(
                "QLinearSoftmax returning 0 for a row's largest probabilities (its float32 product of exp and "
                f"floor(1 / output scale) overflows): {'; '.join(self.softmax_overflows)}"
            )
        return "\n".join(lines)


def _softmax_overflow(node: onnx.NodeProto, shapes: dict[str, list[int | None]], scales: dict[str, float]) -> str:
    """Why ONNX Runtime's QLinearSoftmax ``node`` returns the zero point for a row's largest values, or
    ``""``: its exp table tops out at ``FLT_MAX / (D e**5)`` and each entry is multiplied by
    ``floor(1 / output scale)`` in float32, so beyond ``D e**5`` the product is infinite. (Propagation
    keeps requant's own scales a little coarser still: ``kernels.QLINEAR_SOFTMAX_OVERFLOW``, 148.)"""
    scale = scales.get(node.input[3]) if len(node.input) > 3 else None
    dims = shapes.get(node.input[0])
    attributes = {a.name: a.i for a in node.attribute}
    count = softmax_length(dims or [], attributes.get("axis"), attributes.get("opset", 13))
    if scale is None or scale <= 0 or count is None or math.floor(1 / scale) <= math.exp(5) * count:
        return ""
    finest = 1 / (math.exp(5) * count)
    return f"'{node.name or node.op_type}': output scale {scale:.4g} over {count} values (finer than {finest:.4g})"


def _softmax_overflows(optimized: onnx.ModelProto) -> list[str]:
    """The QLinearSoftmax nodes of ONNX Runtime's optimized graph that overflow (``_softmax_overflow``)."""
    softmaxes = [n for n in optimized.graph.node if n.op_type == "QLinearSoftmax"]
    if not softmaxes:
        return []
    typed = onnx.shape_inference.infer_shapes(optimized).graph  # the optimized graph keeps few shapes
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in (*typed.value_info, *typed.input, *typed.output)
    }
    scales = {t.name: float(onnx.numpy_helper.to_array(t).reshape(-1)[0]) for t in optimized.graph.initializer
              if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) <= 1 and math.prod(t.dims) == 1}  # fmt: skip
    return [found for n in softmaxes if (found := _softmax_overflow(n, shapes, scales))]


def _asked(node: onnx.NodeProto) -> bool:
    """Did a requant quantizer accept this node for a quantized config (not FLOAT, not shared)?"""
    return asks_for_int8(next((p.value for p in node.metadata_props if p.key == ANNOTATED_KEY), ""))


def lint(model: ir.Model | onnx.ModelProto) -> LintResult:
    """Load ``model`` in ONNX Runtime (CPU, extended optimizations) and read its optimized graph."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    kept = {n.name: p.value for n in proto.graph.node for p in n.metadata_props if p.key == KEPT_FLOAT_KEY}
    asked_nodes = [node for node in proto.graph.node if _asked(node) and node.name not in kept]
    asked = {node.name: f"{node.op_type} '{node.name}'" for node in asked_nodes}
    # a node ONNX Runtime rewrote (MatMul + Add fused into a Gemm) has a new name but still
    # produces the last original node's output: join on that too
    asked_outputs = {out: f"{node.op_type} '{node.name}'" for node in asked_nodes for out in node.output}
    # ... or reads its dequantized weight (a MatMul fused with its float bias Add into a float Gemm)
    initializers = {t.name for t in proto.graph.initializer}
    dequantized_weights = {
        n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers
    }
    asked_weights = {
        name: f"{node.op_type} '{node.name}'"
        for node in asked_nodes
        for name in node.input[1:]
        if name in dequantized_weights
    }
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        cpu_session(proto.SerializeToString(), options, "lint", written=False)
        optimized = onnx.load(options.optimized_model_filepath)
    graph = optimized.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = {init.name for init in graph.initializer}
    result = LintResult(op_counts=dict(Counter(n.op_type for n in graph.node)), this_cpu=host_kernel_model().name)
    result.weighted_kernels, result.can_saturate = find_saturation(graph)
    result.int8_kernels = dict(Counter(n.op_type for n in graph.node if n.op_type in INT8_KERNELS))
    result.softmax_overflows = _softmax_overflows(optimized)
    for node in graph.node:
        label = node.name or node.op_type
        if node.op_type == "DequantizeLinear" and node.input and node.input[0] in constants:
            result.dequantized_constants.append(label)
        if node.op_type == "QuantizeLinear" and any(
            c.op_type == "DequantizeLinear" for c in consumers.get(node.output[0], [])
        ):
            result.qdq_pairs.append(label)
        if node.op_type in _QDQ or node.op_type in INT8_KERNELS:
            continue
        original = (
            asked.get(node.name)
            or next((asked_outputs[o] for o in node.output if o in asked_outputs), None)
            or next((asked_weights[i] for i in node.input if i in asked_weights), None)
        )
        if original is not None:  # ONNX Runtime keeps the names of the nodes it did not fuse
            runs_as = node.op_type if node.name in asked else f"{node.op_type} '{node.name or node.op_type}'"
            result.asked_but_float.append(f"{original} (runs as {runs_as})")
        fed = any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in node.input)
        feeds = any(c.op_type == "QuantizeLinear" for o in node.output for c in consumers.get(o, []))
        if fed and feeds and node.name not in kept:
            result.float_between_qdq.append(f"{node.op_type} '{label}'")
    between = _kept_between_conversions(graph, kept, producer, consumers)
    result.kept_float = [f"{n.op_type} '{n.name}': {kept[n.name]}" for n in graph.node if n.name in between]
    return result


def _kept_between_conversions(
    graph: onnx.GraphProto,
    kept: dict[str, str],
    producer: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
) -> set[str]:
    """The float nodes a target's rule kept float that sit between a DequantizeLinear and a QuantizeLinear, alone or in
    a chain of such nodes (a squeeze-and-excitation gate's 1x1 convolutions, Relu and HardSigmoid)."""
    nodes = [n for n in graph.node if n.name and n.name in kept and n.op_type not in (*_QDQ, *INT8_KERNELS)]
    fed: set[str] = set()
    for node in nodes:  # the optimized graph is in topological order
        sources = [producer.get(i) for i in node.input]
        if any(p is not None and (p.op_type == "DequantizeLinear" or p.name in fed) for p in sources):
            fed.add(node.name)
    feeds: set[str] = set()
    for node in reversed(nodes):
        readers = [c for o in node.output for c in consumers.get(o, [])]
        if any(c.op_type == "QuantizeLinear" or c.name in feeds for c in readers):
            feeds.add(node.name)
    return fed & feeds
