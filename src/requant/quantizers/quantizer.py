"""The composite quantizer: the user's selections, in a fixed precedence, and one report.

Precedence (ExecuTorch's): the quantizer added last is applied first, and earlier annotations are
never overwritten; the global one (``set_global``) applies second to last; the shared-spec
quantizer last. ``config=None`` keeps the selected nodes in float.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from requant.errors import RequantError
from requant.ir.queries import DEFAULT_DOMAINS, computes_floats
from requant.ir.requests import NoQuant, QuantizationSpec
from requant.ir.traits import WEIGHTED
from requant.quantizers.config import PRESETS, DerivedBias, QuantizationConfig, choose_preset
from requant.quantizers.finders import (
    Global,
    ModulePath,
    ModuleType,
    NodeFinder,
    NodeName,
    OpType,
    module_path_of,
    within,
)
from requant.quantizers.matcher import PatternMatcher
from requant.quantizers.pattern_quantizer import PatternQuantizer, QuantizeState
from requant.quantizers.records import QuantizerRecord, QuantizerReport
from requant.quantizers.shared import SharedSpecQuantizer
from requant.targets.onnxruntime_cpu import ONNXRUNTIME_CPU
from requant.targets.table import SupportTable

__all__ = ["FLOAT", "QuantParams", "Quantizer", "StrictQuantizationError", "module_params"]

log = logging.getLogger("requant.quantizers")

FLOAT = QuantizationConfig("FLOAT", NoQuant(), NoQuant(), NoQuant(), NoQuant())


def _given(presets: tuple[str, str] | None) -> tuple[tuple[str, str], ...]:
    """``choose_preset``'s optional argument: the presets when given, none (its defaults) otherwise."""
    return () if presets is None else (presets,)


def _kernels_in_bodies(model: ir.Model) -> dict[str, int]:
    """How many weighted ops (``WEIGHTED``: convolutions, linear layers, LSTMs) each control-flow node of
    the main graph holds in its bodies (subgraphs, recursively), by node name; none: empty."""
    found = {}
    for node in model.graph:
        bodies = [a.value for a in node.attributes.values() if isinstance(a.value, ir.Graph)]
        count = sum(
            1 for body in bodies for inner in ir.traversal.RecursiveGraphIterator(body) if inner.op_type in WEIGHTED
        )
        if count:
            found[node.name or node.op_type] = count
    return found


class StrictQuantizationError(RequantError):
    """Strict mode: a node asked to be quantized could not be; names the node and the reason."""


class AnnotatingQuantizer(Protocol):
    def describe(self) -> str: ...

    def annotate(self, model: ir.Model, state: QuantizeState) -> QuantizerRecord: ...


@dataclass(frozen=True)
class QuantParams:
    """Per-module parameters: ``__quant_params__ = QuantParams(weights=..., activations=...)`` on a module."""

    weights: QuantizationSpec | NoQuant | None = None
    activations: QuantizationSpec | NoQuant | None = None

    def config(self, path: str) -> QuantizationConfig:
        bias = DerivedBias() if isinstance(self.weights, QuantizationSpec) else NoQuant()
        return QuantizationConfig(
            f"QuantParams({path or '<root>'})", self.activations, self.activations, self.weights, bias
        )


def module_params(module: Any) -> dict[str, QuantParams]:
    """Collect ``__quant_params__`` from a PyTorch module and its submodules, by module path."""
    found = {}
    for path, sub in module.named_modules():
        params = getattr(sub, "__quant_params__", None)
        if params is not None:
            if not isinstance(params, QuantParams):
                raise RequantError(f"module '{path}': __quant_params__ must be a QuantParams, got {params!r}")
            found[path] = params
    return found


@dataclass(frozen=True)
class _ModuleParamsFinder(NodeFinder):
    """Nodes whose innermost module with parameters is exactly ``path`` (children inherit unless they set theirs)."""

    path: str
    all_paths: tuple[str, ...]

    def matches(self, node: ir.Node) -> bool:
        node_path = module_path_of(node)
        if node_path is None:
            return False
        owners = [p for p in self.all_paths if within(node_path, p)]
        return bool(owners) and max(owners, key=len) == self.path

    def __repr__(self) -> str:
        return f"ModuleParams({self.path!r})"


# computes in float, reading float inputs; leaves its output to its consumers
FLOAT_KERNEL = QuantizationConfig("FLOAT_KERNEL", input_activation=NoQuant(), weight=NoQuant(), bias=NoQuant())
# An op placement keeps float (requant.quantizers.placement): computes in float and asks nothing of
# its ports, so the int8 kernels around it keep theirs (a conv before it still writes int8, which it
# reads through a DequantizeLinear; a conv after it still quantizes what it reads).
FLOAT_PLACED = QuantizationConfig("FLOAT_PLACED")


class Quantizer:
    """Compose quantizers; ``quantize(model)`` annotates the model and returns the report."""

    def __init__(self, table: SupportTable | None = None) -> None:
        """``table``: the support table to match against; None, the target's it quantizes for
        (:meth:`for_table`; ONNX Runtime's until then)."""
        self._explicit = table is not None
        self.table = table or ONNXRUNTIME_CPU
        self._matcher = PatternMatcher(self.table)
        self._added: list[AnnotatingQuantizer] = []
        self._global: PatternQuantizer | None = None
        self._global_by_model = False
        self._shared: AnnotatingQuantizer = SharedSpecQuantizer()

    def _pattern(self, finder: NodeFinder, config: QuantizationConfig | None) -> PatternQuantizer:
        return PatternQuantizer(config if config is not None else FLOAT, finder, self._matcher)

    def set_global(self, config: QuantizationConfig | None) -> Quantizer:
        self._global = self._pattern(Global(), config)
        self._global_by_model = False
        return self

    def set_global_by_model(self) -> Quantizer:
        """The global config is the preset ``choose_preset`` picks for each model quantized (the default)."""
        self._global, self._global_by_model = None, True
        return self

    def set_node_finder(self, finder: NodeFinder, config: QuantizationConfig | None) -> Quantizer:
        return self.add_quantizer(self._pattern(finder, config))

    def set_op_type(self, op_types: str | tuple[str, ...], config: QuantizationConfig | None) -> Quantizer:
        names = (op_types,) if isinstance(op_types, str) else tuple(op_types)
        return self.set_node_finder(OpType(*names), config)

    def set_node_name(self, name: str, config: QuantizationConfig | None, regex: bool = False) -> Quantizer:
        return self.set_node_finder(NodeName(name, regex), config)

    def set_module_name(self, path: str, config: QuantizationConfig | None) -> Quantizer:
        return self.set_node_finder(ModulePath(path), config)

    def set_module_type(self, module_class: str, config: QuantizationConfig | None) -> Quantizer:
        return self.set_node_finder(ModuleType(module_class), config)

    def set_module_params(self, params: Mapping[str, QuantParams]) -> Quantizer:
        """Per-module parameters (``{"features.1": QuantParams(...)}``, or ``module_params(module)``).

        A submodule inherits its parent's parameters unless it sets its own; functional calls
        inside a module get that module's.
        """
        paths = tuple(params)
        for path in sorted(paths, key=len):  # parents first: children, added later, apply first
            self.set_node_finder(_ModuleParamsFinder(path, paths), params[path].config(path))
        return self

    def for_table(self, table: SupportTable) -> Quantizer:
        """This quantizer for a target's ``table``: itself when it was made for a table of its own,
        otherwise a copy whose pattern quantizers match against ``table``."""
        if self._explicit or table is self.table:
            return self
        other = copy.copy(self)
        other.table, other._matcher = table, PatternMatcher(table)

        def moved(q: AnnotatingQuantizer) -> AnnotatingQuantizer:
            if isinstance(q, PatternQuantizer) and q.pattern_matcher is self._matcher:
                return PatternQuantizer(q.config, q.node_finder, other._matcher)
            return q

        other._added = [moved(q) for q in self._added]
        other._global = moved(self._global) if self._global is not None else None  # type: ignore[assignment]
        return other

    def with_float_nodes(self, names: Iterable[str], config: QuantizationConfig = FLOAT_KERNEL) -> Quantizer:
        """A copy of this quantizer that also computes the nodes named (exactly) in float, before all else.

        With ``FLOAT_KERNEL``, their weights and inputs stay float (so does what feeds them, when
        nothing else reads it); their outputs get no request: a next int8 kernel still quantizes what
        it reads. With ``FLOAT_PLACED``, they ask nothing of their ports at all.
        """
        other = copy.copy(self)
        other._added = list(self._added)
        for name in names:
            other.set_node_name(name, config)
        return other

    def names_observers(self) -> bool:
        """Whether this quantizer's configs ask for an activation observer other than the presets'
        plain ``minmax`` (or it has quantizers of the user's own, whose requests are not known before
        they run): ``quantize``'s default method then keeps them instead of choosing one itself."""
        for q in (*self._added, self._global):
            if q is None:
                continue
            if not isinstance(q, PatternQuantizer):
                return True
            for spec in (q.config.input_activation, q.config.output_activation):
                if isinstance(spec, QuantizationSpec) and (spec.observer != "minmax" or spec.observer_options):
                    return True
        return False

    def selections(self, preset: str) -> list[tuple[NodeFinder, QuantizationConfig]]:
        """The selections in precedence order (the first whose finder finds a node gives its config), the
        global one last (``preset``'s config when it is chosen by model): what requant's PT2E quantizer
        reads (:mod:`requant.pt2e`). A quantizer of the user's own is not a selection: an error there."""
        found = []
        for q in [*reversed(self._added), self._global]:
            if q is None:
                continue
            if not isinstance(q, PatternQuantizer):
                raise RequantError(f"{q.describe()} annotates ONNX graphs; the PT2E path takes selections (set_global, "
                                   "set_op_type, set_node_name, set_module_name, set_module_type)")  # fmt: skip
            found.append((q.node_finder, q.config))
        if self._global is None:
            found.append((Global(), PRESETS[preset]))
        return found

    def block_weights(self) -> QuantizationSpec | None:
        """The global config's weight request when it asks for weight-only blocks (no activation quantized:
        ``INT4_BLOCKWISE_WEIGHTS``), the language models' flow (:mod:`requant.stages.blocks`); else None."""
        config = self._global.config if isinstance(self._global, PatternQuantizer) else None
        if config is None or not isinstance(config.weight, QuantizationSpec):
            return None
        activations = (config.input_activation, config.output_activation)
        float_activations = all(a is None or isinstance(a, NoQuant) for a in activations)
        if config.weight.granularity != "blockwise" or not float_activations:
            return None
        return config.weight

    @property
    def chooses_by_model(self) -> bool:
        """Whether its global config is the preset chosen for each model (no ``set_global``)."""
        return self._global is None

    def configs(self) -> list[QuantizationConfig]:
        """The configs its selections give (not the one chosen by model, nor a custom quantizer's)."""
        return [q.config for q in [*self._added, self._global] if isinstance(q, PatternQuantizer)]

    def add_quantizer(self, quantizer: AnnotatingQuantizer) -> Quantizer:
        self._added.append(quantizer)
        return self

    def order(self, model: ir.Model | None = None, presets: tuple[str, str] | None = None) -> list[AnnotatingQuantizer]:
        """The quantizers in the order they apply (to ``model``, when the global preset depends on it;
        ``presets``: a target's, for conv nets and linear models, see ``choose_preset``)."""
        ordered: list[AnnotatingQuantizer] = list(reversed(self._added))
        if self._global is not None:
            ordered.append(self._global)
        elif self._global_by_model and model is not None:
            ordered.append(self._pattern(Global(), PRESETS[choose_preset(model, *_given(presets))[0]]))
        ordered.append(self._shared)
        return ordered

    def decompose(
        self, model: ir.Model, presets: tuple[str, str] | None = None
    ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """The first run: rewrite the nodes a non-float config selects that the target must decompose.

        Each node's config is the one the first quantizer (in application order) that selects it
        would give. Returns what was decomposed and what could not be, each with its reason.
        """
        rules = {d.op_type: d for d in self.table.decompositions}
        if not rules:
            return [], []
        # only ops on floats: an integer op is quantized by nothing, and a float rewrite of it would not hold
        candidates = [n for n in model.graph if n.op_type in rules and n.domain in DEFAULT_DOMAINS]
        candidates = [n for n in candidates if computes_floats(n)]
        if not candidates:
            return [], []
        selections = [
            (set(q.node_finder.find(model)), q.config)
            for q in self.order(model, presets)
            if isinstance(q, PatternQuantizer)
        ]
        done, kept = [], []
        for node in candidates:
            config = next((c for selected, c in selections if node in selected), None)
            if config is None or config.name in (FLOAT.name, FLOAT_PLACED.name):  # kept float as it stands
                continue
            rule = rules[node.op_type]
            if not rule.applies(node, config):
                continue
            label = f"{node.op_type} '{node.name or node.op_type}'"
            reason = rule.check(node)
            if reason is not None:
                kept.append({"node": label, "reason": f"not decomposed into {rule.into}: {reason}"})
                continue
            new = rule.rewrite(node)
            names = ", ".join(f"{n.op_type} '{n.name}'" for n in new)
            done.append({"node": label, "into": names, "why": f"{self.table}: {rule.why}"})
        if done:  # the replaced constants (a divisor, batch norm statistics), unless something else reads them
            RemoveUnusedNodesPass()(model)
        for entry in done:
            log.info("decomposed %s into %s (%s)", entry["node"], entry["into"], entry["why"])
        return done, kept

    def quantize(
        self, model: ir.Model, strict: bool = False, presets: tuple[str, str] | None = None
    ) -> QuantizerReport:
        """Annotate ``model`` with requests; returns the report (also logged: INFO summary, DEBUG details).

        Ops the target must decompose first (its ``decompositions``) are rewritten by a first run
        (:meth:`decompose`); the quantizers then annotate the result. ``presets``: the target's
        defaults when the global config is chosen by model (``set_global_by_model``).
        """
        decomposed, not_decomposed = self.decompose(model, presets)
        state = QuantizeState()
        report = QuantizerReport(decomposed=decomposed, not_decomposed=not_decomposed)
        if self._global_by_model:
            name, why = choose_preset(model, *_given(presets))
            report.preset_choice = f"{name} ({why})"
            log.info("preset %s: %s", name, why)
        ordered = self.order(model, presets)
        for quantizer in ordered:
            if isinstance(quantizer, PatternQuantizer) and not isinstance(quantizer.node_finder, Global):
                for node in quantizer.node_finder.find(model):
                    state.claims.setdefault(node, set()).add(quantizer.describe())
        for quantizer in ordered:
            record = quantizer.annotate(model, state)
            report.records.append(record)
            if record.selected == 0 and not isinstance(quantizer, SharedSpecQuantizer):
                warning = f"{record.finder} selected no node: check the name, path or type"
                report.warnings.append(warning)
                log.warning(warning)
        hidden = _kernels_in_bodies(model)
        if hidden:
            count = sum(hidden.values())
            where = ", ".join(f"'{name}'" for name in list(hidden)[:3]) + (", ..." if len(hidden) > 3 else "")
            plural = count != 1
            warning = (
                f"{count} convolution{'s' if plural else ''} or linear layer{'s' if plural else ''} inside the "
                f"bodies of {where} (If, Loop, Scan) {'stay' if plural else 'stays'} float: requant quantizes "
                "the main graph. "
                "An If whose condition depends only on inputs that are constants folds away (its branch joins "
                "the main graph): give the model those inputs as initializers"
            )
            report.warnings.append(warning)
            log.warning(warning)
        report.unannotated = [n.name or n.op_type for n in model.graph if n not in state.annotated]
        log.info("%s", report.summary())
        log.debug("%s", report.details())
        if strict:
            self._raise_for_rejections(report)
        return report

    @staticmethod
    def _raise_for_rejections(report: QuantizerReport) -> None:
        for record in report.records:
            if record.config in ("FLOAT", "SHARED"):
                continue
            for decision in record.decisions:
                if decision.status == "rejected":
                    raise StrictQuantizationError(
                        f"{', '.join(decision.nodes)} was asked to be quantized ({record.config}, by {record.finder}) "
                        f"but cannot be: {decision.reason}"
                    )
