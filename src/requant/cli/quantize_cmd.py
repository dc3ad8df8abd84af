"""``requant quantize IN -o OUT --calib DATA``: the main job, from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from requant.calibration.images import IMAGE_PRESETS, ImageFolder, image_files
from requant.calibration.smoothing import DEFAULT_ALPHA
from requant.cli.parser import write_all
from requant.errors import RequantError
from requant.frontends import check_outputs
from requant.quantizers import DEFAULT_PRESET, LINEAR_DEFAULT_PRESET, PRESETS
from requant.targets.registry import DEFAULT_TARGET, TARGETS, get_target

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = commands.add_parser(
        "quantize",
        help="quantize a model for a target, with calibration data, and report what was done",
        description="Quantize IN with the calibration data, write OUT, print a summary. "
        "Flags override what the --config file says.",
    )
    sub.add_argument("input", metavar="IN", help="an ONNX model (.onnx, or ONNX text .onnxtxt)")
    sub.add_argument("-o", "--output", metavar="OUT", help="where to write the quantized model")
    sub.add_argument(
        "--calib", metavar="DATA", help="calibration data: .npz/.npy file, a folder of them, or a folder of images"
    )
    sub.add_argument("--config", metavar="FILE", help="a TOML file: these flags, plus per-node/per-module settings")
    sub.add_argument(
        "--target",
        choices=sorted(TARGETS),
        help=f"what the model is for (default: {DEFAULT_TARGET}, exact on every x86-64 CPU; onnxruntime-cpu-vnni: "
        "full-range int8 weights for CPUs with VNNI; tosa-int8: integer-only TOSA MLIR, with -o FILE.mlir; "
        "see docs/targets.md)",
    )
    sub.add_argument(
        "--method",
        help="activation calibration method: auto (the default unless a --config names observers: tries minmax "
        "and mean_minmax, keeps the closer to float), minmax, mean_minmax, percentile, entropy, mse",
    )
    sub.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"the global config (default, on {DEFAULT_TARGET}: {DEFAULT_PRESET} for conv nets, "
        f"{LINEAR_DEFAULT_PRESET} for models with more linear layers than convolutions)",
    )
    sub.add_argument(
        "--images", choices=sorted(IMAGE_PRESETS), help="preprocessing of image folders given as --calib/--eval"
    )
    sub.add_argument("--eval", metavar="DATA", help="evaluation data (.npz; a 'labels' array gives accuracy)")
    sub.add_argument(
        "--strict", action="store_true", default=None, help="fail if a node asked to be quantized cannot be"
    )
    sub.add_argument(
        "--no-bias-correction",
        dest="bias_correction",
        action="store_false",
        default=None,
        help="keep the biases as quantized (default: correct the mean shift of int8 convolutions and Gemms)",
    )
    sub.add_argument(
        "--no-equalization",
        dest="equalization",
        action="store_false",
        default=None,
        help="leave depthwise convolutions' inputs as they are (default: scale their small channels up "
        "against the convolution before them, in convolutional models)",
    )
    sub.add_argument(
        "--rounding",
        choices=["single_round", "double_round"],
        help="tosa-int8: how the rescales round (default single_round, TOSA's; double_round: TFLite's)",
    )
    sub.add_argument(
        "--accumulator-bits",
        metavar="BITS",
        type=int,
        help="tosa-int8: simulate accumulators this wide (e.g. 16) in requant's interpreter; the report says how "
        "often each kernel's would overflow",
    )
    sub.add_argument(
        "--smoothing",
        metavar="ALPHA",
        type=float,
        help=f"SmoothQuant's alpha for the inputs of linear layers, in models with more linear layers than "
        f"convolutions (default {DEFAULT_ALPHA}; 0: off): outlier channels move into the weights",
    )
    sub.add_argument(
        "--keep-float-below",
        metavar="DB",
        type=float,
        help="keep float the int8 convolutions and Gemms whose output SQNR against float is below DB "
        "(measured on the first 64 calibration samples, pointwise convolutions on the first 16; the model "
        "is quantized a second time)",
    )
    sub.add_argument(
        "--max-drop",
        metavar="X",
        type=float,
        help="an accuracy budget on --eval: if the int8 model loses more than X (0.01: one point), keep float "
        "the kernels that bring it within X at the least modelled latency: the most effective (measured) or "
        "the first ones in graph order (one float region from the inputs); each try re-quantizes",
    )
    sub.add_argument(
        "--metric",
        choices=("accuracy", "top1", "cosine"),
        help="what --max-drop measures (default: accuracy when the --eval data has labels, else top-1 agreement)",
    )
    sub.add_argument(
        "--no-measure",
        dest="measure",
        action="store_false",
        help="skip the latency measurement (float and int8 runs interleaved, at most 2 s)",
    )
    sub.add_argument(
        "--fix-input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="make input NAME a constant of VALUE (a number, or numbers separated by commas), as a setting "
        "the model branches on: its If folds and the branch taken is quantized (repeatable)",
    )
    sub.add_argument("--report-json", metavar="FILE", help="write the full report as JSON")
    sub.add_argument("--report-md", metavar="FILE", help="write the report as a Markdown page")
    sub.add_argument(
        "--report-html", metavar="FILE", help="write the report as one self-contained HTML page with plots"
    )
    sub.set_defaults(run=run)


def _data(path: str | None, images: Any) -> Any:
    """A data path, or an ImageFolder when it is a folder of images and a preprocessing was stated."""
    if path is None or images is None:
        return path
    folder = Path(path)
    if folder.is_dir() and image_files(folder):
        return ImageFolder(folder, images)
    return path


def _fixed(given: list[str]) -> dict[str, list[float] | float]:
    """``--fix-input NAME=VALUE`` flags as input name -> value (a number, or a list of them)."""
    fixed: dict[str, list[float] | float] = {}
    for text in given:
        name, sep, value = text.partition("=")
        try:
            numbers = [float(v) for v in value.split(",")] if sep and name and value else None
        except ValueError:
            numbers = None
        if numbers is None:
            raise RequantError(f"--fix-input {text!r}: expected NAME=VALUE, a number or numbers separated by commas")
        fixed[name.strip()] = numbers if len(numbers) > 1 else numbers[0]
    return fixed


def _load_options(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """The config file's fixed inputs, then the command line's (which win)."""
    fixed = {**settings.fixed_inputs, **_fixed(args.fix_input)}
    return {"fixed_inputs": fixed} if fixed else {}


def run(args: argparse.Namespace) -> int:
    from requant.api import quantize
    from requant.config_file import RunSettings, read_config
    from requant.report.markdown import to_markdown

    settings = read_config(args.config) if args.config else RunSettings()
    for flag, key in (
        ("output", "output"), ("calib", "calib"), ("eval", "eval"), ("target", "target"), ("method", "method"),
        ("preset", "preset"), ("strict", "strict"), ("report_json", "report_json"), ("report_md", "report_markdown"),
        ("report_html", "report_html"),
        ("bias_correction", "bias_correction"), ("keep_float_below", "keep_float_below"), ("max_drop", "max_drop"),
        ("metric", "metric"), ("smoothing", "smoothing"), ("equalization", "equalization"),
    ):  # fmt: skip
        if getattr(args, flag) is not None:
            setattr(settings, key, getattr(args, flag))
    if args.images is not None:
        settings.images = IMAGE_PRESETS[args.images]
    for key, flag in (("output", "-o/--output"), ("calib", "--calib")):
        if getattr(settings, key) is None:
            raise RequantError(f"no {key}: give {flag} or set '{key}' in the --config file")
    check_outputs(  # before any work: a refused run writes nothing
        {"-o": settings.output, "--report-json": settings.report_json, "--report-md": settings.report_markdown,
         "--report-html": settings.report_html},
        {"the input model": args.input, "the calibration data": settings.calib, "the evaluation data": settings.eval,
         "the config file": args.config},
    )  # fmt: skip
    target = get_target(settings.target or DEFAULT_TARGET)
    if str(settings.output).endswith(".mlir") and target.backend != "tosa":  # before any work
        raise RequantError(f"-o {settings.output}: only --target tosa-int8 writes MLIR; {target} writes ONNX (.onnx)")
    result = quantize(
        args.input,
        _data(settings.calib, settings.images),
        target=settings.target,
        quantizer=settings.quantizer(),
        method=settings.method,
        eval_data=_data(settings.eval, settings.images),
        strict=settings.strict,
        bias_correction=settings.bias_correction,
        keep_float_below=settings.keep_float_below,
        max_drop=settings.max_drop,
        metric=settings.metric,
        smoothing=settings.smoothing,
        equalization=settings.equalization,
        measure=args.measure,
        rounding=args.rounding,
        accumulator_bits=args.accumulator_bits,
        **_load_options(args, settings),
    )
    texts = {}
    if settings.report_json:
        texts[settings.report_json] = json.dumps(result.report, indent=2, sort_keys=True, default=str) + "\n"
    if settings.report_markdown:
        texts[settings.report_markdown] = to_markdown(result.report)
    if settings.report_html:
        from requant.report.html import to_html

        texts[settings.report_html] = to_html(result.report)
    assert settings.output is not None
    if settings.output.endswith(".mlir"):  # the TOSA program (tosa-int8), written as a text with the rest
        texts[settings.output] = result.mlir()
        write_all(texts)
    else:
        write_all(texts, result.model, settings.output)
    sys.stderr.write("\n" if sys.stderr.isatty() else "")
    print(result.report["summary"])
    for path in dict.fromkeys((settings.output, *texts)):
        print(f"wrote {path}")
    return 0
