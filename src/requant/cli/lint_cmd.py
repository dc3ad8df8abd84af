"""``requant lint MODEL``: what ONNX Runtime makes of a QDQ model, from any quantizer.

Loads the model in ONNX Runtime's CPU provider and reads its optimized graph: which int8
kernels it fused, which nodes stayed float between a DequantizeLinear and a QuantizeLinear,
which QuantizeLinear -> DequantizeLinear pairs were left with nothing fused, and which
constants are dequantized at run time; which uint8 x int8 kernels can saturate on CPUs without
VNNI, and which QLinearSoftmax returns 0 for a row's largest values. Exit status: 0, or 3 with
--strict when any of these is found (1 is an error: the model could not be read or loaded; 2 a
usage error).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from requant.cli.parser import documented
from requant.frontends import load_onnx

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = documented(
        commands, "lint", "show which int8 kernels ONNX Runtime fused in a QDQ model and what stayed float", __doc__
    )
    sub.add_argument("input", metavar="MODEL", help="a quantized ONNX model (.onnx, or ONNX text .onnxtxt)")
    sub.add_argument("--json", action="store_true", help="print the findings as JSON")
    sub.add_argument(
        "--strict",
        action="store_true",
        help="exit 3 when a node stayed float (or was asked to be quantized and runs in float), a pair was left, "
        "a kernel can saturate without VNNI, or a QLinearSoftmax overflows",
    )
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from requant.report.lint import lint

    result = lint(load_onnx(args.input))
    if args.json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(result.text() + "\n")
    return 3 if args.strict and not result.clean else 0
