"""The PyTorch front door: ``torch.onnx.export(dynamo=True)``, keeping each node's module path and class.

torch is an optional dependency (``pip install 'requant[torch]'``), imported here
only. The module is exported in eval mode (its training flag is restored
afterwards) and without the exporter's own graph optimizer, so that requant's
passes (``canonicalize``) do the folding and each node keeps the module it
came from: the exporter's optimizer folds a BatchNorm into its Conv and then
labels the Conv with the BatchNorm's module.

Every node gets, in its ``metadata_props``:

``requant.module_path``
    the dotted path of the innermost module that ran it (``features.0.conv``;
    ``""`` for the root module), functional calls included (an ``F.relu``
    inside ``features.0`` belongs to ``features.0``);
``requant.module_class``
    that module's class, fully qualified (``torch.nn.modules.conv.Conv2d``).
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import onnx_ir as ir

from requant.frontends.onnx_loader import LoadError
from requant.ir.annotations import load_annotations
from requant.ir.provenance import MODULE_CLASS_KEY, MODULE_PATH_KEY, module_class, module_path

__all__ = [
    "MODULE_CLASS_KEY",
    "MODULE_PATH_KEY",
    "Examples",
    "examples_from",
    "export_cause",
    "export_error",
    "forward_inputs",
    "load_torch",
    "module_class",
    "module_path",
    "quiet_torch",
    "shapes_text",
]

log = logging.getLogger(__name__)

# loggers that print stack traces on failures, and one that says on every export that torchvision's ops are skipped
_NOISY = ("torch._subclasses.fake_tensor", "torch.export._trace", "torch.onnx._internal.exporter._registration")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY = re.compile(r"## Exception summary\s*\n\s*<class '([\w.]+)'>: (.+)")


class quiet_torch:  # noqa: N801 - used as a function
    """torch's loggers that print every failed fake-tensor op's stack trace before it raises (screens of them for
    one wrong shape) silenced until :meth:`close`: requant's error says what failed."""

    def __init__(self, names: tuple[str, ...] = _NOISY) -> None:
        self.levels = {logging.getLogger(n): logging.getLogger(n).level for n in names}
        for logger in self.levels:
            logger.setLevel(logging.CRITICAL)

    def close(self) -> None:
        for logger, level in self.levels.items():
            logger.setLevel(level)


def export_error(what: str, exc: BaseException, args: tuple[Any, ...]) -> LoadError:
    """``what`` failed: a :class:`LoadError` of one line (torch's exception, the example's shapes), with torch's
    whole text, its colour codes removed, as its ``detail`` (``requant --verbose`` prints it)."""
    error = LoadError(f"{what}: {export_cause(exc)} (example inputs: {shapes_text(args)})")
    error.detail = _ANSI.sub("", str(exc)).strip()
    return error


def export_cause(exc: BaseException) -> str:
    """The exporter's error in a few lines: the exception its summary names (torch's advice on filing issues
    and its colour codes left out), else its first lines."""
    text = _ANSI.sub("", str(exc)).strip()
    summary = _SUMMARY.search(text)
    if summary:
        return f"{summary.group(1).rsplit('.', 1)[-1]}: {summary.group(2).strip()}"
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: " + "\n  ".join(lines[:8]) + ("\n  ..." if len(lines) > 8 else "")


def _arguments(example_inputs: Any) -> tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def shapes_text(args: tuple[Any, ...]) -> str:
    def one(a: Any) -> str:
        return f"{list(a.shape)} {str(a.dtype).removeprefix('torch.')}" if hasattr(a, "shape") else type(a).__name__

    return ", ".join(one(a) for a in args)


def forward_inputs(module: Any) -> tuple[list[str], list[str]]:
    """The names of ``module.forward``'s positional parameters, and of those without a default."""
    parameters = inspect.signature(module.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    return [p.name for p in positional], [p.name for p in positional if p.default is inspect.Parameter.empty]


class Examples(dict[str, Any]):
    """Example inputs by ``forward``'s parameter names (exported as keyword arguments), taken from a sample;
    ``said``: where they came from and their shapes, as the report says it."""

    said = ""


def examples_from(module: Any, sample: Mapping[str, Any], where: str) -> tuple[Examples, dict[str, Any]]:
    """Example inputs for exporting ``module`` from one sample (``{name: array}``: by ``forward``'s parameter
    names, or by position where none of its names is one), and their dynamic shapes: the first axis of each
    tensor with one (the batch) as ``torch.export.Dim.AUTO``, static where the module fixes it."""
    import numpy as np
    import torch

    positional, required = forward_inputs(module)
    name = type(module).__name__
    if all(key in positional for key in sample):
        given = sample
    elif len(sample) == len(required):
        given = dict(zip(required, sample.values(), strict=True))
    else:
        raise LoadError(
            f"{where} ({', '.join(sample)}) does not fit {name}.forward's inputs ({', '.join(positional)}): give "
            "the module's example_inputs="
        )
    missing = [p for p in required if p not in given]
    if missing:
        raise LoadError(f"{where} gives no {', '.join(missing)} for {name}.forward: give the module's example_inputs=")
    examples = Examples({p: torch.from_numpy(np.ascontiguousarray(given[p])) for p in positional if p in given})
    examples.said = f"{where}: " + ", ".join(f"{p} {shapes_text((t,))}" for p, t in examples.items())
    dynamic = {p: ({0: torch.export.Dim.AUTO} if t.ndim else None) for p, t in examples.items()}
    return examples, dynamic


_SCOPES = "pkg.torch.onnx.name_scopes"
_CLASSES = "pkg.torch.onnx.class_hierarchy"


def _record_modules(model: ir.Model) -> int:
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        scopes_text, classes_text = node.metadata_props.get(_SCOPES), node.metadata_props.get(_CLASSES)
        if scopes_text is None or classes_text is None:
            continue
        scopes, classes = ast.literal_eval(scopes_text), ast.literal_eval(classes_text)
        # the last entry is the aten op itself; the one before it is the innermost module
        if len(scopes) >= 2 and len(classes) >= 2:
            node.metadata_props[MODULE_PATH_KEY] = scopes[-2]
            node.metadata_props[MODULE_CLASS_KEY] = classes[-2]
            count += 1
    return count


def load_torch(
    module: Any,
    example_inputs: Sequence[Any] | Any,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
) -> ir.Model:
    """Export a ``torch.nn.Module`` with ``torch.onnx.export(dynamo=True)`` and return it as requant's IR.

    ``example_inputs`` is a tensor, a tuple of tensors, or a dict of them by ``forward``'s parameter names
    (keyword arguments: :func:`examples_from`); ``dynamic_shapes`` follows ``torch.export`` (e.g.
    ``({0: torch.export.Dim("batch")},)``, or by parameter name for a dict).
    """
    try:
        import torch
    except ImportError:
        raise LoadError(
            "loading a PyTorch module needs PyTorch: pip install 'requant[torch]' (torch==2.13.0)"
        ) from None
    if not isinstance(module, torch.nn.Module):
        raise LoadError(f"expected a torch.nn.Module, got {type(module).__name__}")
    name = type(module).__name__
    kwargs = dict(example_inputs) if isinstance(example_inputs, Mapping) else None  # by forward's parameter names
    args = () if kwargs is not None else _arguments(example_inputs)
    was_training = module.training
    module.eval()
    quiet = quiet_torch()
    try:
        with warnings.catch_warnings():  # torch's own deprecation inside its exporter, said on every export
            warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
            # one Dim given to several inputs (a batch axis they share) is said to be "not used" for each
            warnings.filterwarnings("ignore", r".*The axis name: .* will not be used", UserWarning)
            program = torch.onnx.export(
                module,
                args,
                kwargs=kwargs,
                dynamo=True,
                dynamic_shapes=dynamic_shapes,  # type: ignore[arg-type]
                optimize=False,
                verbose=False,
                report=False,
            )
    except Exception as exc:  # the exporter raises many kinds; the user needs its message, not its advice
        raise export_error(
            f"torch.onnx.export (dynamo) failed for module {name}", exc, args or tuple((kwargs or {}).values())
        ) from None
    finally:
        module.train(was_training)
        quiet.close()
    if program is None:  # pragma: no cover - dynamo=True always returns a program
        raise LoadError(f"torch.onnx.export returned nothing for module {name}")
    model: ir.Model = program.model
    recorded = _record_modules(model)
    load_annotations(model)
    log.info("exported %s: %d nodes, %d with module paths", name, sum(1 for _ in model.graph), recorded)
    return model
