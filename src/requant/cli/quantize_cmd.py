"""``requant quantize IN -o OUT --calib DATA``: the main job, from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from requant.calibration.images import IMAGE_PRESETS, ImageFolder, image_files
from requant.cli.folder_out import folder_of, recipe, side_files
from requant.cli.parser import write_all
from requant.errors import ArgumentError, RequantError
from requant.frontends import check_outputs
from requant.frontends.hf_parts import parts_of
from requant.options import BLOCKS_PRESET, OPTIONS, Option, Options
from requant.quantizers import DEFAULT_PRESET, LINEAR_DEFAULT_PRESET, PRESETS
from requant.targets.registry import DEFAULT_TARGET

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = commands.add_parser(
        "quantize",
        help="quantize a model for a target, with calibration data, and report what was done",
        description="Quantize IN with the calibration data, write OUT, print a summary. "
        "Flags override what the --config file says.",
    )
    sub.add_argument("input", metavar="IN", help="an ONNX model (.onnx, or ONNX text .onnxtxt), or a Hugging Face "
                     "folder of a model transformers loads (an encoder, an image classifier: exported by torch; "
                     "Whisper and CLIP as two models, written into the -o folder); for --target "
                     "executorch-xnnpack, a PyTorch program saved by torch.export.save (.pt2); with --preset "
                     "INT4_BLOCKWISE_WEIGHTS, a language model: an onnxruntime-genai or Hugging Face folder, a "
                     ".gguf file or a causal LM's .onnx (docs/llm.md)")  # fmt: skip
    sub.add_argument("--calib", metavar="DATA", help="calibration data: .npz/.npy file, a folder of them, or a folder "
                     "of images; for a Hugging Face folder's model or a language model, text: a .txt file or a "
                     "folder of them (a line a sample for an encoder); for an audio model's folder, .wav "
                     "files")  # fmt: skip
    sub.add_argument("--config", metavar="FILE", help="a TOML file: these flags, plus per-node/per-module settings")
    sub.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"the global config (default, on {DEFAULT_TARGET}: {DEFAULT_PRESET} for conv nets, "
        f"{LINEAR_DEFAULT_PRESET} for models with more linear layers than convolutions)",
    )
    sub.add_argument(
        "--images", choices=sorted(IMAGE_PRESETS), help="preprocessing of image folders given as --calib/--eval"
    )
    for option in OPTIONS:
        if option.flag is not None:
            _add_flag(sub, option)
    sub.add_argument("--dry-run", action="store_true", help="print the plan (target, preset, method, the nodes "
                     "that would be quantized and those that would stay float, with why) and write nothing; "
                     "--calib and -o are not needed")  # fmt: skip
    sub.add_argument("--report-json", metavar="FILE", help="write the full report as JSON")
    sub.add_argument("--report-md", metavar="FILE", help="write the report as a Markdown page")
    sub.add_argument(
        "--report-html", metavar="FILE", help="write the report as one self-contained HTML page with plots"
    )
    sub.set_defaults(run=run)


def _add_flag(parser: argparse.ArgumentParser, option: Option) -> None:
    """The flag of ``option`` (requant.options.OPTIONS): a boolean's sets it against its default, a
    repeated one collects its entries, the others take a value; None when not given (the config file's,
    or the default, stands)."""
    assert option.flag is not None
    names = [n for n in (option.short, option.flag) if n]
    given: dict[str, Any] = {"dest": option.name, "help": option.help, "default": None}
    if isinstance(option.default, bool):
        given["action"] = "store_false" if option.default else "store_true"
    elif option.repeat:
        given.update(action="append", metavar=option.metavar)
    else:
        given.update(metavar=option.metavar, type=option.parse)
        if option.choices is not None:
            given.update(choices=list(option.choices()), metavar=None)
    parser.add_argument(*names, **given)


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line gives (requant.options.OPTIONS' flags)."""
    given: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.name, None) if option.flag is not None else None
        if value is not None and option.repeat:
            value = dict(option.parse(text) for text in value)
        if value is not None:
            given[option.name] = value
    return given


def _data(path: str | None, images: Any) -> Any:
    """A data path, or an ImageFolder when it is a folder of images and a preprocessing was stated."""
    if path is None or images is None:
        return path
    folder = Path(path)
    if folder.is_dir() and image_files(folder):
        return ImageFolder(folder, images)
    return path


def _dry_run(source: str, given: dict[str, Any], settings: Any) -> int:
    """``--dry-run``: the plan printed (:mod:`requant.stages.plan`), nothing read but the model, nothing written."""
    from requant.stages.plan import plan, plan_lines

    given = {k: v for k, v in given.items() if k != "output"}
    options = Options.create(**given, quantizer=settings.quantizer(given.get("target", DEFAULT_TARGET)))
    print("\n".join(plan_lines(plan(source, options, settings.preset))))
    return 0


def _settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The run's settings (the config file's, the flags over them) and its options by name."""
    from requant.config_file import RunSettings, read_config

    settings = read_config(args.config) if args.config else RunSettings()
    for flag, key in (("calib", "calib"), ("preset", "preset"), ("report_json", "report_json"),
                      ("report_md", "report_markdown"), ("report_html", "report_html")):  # fmt: skip
        if getattr(args, flag) is not None:
            setattr(settings, key, getattr(args, flag))
    if args.images is not None:
        settings.images = IMAGE_PRESETS[args.images]
    return settings, settings.merged(_flags(args))


def _into_folder(args: argparse.Namespace, given: dict[str, Any], settings: Any) -> Path | None:
    """``-o DIR`` (:mod:`requant.cli.folder_out`): checked (a refused run writes nothing), the model's path in it
    as the output, its reports there unless given elsewhere; None for ``-o FILE`` and a language model's folder."""
    from requant.stages.encoder_blocks import is_decoder

    decoder = settings.preset == BLOCKS_PRESET and is_decoder(args.input)  # its folder: onnxruntime-genai's
    folder = None if decoder else folder_of(str(given["output"]), given.get("target"))
    parts = parts_of(args.input)
    if parts and folder is None:
        raise ArgumentError(f"'{args.input}' holds a model of parts ({', '.join(parts)}), each written as its own "
                            f"file: give -o a folder, not '{given['output']}'")  # fmt: skip
    if folder is None:
        return None
    check_outputs({"-o": folder[0]}, {"the input model": args.input}, folders=("-o",))
    given["output"] = str(folder[0] if parts else folder[1])  # a model of parts: a file each in the folder
    settings.report_json = settings.report_json or str(folder[0] / "report.json")
    settings.report_markdown = settings.report_markdown or str(folder[0] / "report.md")
    return folder[0]


def _texts(result: Any, settings: Any, folder: Path | None, recipe_text: str, source: str) -> dict[str, str | bytes]:
    """What is written beside the model: the reports, and in a folder ``requant.toml`` and the side files."""
    from requant.report.markdown import to_markdown

    texts: dict[str, str | bytes] = {}
    if folder is not None:
        texts[str(folder / "requant.toml")] = recipe_text
        texts.update((str(folder / name), data) for name, data in side_files(source).items())
    if settings.report_json:
        texts[settings.report_json] = json.dumps(result.report, indent=2, sort_keys=True, default=str) + "\n"
    if settings.report_markdown:
        texts[settings.report_markdown] = to_markdown(result.report)
    if settings.report_html:
        from requant.report.html import to_html

        texts[settings.report_html] = to_html(result.report)
    return texts


def _write(result: Any, output: str, texts: dict[str, str | bytes], folder: Path | None) -> None:
    """The model and the texts, whole or not at all; a folder made for them removed again on a failure."""
    made = folder is not None and not folder.is_dir()
    if folder is not None and made:
        folder.mkdir()
    try:
        if output.endswith(".mlir"):  # the TOSA program (tosa-int8), written as a text with the rest
            texts[output] = result.mlir()
            write_all(texts)
        else:
            write_all(texts, lambda: result.save(output))
    except BaseException:
        if folder is not None and made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def run(args: argparse.Namespace) -> int:
    from requant.pipeline import quantize

    settings, given = _settings(args)
    if args.dry_run:
        return _dry_run(args.input, given, settings)
    for key, flag, value in (("output", "-o/--output", given.get("output")), ("calib", "--calib", settings.calib)):
        if value is None:
            raise RequantError(f"no {key}: give {flag} or set '{key}' in the --config file")
    folder = _into_folder(args, given, settings)
    options = Options.create(**given, quantizer=settings.quantizer(given.get("target", DEFAULT_TARGET)))
    there = folder is None or folder.is_dir()  # a folder -o is made when written: what goes in it is checked then
    check_outputs(  # before any work: a refused run writes nothing
        {"-o": given["output"] if there else None, "--report-json": settings.report_json if there else None,
         "--report-md": settings.report_markdown if there else None, "--report-html": settings.report_html},
        {"the input model": args.input, "the calibration data": settings.calib,
         "the evaluation data": given.get("eval_data"), "the config file": args.config},
        folders=("-o",) if options.flow == "blocks" or parts_of(args.input) else (),  # an output folder
    )  # fmt: skip
    recipe_text = recipe(options, given, settings, args.config) if folder is not None else ""
    if options.eval_data is not None:
        options = dataclasses.replace(options, eval_data=_data(options.eval_data, settings.images))
    output = str(options.output)
    # the CLI writes the model with the reports, whole or not at all (write_all): not quantize
    result = quantize(args.input, _data(settings.calib, settings.images), dataclasses.replace(options, output=None))
    texts = _texts(result, settings, folder, recipe_text, args.input)
    _write(result, output, texts, folder)
    sys.stderr.write("\n" if sys.stderr.isatty() else "")
    print(result.report["summary"])
    written = [os.path.join(output, f"{name}.onnx") for name in result.parts] if result.parts else [output]
    for path in dict.fromkeys((*written, *texts)):
        print(f"wrote {path}")
    return 3 if options.strict and _poor(result.report) else 0  # as lint's --strict: written, but no good as it is


def _poor(report: dict[str, Any]) -> bool:
    """Whether the summary says NOT USABLE AS IS: an output far from float, or a model of parts' parts together or
    one of them."""
    parts = report.get("parts", {}).values()
    return bool(report.get("outputs", {}).get("poor") or report.get("together", {}).get("poor")
                or any(_poor(part) for part in parts))  # fmt: skip
