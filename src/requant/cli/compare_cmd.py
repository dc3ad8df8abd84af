"""``requant compare FLOAT QUANT --data DATA``: where a quantized model's error comes from, tensor by tensor.

Runs the float model and the quantized one (a QDQ model from requant or another tool: ONNX
Runtime's quantize_static, NNCF) on the same samples and compares every tensor the quantized
model quantizes (the input of each QuantizeLinear) with the float model's tensor of that name,
the quantized one as ONNX Runtime's int8 kernels compute it. Prints each tensor's SQNR, cosine
and largest error, worst first, and where the error grows the most (a tensor's SQNR against the
worst of the tensors it is computed from).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from requant.cli.parser import documented, write_all

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = documented(
        commands,
        "compare",
        "compare a float model and a quantized one tensor by tensor (SQNR, cosine, worst error)",
        __doc__,
    )
    sub.add_argument("float", metavar="FLOAT", help="the float model (.onnx, or ONNX text)")
    sub.add_argument("quantized", metavar="QUANT", help="the quantized QDQ model")
    sub.add_argument("--data", required=True, metavar="DATA", help="samples, as for --calib (.npz, .npy, a folder)")
    sub.add_argument("--samples", type=int, metavar="N", help="use the first N samples (default: all)")
    sub.add_argument("--top", type=int, default=20, metavar="K", help="print the K worst tensors (default 20)")
    sub.add_argument("--json", action="store_true", help="print every tensor as JSON")
    sub.add_argument("--html", metavar="PAGE", help="also write a page with each tensor's SQNR in graph order")
    sub.set_defaults(run=run)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def run(args: argparse.Namespace) -> int:
    from requant.errors import RequantError
    from requant.report.compare import compare

    if args.samples is not None and args.samples < 1:
        raise RequantError(f"--samples must be at least 1, got {args.samples}")
    if args.html is not None:  # before any work: a refused run writes nothing
        from requant.frontends import check_outputs

        check_outputs({"--html": args.html}, {"the float model": args.float, "the quantized model": args.quantized,
                                              "the data": args.data})  # fmt: skip
    results = compare(args.float, args.quantized, args.data, args.samples)
    if args.html is not None:
        from requant.report.html import compare_to_html

        write_all({args.html: compare_to_html([r.to_json() for r in results], title="requant compare")})
    if args.json:
        sys.stdout.write(json.dumps([r.to_json() for r in results], indent=2) + "\n")
        return 0
    header = f"{'tensor':32s} {'SQNR dB':>8s} {'cosine':>9s} {'max error':>10s} {'own loss dB':>11s}  quantized as"
    lines = [f"{len(results)} tensors compared, worst SQNR first:", "", header]
    for r in results[: args.top]:
        lines.append(f"{r.name[:32]:32s} {_db(r.sqnr_db):>8s} {r.cosine:9.5f} {r.max_error:10.4g} "
                     f"{_db(r.own_loss_db):>11s}  {r.quantized_as}")  # fmt: skip
    grown = max(results, key=lambda r: r.own_loss_db)
    if grown.own_loss_db > 0:
        lines += ["", f"the error grows most at '{grown.name}': {_db(grown.own_loss_db)} dB below "
                      f"{', '.join(repr(s) for s in grown.sources) or 'its inputs'}"]  # fmt: skip
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
