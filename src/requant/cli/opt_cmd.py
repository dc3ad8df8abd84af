"""requant opt IN -p PIPELINE [-o OUT]: run passes on a model, like LLVM's opt.

IN is an ONNX file, a model in ONNX text syntax (.onnxtxt, .txt), or - for text
on standard input. Without -o the resulting IR is printed on standard output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from requant.cli.parser import documented
from requant.frontends import check_outputs, load_onnx, load_onnx_text, save_onnx
from requant.ir import print_model
from requant.passes import PassOptions, parse_pipeline, pass_names, run_passes

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = documented(
        commands,
        "opt",
        "run IR passes on a model and print or save the result",
        __doc__,
        epilog="passes: " + ", ".join(pass_names()),
    )
    sub.add_argument("input", metavar="IN", help="an .onnx file, an ONNX text file (.onnxtxt, .txt), or - for stdin")
    sub.add_argument("-p", "--passes", required=True, metavar="PIPELINE", help="comma-separated pass names")
    sub.add_argument("-o", "--output", metavar="OUT", help="save the resulting model here (.onnx)")
    sub.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (stderr)")
    sub.add_argument(
        "--verify-each",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verify the IR before and after every pass, and run ONNX's checker after each (default: on)",
    )
    sub.add_argument("--time-passes", action="store_true", help="print how long each pass took (stderr)")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    passes = parse_pipeline(args.passes)  # unknown names fail before any work
    if args.output:
        check_outputs({"-o": args.output}, {"the input model": None if args.input == "-" else args.input})
    model = load_onnx_text(sys.stdin.read(), "standard input") if args.input == "-" else load_onnx(args.input)
    options = PassOptions(
        verify_each=args.verify_each,
        check_onnx=args.verify_each,
        time_passes=args.time_passes,
        print_ir_after_all=args.print_ir_after_all,
    )
    model, _ = run_passes(model, passes, options, out=sys.stderr)
    if args.output:
        save_onnx(model, args.output)
    else:
        sys.stdout.write(print_model(model))
    return 0
