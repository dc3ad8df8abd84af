"""``requant quantize IN -o OUT --calib DATA``: the main job, from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from requant.quantizers import PRESETS, Quantizer

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = commands.add_parser(
        "quantize",
        help="quantize a model for a target, with calibration data, and report what was done",
        description="Quantize IN with the calibration data, write OUT, print a summary.",
    )
    sub.add_argument("input", metavar="IN", help="an ONNX model (.onnx, or ONNX text .onnxtxt)")
    sub.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the quantized model")
    sub.add_argument("--calib", required=True, metavar="DATA", help="calibration data: .npz/.npy file or a folder")
    sub.add_argument("--target", default="onnxruntime-cpu", help="the target (default: onnxruntime-cpu)")
    sub.add_argument("--method", help="calibration method for activations: minmax, percentile, entropy, mse, ...")
    sub.add_argument(
        "--preset", default="INT8_PER_CHANNEL_WEIGHTS", choices=sorted(PRESETS), help="quantization config"
    )
    sub.add_argument("--eval", metavar="DATA", help="evaluation data (.npz; a 'labels' array gives accuracy)")
    sub.add_argument("--report-json", metavar="FILE", help="write the full report as JSON")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from requant.api import quantize

    quantizer = Quantizer().set_global(PRESETS[args.preset])
    result = quantize(
        args.input,
        args.calib,
        target=args.target,
        quantizer=quantizer,
        method=args.method,
        output=args.output,
        eval_data=args.eval,
    )
    sys.stderr.write("\n" if sys.stderr.isatty() else "")
    print(result.report["summary"])
    print(f"wrote {args.output}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(result.report, f, indent=2, sort_keys=True, default=str)
    return 0
