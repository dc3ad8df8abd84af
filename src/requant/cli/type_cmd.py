"""``requant type TEXT``: the canonical form of a quantized or tensor type, and its fields."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from requant.types import (
    AnyQuantizedType,
    CalibratedQuantizedType,
    QuantizedType,
    TensorType,
    UniformQuantizedPerAxisType,
    UniformQuantizedSubChannelType,
    UniformQuantizedType,
    normalize,
    parse_tensor_type,
    parse_type,
)

__all__ = ["describe", "register"]


def register(commands: Any) -> None:
    sub = commands.add_parser(
        "type",
        help="parse a !quant type (or a tensor of one) and print its canonical MLIR text and fields",
        description="Parse TEXT as MLIR does; print the canonical text, then one field per line.",
    )
    sub.add_argument("text", metavar="TEXT", help="e.g. '!quant.uniform<i8:f32, 0.5:-3>' or 'tensor<4x!quant...>'")
    sub.set_defaults(run=run)


def _fields(q: QuantizedType) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [("kind", type(q).__name__)]
    if isinstance(q, CalibratedQuantizedType):
        return [*rows, ("expressed", q.expressed), ("min", q.min), ("max", q.max)]
    assert isinstance(
        q, (AnyQuantizedType, UniformQuantizedType, UniformQuantizedPerAxisType, UniformQuantizedSubChannelType)
    )
    rows += [
        ("storage", q.storage),
        ("storage range", f"[{q.storage_min}, {q.storage_max}]"),
        ("expressed", q.expressed),
    ]
    if isinstance(q, UniformQuantizedType):
        rows += [("scale", repr(q.scale)), ("zero point", q.zero_point)]
    elif isinstance(q, UniformQuantizedPerAxisType):
        rows += [("axis", q.axis), ("scales", list(q.scales)), ("zero points", list(q.zero_points))]
    elif isinstance(q, UniformQuantizedSubChannelType):
        rows += [
            ("block sizes", ", ".join(f"axis {a}: {b}" for a, b in q.block_sizes) or "(none: one block)"),
            ("scale grid", "x".join(map(str, q.scales.shape))),
            ("scales", np.array2string(q.scales, separator=", ").replace("\n", "")),
            ("zero points", np.array2string(q.zero_points, separator=", ").replace("\n", "")),
        ]
    return rows


def describe(t: TensorType) -> str:
    """The text ``requant type`` prints for ``t``."""
    lines = [str(t)]
    if t.kind != "scalar":
        shape = "unranked" if t.shape is None else "x".join("?" if d is None else str(d) for d in t.shape) or "rank 0"
        lines.append(f"  {'shape':<14} {shape}")
    if isinstance(t.element, QuantizedType):
        for name, value in _fields(t.element):
            lines.append(f"  {name:<14} {value}")
        simpler = normalize(t.element)
        if simpler is not t.element:
            lines.append(f"  {'normalized':<14} {simpler}")
        for problem in t.element.problems():  # MLIR accepts the type; no target can store it
            lines.append(f"  {'unusable':<14} {problem} (MLIR accepts it; requant's verifier refuses it on a value)")
    else:
        lines.append(f"  {'element':<14} {t.element}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    text: str = args.text
    # A bare !quant type is shown as a type; a container is checked against its shape.
    t = TensorType(parse_type(text)) if text.lstrip().startswith("!") else parse_tensor_type(text)
    print(describe(t))
    return 0
