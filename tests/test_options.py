"""One table of options (``requant.options.OPTIONS``): the API's keywords, the CLI's flags and the config
file's keys come from its rows, and every check runs once, before any work, with one wording."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from requant.cli.main import build_parser
from requant.config_file import read_config
from requant.errors import ArgumentError
from requant.options import OPTIONS, Options
from tests.test_config_file import run_cli

ROOT = Path(__file__).parent.parent
DIGITS = ROOT / "examples" / "digits"


def _quantize_help() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices["quantize"].format_help()  # type: ignore[union-attr]


def test_every_option_with_a_flag_is_on_the_command_line_and_in_the_quickstart() -> None:
    shown, documented = _quantize_help(), (ROOT / "docs" / "quickstart.md").read_text()
    for option in OPTIONS:
        if option.flag is not None:
            assert option.flag in shown, option.name
            assert f"`{option.flag}" in documented or f"{option.flag} " in documented, option.name


def test_every_option_with_a_key_is_read_from_the_config_file(tmp_path: Path) -> None:
    """Each key, given its default (or a value it accepts), comes back checked under its API name."""
    values = {"target": '"tosa-int8"', "method": '"minmax"', "output": '"out.mlir"', "eval": '"eval.npz"',
              "measure": "false", "strict": "true", "bias_correction": "false", "keep_float_below": "29",
              "smoothing": "0.5", "equalization": "false", "rounding": '"double_round"', "accumulator_bits": "16",
              "fixed_inputs": "{ sr = 16000 }", "text_field": '"sentence"'}  # fmt: skip
    keys = {o.key for o in OPTIONS if o.key is not None}
    # the budget's two: not with keep_float_below; the language models' six: with their preset (below)
    assert keys - {
        "max_drop",
        "metric",
        "bits",
        "block_size",
        "symmetric",
        "max_size",
        "tokenizer",
        "embedding_bits",
    } == set(values)
    config = tmp_path / "run.toml"
    config.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
    read = read_config(config).options
    assert read["output"] == str(tmp_path / "out.mlir") and read["eval_data"] == str(tmp_path / "eval.npz")
    assert read["keep_float_below"] == 29.0 and isinstance(read["keep_float_below"], float)
    assert read["fixed_inputs"] == {"sr": 16000} and read["accumulator_bits"] == 16 and read["text_field"] == "sentence"
    options = Options.create(**read)  # together too: tosa-int8's options on tosa-int8, .mlir for it
    assert options.rounding == "double_round" and options.measure is False


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.name not in ("eval_data", "example_inputs",
                                                                          "dynamic_shapes")],
                         ids=lambda o: o.name)  # fmt: skip
def test_a_wrong_value_names_the_option_and_what_it_takes(option: object) -> None:
    assert isinstance(option, type(OPTIONS[0]))
    with pytest.raises(ArgumentError, match=rf"^{option.name} must be .+; got <object object at"):
        Options.create(**{option.name: object()})


def test_an_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ArgumentError, match="unknown option 'calibration_method'; known: target, quantizer, method"):
        Options.create(calibration_method="minmax")


def test_the_rules_that_read_several_options_are_checked_together() -> None:
    with pytest.raises(ArgumentError, match="max_drop needs eval_data"):
        Options.create(max_drop=0.01)
    with pytest.raises(ArgumentError, match="accumulator_bits is an option of the tosa-int8 target, not of "):
        Options.create(accumulator_bits=16)
    with pytest.raises(ArgumentError, match="only the tosa-int8 target writes MLIR"):
        Options.create(output="model.mlir")
    assert Options.create(output="model.mlir", target="tosa-int8").output == "model.mlir"


def test_options_are_frozen_and_resolved_once() -> None:
    options = Options.create()
    assert options.method == "auto" and options.quantizer is not None  # the default method and preset
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.method = "minmax"  # type: ignore[misc]


def test_a_flag_wins_over_the_file_and_a_table_adds_to_it(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nsmoothing = 0.5\nmethod = "minmax"\n[fixed_inputs]\na = 1\n')
    given = read_config(config).merged({"method": "mse", "fixed_inputs": {"b": 2.0}})
    assert given["method"] == "mse" and given["smoothing"] == 0.5 and given["fixed_inputs"] == {"a": 1, "b": 2.0}


def test_the_config_files_new_keys_reach_the_run(tmp_path: Path) -> None:
    """``measure`` was a flag only: the file turns the latency measurement off too."""
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nmeasure = false\n')
    out = tmp_path / "out.onnx"
    result = run_cli(str(DIGITS / "digits_cnn.onnx"), "--config", str(config), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "latency" not in result.stdout and out.exists()


def test_the_language_models_keys_are_read_from_the_config_file_with_their_preset(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('preset = "INT4_BLOCKWISE_WEIGHTS"\nbits = 8\nblock_size = 64\nsymmetric = false\n'
                      'tokenizer = "tok"\nmax_size = 120\n')  # fmt: skip
    settings = read_config(config)
    options = Options.create(**settings.options, quantizer=settings.quantizer())
    assert options.flow == "blocks" and options.tokenizer == str(tmp_path / "tok") and options.max_size == 120.0
    fmt = options.block_format
    assert (fmt.bits, fmt.block_size, fmt.symmetric) == (8, 64, False)
    assert options.method is None  # no activation is calibrated
