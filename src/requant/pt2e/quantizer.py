"""requant as a PT2E quantizer: requant's configs written as ``quantization_annotation``s on an ATen graph.

``RequantQuantizer(quantizer)`` takes requant's own :class:`~requant.quantizers.Quantizer` (its global
config, presets, and per-op, per-node, per-module selections: the first selection that finds a node
gives its config, as on ONNX) and annotates the graph ``torch.export`` gives, so that ``prepare_pt2e``,
calibration and ``convert_pt2e`` give the program requant decided. Which ops it annotates, and how, is
the target's table (:data:`requant.targets.xnnpack.XNNPACK_OPS`), one rule per role:

- a kernel (conv, linear) reads its input on the type of what wrote it (one type per value, as requant's
  propagation keeps it), its weight per output channel, its bias float; it writes its own type after
  the activation it folds (ReLU, ReLU6, a clamp);
- a binary op (add, mul) reads each input on its own type and writes its own (after a folded ReLU);
- an op that moves or averages values reads and writes its input's type (a shared spec), only where
  that input is quantized: nothing float is rounded to 8 bits for it;
- a join (cat) puts its inputs and its output on one type (XNNPACK's int8 cat needs one), where every
  input is quantized.

A sum or a join whose inputs' ranges differ so much that one would span fewer than ``MIN_STEPS`` steps
of the output's type stays float (requant's join rule, :mod:`requant.targets.constraints`): BERT's
attention scores (about +-10) plus its additive mask (0 or -10,000) rounded to int8 lose every score
(MiniLM's output at -1 dB from float). The ranges are the float model's on a few samples
(``ranges``: :func:`probe_ranges`), known before anything is annotated.

Each decision is kept in ``records`` (node, op, role, config, or why it stayed float): the report's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.fx import Node
from torchao.quantization.pt2e import PlaceholderObserver
from torchao.quantization.pt2e.quantizer import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer import QuantizationSpec as TorchSpec
from torchao.quantization.pt2e.quantizer import Quantizer as TorchQuantizer

from requant.ir.provenance import MODULE_CLASS_KEY, MODULE_PATH_KEY
from requant.ir.requests import DTYPES, FixedSpec, QuantizationSpec
from requant.pt2e.observer import RequantObserver, RequantPerChannelObserver, torch_dtype
from requant.quantizers import Quantizer
from requant.quantizers.config import QuantizationConfig
from requant.targets.constraints import MIN_STEPS
from requant.targets.xnnpack import XNNPACK_OPS, XnnpackOp
from requant.types import storage_bounds

__all__ = [
    "KEY",
    "RequantQuantizer",
    "annotations_text",
    "aten_name",
    "folded_activation",
    "look_at_outputs",
    "probe_ranges",
    "role",
]

KEY = "quantization_annotation"
AnySpec: TypeAlias = TorchSpec | FixedQParamsQuantizationSpec  # what a requant request becomes
FOLDED = ("activation",)  # what a kernel or a binary op folds after it


def aten_name(node: Node) -> str | None:
    """The op's overload packet name (``conv2d`` for ``aten.conv2d.default``), or None."""
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if node.op == "call_function" else None


def role(node: Node) -> str | None:
    """The node's role in the XNNPACK table (:data:`~requant.targets.xnnpack.ROLES`), or None."""
    row = XNNPACK_OPS.get(aten_name(node) or "")
    return row.role if row is not None else None


def folded_activation(node: Node) -> Node | None:
    """The activation folded into ``node``: its only reader, when that is an activation."""
    users = list(node.users)
    return users[0] if len(users) == 1 and role(users[0]) == "activation" else None


@dataclass
class NodeView:
    """An ATen node as requant's node finders read one: its name, the ONNX op type of its row, and the
    module path and class ``torch.export`` recorded (``nn_module_stack``)."""

    name: str
    op_type: str
    domain: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, node: Node, row: XnnpackOp) -> NodeView:
        stack = list(node.meta.get("nn_module_stack", {}).values())
        props = {MODULE_PATH_KEY: str(stack[-1][0]), MODULE_CLASS_KEY: str(stack[-1][1])} if stack else {}
        return cls(node.name, row.onnx, metadata_props=props)


def _is_float_tensor(arg: Any) -> bool:
    value = arg.meta.get("val") if isinstance(arg, Node) else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


class RequantQuantizer(TorchQuantizer):  # type: ignore[misc]
    """requant's decisions as PT2E annotations (module docstring). ``quantizer``: requant's quantizer (its
    defaults when None); ``preset``: the global config when the quantizer's is chosen by model;
    ``methods``: calibration methods every activation observer keeps statistics for besides its own
    (requant's choice converts with each); ``keep_float``: nodes left float, by name, and why."""

    def __init__(self, quantizer: Quantizer | None = None,
                 presets: tuple[str, str] = ("INT8_FLOAT_BIAS", "INT8_DYNAMIC_LINEAR"), methods: tuple[str, ...] = (),
                 ranges: dict[str, tuple[float, float]] | None = None,
                 keep_float: Mapping[str, str] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.quantizer = quantizer or Quantizer().set_global_by_model()
        self.presets, self.methods, self.ranges = presets, methods, ranges or {}
        self.keep_float = dict(keep_float or {})  # nodes left float whatever a selection says (remedies, budget)
        self.preset, self.preset_why = presets[0], ""
        self.records: list[dict[str, str]] = []
        self._specs: dict[tuple[QuantizationSpec | FixedSpec, int | None], AnySpec] = {}
        self._quantized: set[Node] = set()

    def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """A number an add or a mul takes becomes a constant tensor (quantized like a weight), as
        ExecuTorch's XNNPACKQuantizer does: ``x * 2.0`` can then be an int8 op."""
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import _convert_scalars_to_attrs

        converted: torch.fx.GraphModule = _convert_scalars_to_attrs(model)
        return converted

    def choose_preset(self, model: torch.fx.GraphModule) -> str:
        """The preset when the global config is chosen by model: requant's rule
        (:func:`~requant.quantizers.config.choose_preset`): more linear layers than convolutions, the
        linear models' preset; else the conv nets'."""
        names = [aten_name(n) for n in model.graph.nodes]
        linear = sum(1 for n in names if n == "linear")
        convs = sum(1 for n in names if n in ("conv1d", "conv2d", "conv_transpose2d"))
        self.preset = self.presets[1] if linear > convs else self.presets[0]
        kind = "more linear layers than convolutions" if linear > convs else "a conv net"
        self.preset_why = f"linear layers: {linear}, convolutions: {convs}; {kind}"
        return self.preset

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        selections = self.quantizer.selections(self.choose_preset(model))
        self.records, self._quantized = [], set()
        for node in model.graph.nodes:
            row = XNNPACK_OPS.get(aten_name(node) or "")
            if row is None or KEY in node.meta or row.role in FOLDED:
                continue
            view = NodeView.of(node, row)
            config = next((c for finder, c in selections if finder.matches(view)), None)  # type: ignore[arg-type]
            why: str | None
            if node.name in self.keep_float:
                why = f"float: {self.keep_float[node.name]}"
            else:
                why = _RULES[row.role](self, node, row, config) if config is not None else "no selection finds it"
            self.records.append({"node": node.name, "op": str(node.target), "role": row.role,
                                 "config": str(config), "decision": why or "int8"})  # fmt: skip
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        return None

    # --------------------------------------------------------------------- specs
    def spec(self, request: Any, axis: int | None = None) -> AnySpec | None:
        """The PT2E spec of a requant request (None for none or float); one object per request, so
        that the same request on a value's writer and reader shares one observer."""
        if isinstance(request, QuantizationSpec) and axis is not None and request.granularity == "per_axis":
            request = dataclasses.replace(request, axis=axis)
        elif not isinstance(request, (QuantizationSpec, FixedSpec)):
            return None
        key = (request, axis)
        if key not in self._specs:
            self._specs[key] = self._torch_spec(request)
        return self._specs[key]

    def _torch_spec(self, request: QuantizationSpec | FixedSpec) -> AnySpec:
        if isinstance(request, FixedSpec):  # its parameters given (a sigmoid's output, say): nothing observed
            low, high = storage_bounds(DTYPES[request.dtype])
            return FixedQParamsQuantizationSpec(dtype=torch_dtype(request), scale=request.scale,
                                                zero_point=request.zero_point, quant_min=low, quant_max=high,
                                                qscheme=torch.per_tensor_affine)  # fmt: skip
        if request.dynamic:  # computed at run time from each input: what XNNPACKQuantizer's dynamic config asks
            low, high = storage_bounds(request.storage)
            placeholder = PlaceholderObserver.with_args(eps=2**-12)
            return TorchSpec(dtype=torch_dtype(request), quant_min=low, quant_max=high, qscheme=torch.per_tensor_affine,
                             is_dynamic=True, observer_or_fake_quant_ctr=placeholder)  # fmt: skip
        per_axis = request.granularity == "per_axis"
        low, high = storage_bounds(request.storage, narrow_range=request.narrow_range,
                                   reduce_range=request.reduce_range)  # fmt: skip
        schemes = {(False, False): torch.per_tensor_affine, (False, True): torch.per_tensor_symmetric,
                   (True, False): torch.per_channel_affine, (True, True): torch.per_channel_symmetric}  # fmt: skip
        observer = RequantPerChannelObserver if per_axis else RequantObserver
        methods = () if per_axis else self.methods
        return TorchSpec(dtype=torch_dtype(request), quant_min=low, quant_max=high,
                         qscheme=schemes[per_axis, request.symmetric], ch_axis=request.axis if per_axis else None,
                         observer_or_fake_quant_ctr=observer.with_args(spec=request, methods=methods))  # fmt: skip

    def lost(self, inputs: list[Any], node: Node) -> str | None:
        """The first input whose range spans fewer than ``MIN_STEPS`` int8 steps of ``node``'s output
        range (the float model's, :func:`probe_ranges`), or None."""
        out = self.ranges.get(node.name)
        if out is None or out[1] <= out[0]:
            return None
        step = (out[1] - out[0]) / 255
        for i in inputs:
            span = self.ranges.get(getattr(i, "name", ""))
            if span is not None and span[1] - span[0] < MIN_STEPS * step:
                return (f"float: input {i.name} spans {span[1] - span[0]:.3g}, fewer than {MIN_STEPS} int8 steps "
                        f"of its output's range [{out[0]:.3g}, {out[1]:.3g}]")  # fmt: skip
        return None

    def reading(self, producer: Any, request: Any) -> Any:
        """How a node reads ``producer``: on its type when it is quantized, else its own ``request``."""
        if producer in self._quantized:
            return SharedQuantizationSpec(producer)
        return self.spec(request)

    def folded(self, node: Node) -> Node:
        """The last node of ``node`` and the activation it folds (its only reader), or ``node``."""
        after = folded_activation(node)
        return after if after is not None and KEY not in after.meta else node

    def write(self, first: Node, inputs: dict[Node, Any], output: Any) -> None:
        """Annotate ``first`` with ``inputs`` and the folded node after it with ``output``."""
        last = self.folded(first)
        first.meta[KEY] = QuantizationAnnotation(input_qspec_map=inputs, _annotated=True)
        if last is not first:
            last.meta[KEY] = QuantizationAnnotation(_annotated=True)
        last.meta[KEY].output_qspec = output
        if output is not None:
            self._quantized.add(last)


def _kernel(q: RequantQuantizer, node: Node, row: XnnpackOp, config: QuantizationConfig) -> str | None:
    x, weight = node.args[0], node.args[1]
    if not isinstance(x, Node):
        return "float: its input is not a tensor"
    act, w = q.spec(config.input_activation), q.spec(config.weight, row.weight_axis)
    if act is None or w is None:
        return f"float: {config} quantizes no input or weight"
    if not isinstance(weight, Node) or weight.op != "get_attr":
        return "float: its weight is not a constant (XNNPACK's int8 kernels take constant weights)"
    if isinstance(config.input_activation, QuantizationSpec) and config.input_activation.dynamic:
        q.write(node, {x: act, weight: w}, None)  # quantized per call, read as int8, written float
        return None
    if q.spec(config.output_activation) is None:
        return f"float: {config} writes a float output, which XNNPACK's static int8 kernels do not (dynamic inputs do)"
    q.write(node, {x: q.reading(x, config.input_activation), weight: w}, q.spec(config.output_activation))
    return None


def _binary(q: RequantQuantizer, node: Node, row: XnnpackOp, config: QuantizationConfig) -> str | None:
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, Node) and isinstance(b, Node) and _is_float_tensor(a) and _is_float_tensor(b)):
        return "float: one input is a number, not a tensor"
    out = q.spec(config.output_activation)
    if q.spec(config.input_activation) is None or out is None:
        return f"float: {config} quantizes no activation (or at run time only, which is for kernels)"
    lost = q.lost([a, b], node) if row.onnx in ("Add", "Sub") else None
    if lost:
        return lost
    q.write(node, {a: q.reading(a, config.input_activation), b: q.reading(b, config.input_activation)}, out)
    return None


def _same_scale(q: RequantQuantizer, node: Node, row: XnnpackOp, config: QuantizationConfig) -> str | None:
    x = node.args[0]
    if not isinstance(x, Node) or x not in q._quantized:
        return "float: its input is float (it moves values, so it keeps their type)"
    if q.spec(config.input_activation) is None:
        return f"float: {config} quantizes no activation"
    q.write(node, {x: SharedQuantizationSpec(x)}, SharedQuantizationSpec((x, node)))
    return None


def _join(q: RequantQuantizer, node: Node, row: XnnpackOp, config: QuantizationConfig) -> str | None:
    inputs = [i for i in node.args[0] if isinstance(i, Node)] if isinstance(node.args[0], (list, tuple)) else []
    if not inputs or len(inputs) != len(node.args[0]) or not all(i in q._quantized for i in inputs):  # type: ignore[arg-type]
        return "float: an input is float"
    first = q.spec(config.input_activation)
    if first is None:
        return f"float: {config} quantizes no activation"
    lost = q.lost(inputs, node)
    if lost:
        return lost
    shared = SharedQuantizationSpec((inputs[0], node))
    q.write(node, {i: first if k == 0 else shared for k, i in enumerate(inputs)}, shared)
    return None


_RULES: dict[str, Callable[[RequantQuantizer, Node, XnnpackOp, QuantizationConfig], str | None]] = {
    "kernel": _kernel,
    "binary": _binary,
    "same_scale": _same_scale,
    "join": _join,
}


def _spec_text(spec: Any) -> str:
    if spec is None:
        return "float"
    if isinstance(spec, SharedQuantizationSpec):
        shared = spec.edge_or_node
        return f"shares {shared[0].name}->{shared[1].name}" if isinstance(shared, tuple) else f"shares {shared.name}"
    if getattr(spec, "is_dynamic", False):
        return f"{spec.dtype} computed per call (dynamic)"
    if isinstance(spec, FixedQParamsQuantizationSpec):
        return f"{spec.dtype} fixed: scale {spec.scale!r}, zero point {spec.zero_point}"
    request = spec.observer_or_fake_quant_ctr.p.keywords.get("spec")
    return str(request) if request is not None else str(spec)


def annotations_text(model: torch.fx.GraphModule) -> str:
    """The annotations on ``model``'s graph, a line per annotated node (what the golden tests print):
    ``node (op): input <- request, ...; out -> request``."""
    lines = []
    for node in model.graph.nodes:
        annotation = node.meta.get(KEY)
        if annotation is None:
            continue
        inputs = ", ".join(f"{i.name} <- {_spec_text(s)}" for i, s in annotation.input_qspec_map.items())
        out = _spec_text(annotation.output_qspec)
        lines.append(f"{node.name} ({aten_name(node)}): {inputs or '-'}; out -> {out}")
    return "\n".join(lines)


def look_at_outputs(module: torch.fx.GraphModule, samples: Iterable[tuple[Any, ...]],
                    look: Callable[[Node, torch.Tensor], None]) -> None:  # fmt: skip
    """Run ``module`` on each of ``samples`` (tuples of inputs) with an FX interpreter that hands every
    node's float tensor output to ``look``; a prepared module's observers pass the values through uncounted
    (looking changes no statistics)."""

    class Looking(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.dtype.is_floating_point and out.numel():
                look(n, out)
            return out

    observers = [m for m in module.modules() if isinstance(m, RequantObserver) and not m.paused]
    for observer in observers:
        observer.paused = True
    try:
        with torch.no_grad():
            for args in samples:
                Looking(module).run(*args)
    finally:
        for observer in observers:
            observer.paused = False


Look = Callable[[Node, torch.Tensor], None]


def probe_ranges(
    module: torch.fx.GraphModule, samples: list[tuple[Any, ...]], also: Look | None = None
) -> dict[str, tuple[float, float]]:
    """Every float tensor's [min, max] over ``samples`` (tuples of inputs), by node name; ``also``: another
    look at each output in the same pass."""
    ranges: dict[str, tuple[float, float]] = {}

    def widen(n: Node, out: torch.Tensor) -> None:
        lo, hi = float(out.min()), float(out.max())
        old = ranges.get(n.name, (lo, hi))
        ranges[n.name] = (min(lo, old[0]), max(hi, old[1]))
        if also is not None:
            also(n, out)

    look_at_outputs(module, samples, widen)
    return ranges
