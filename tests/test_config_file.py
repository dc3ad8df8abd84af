"""``requant quantize --config FILE``: a TOML file says what the flags say, plus per-node and per-module settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from requant.config_file import ConfigFileError, read_config
from requant.frontends import load_onnx
from tests.test_images import write_digits

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "requant", "quantize", *args], capture_output=True, text=True, timeout=300
    )


def test_a_config_file_with_images_an_override_and_reports(tmp_path: Path) -> None:
    write_digits(tmp_path / "photos", 30)
    (tmp_path / "run.toml").write_text(
        """
calib = "photos"                  # relative to this file
output = "out/digits_int8.onnx"
method = "mse"

[images]
scale = 0.0078125                 # pixels are k * 8 for the digits' k / 16
mean = [0.0]
std = [1.0]

[report]
json = "out/report.json"
markdown = "out/report.md"

[[override]]
module = "classifier"
config = "float"
"""
    )
    (tmp_path / "out").mkdir()
    result = run_cli(str(DIGITS / "digits_cnn.onnx"), "--config", str(tmp_path / "run.toml"))
    assert result.returncode == 0, result.stderr
    assert "int8 kernels: 2 (QLinearConv x2)" in result.stdout  # the classifier's Gemm stayed float
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["lint"]["int8_kernels"] == {"QLinearConv": 2}
    observers = {c["value"]: c["observer"] for c in report["calibrated"] if c["kind"] == "activation"}
    assert observers.pop("x") == "minmax" and set(observers.values()) == {"mse"}  # the model's input: whole range
    records = report["quantizers"]["quantizers"]
    assert [(r["finder"], r["config"]) for r in records[:2]] == [
        ("ModulePath('classifier')", "FLOAT"),
        ("Global()", "INT8_PER_CHANNEL_WEIGHTS"),
    ]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert markdown.startswith("# requant quantization report\n")
    assert "| QLinearConv | 2 |" in markdown
    # the Gemm and the classifier's data-movement ops (a flatten), which a float override keeps float too
    assert "| PatternQuantizer | ModulePath('classifier') | FLOAT | 4 | 4 | 0 | 0 |" in markdown
    assert "| `features.3.weight_bn` | weight | minmax | `!quant.uniform<i8:f32:0, {0.0" in markdown
    assert "...` (32 values) |" in markdown  # long per-channel types are cut in the page, whole in the JSON
    assert (tmp_path / "out" / "digits_int8.onnx").is_file()


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\npreset = "INT8_PER_TENSOR"\n')
    out = tmp_path / "m.onnx"
    report = tmp_path / "r.json"
    args = [str(DIGITS / "digits_cnn.onnx"), "--config", str(config), "-o", str(out), "--report-json", str(report)]
    assert run_cli(*args).returncode == 0
    assert json.loads(report.read_text())["quantizers"]["quantizers"][0]["config"] == "INT8_PER_TENSOR"
    assert run_cli(*args, "--preset", "INT8_REDUCED_RANGE_WEIGHTS").returncode == 0
    assert json.loads(report.read_text())["quantizers"]["quantizers"][0]["config"] == "INT8_REDUCED_RANGE_WEIGHTS"
    assert json.loads(report.read_text())["bias_correction"]["enabled"] is True


def test_bias_correction_can_be_turned_off_in_the_file_or_by_flag(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nbias_correction = false\n')
    assert read_config(config).options["bias_correction"] is False
    out, report = tmp_path / "m.onnx", tmp_path / "r.json"
    args = [str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--report-json", str(report)]
    result = run_cli(*args, "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["bias_correction"] == {"enabled": False, "kernels": []}
    assert "bias correction" not in result.stdout
    result = run_cli(*args, "--calib", str(DIGITS / "calib.npz"), "--no-bias-correction")
    assert json.loads(report.read_text())["bias_correction"]["enabled"] is False


def test_keep_float_below_in_the_file_and_by_flag(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nkeep_float_below = 41\n')
    assert read_config(config).options["keep_float_below"] == 41.0
    out, report = tmp_path / "m.onnx", tmp_path / "r.json"
    args = [str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--report-json", str(report)]
    result = run_cli(*args, "--config", str(config), "--keep-float-below", "20")
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["kept_float_below"] == {"threshold_db": 20.0, "kernels": []}
    assert "kernel SQNR against float: lowest" in result.stdout


def test_smoothing_in_the_file_and_by_flag(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nsmoothing = 0\n')
    assert read_config(config).options["smoothing"] == 0.0
    out, report = tmp_path / "m.onnx", tmp_path / "r.json"
    args = [str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--report-json", str(report), "--no-measure"]
    assert run_cli(*args, "--config", str(config)).returncode == 0
    assert json.loads(report.read_text())["smoothing"] == {"alpha": None, "not_applied": "off", "inputs": []}
    assert run_cli(*args, "--config", str(config), "--smoothing", "0.5").returncode == 0
    section = json.loads(report.read_text())["smoothing"]
    assert section["alpha"] == 0.5 and section["not_applied"].startswith("a convolutional model (2 convolutions")


def test_equalization_in_the_file_and_refused_when_not_a_boolean(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nequalization = false\n')
    assert read_config(config).options["equalization"] is False
    out, report = tmp_path / "m.onnx", tmp_path / "r.json"
    args = [str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--report-json", str(report), "--no-measure"]
    assert run_cli(*args, "--config", str(config)).returncode == 0
    assert json.loads(report.read_text())["equalization"]["enabled"] is False
    config.write_text(f'calib = "{DIGITS / "calib.npz"}"\nequalization = "yes"\n')
    with pytest.raises(ConfigFileError, match="equalization"):
        read_config(config)


def test_named_configs_and_module_params(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        """
[configs.W8_ONLY]
base = "INT8_PER_CHANNEL_WEIGHTS"
input_activation = "float"
output_activation = "float"
bias = "float"

[[override]]
op_type = ["Gemm"]
config = "W8_ONLY"

[module_params."features"]
weights = { dtype = "int8", symmetric = true, granularity = "per_axis", axis = 0, reduce_range = true }
activations = "#requant.spec<uint8, affine, observer = percentile{percentile = 99.9}>"

[module_params."features.3"]
activations = "float"
"""
    )
    settings = read_config(config)
    model = load_onnx(DIGITS / "digits_cnn.onnx")
    report = settings.quantizer().quantize(model)
    by_config = {r.config: r for r in report.records}
    (gemm,) = [d for d in by_config["W8_ONLY"].decisions if d.status == "accepted"]
    assert gemm.nodes == ["node_linear"]
    assert gemm.inputs == {  # weights only: the activations and the bias stay float
        "clone_1": "#requant.float",
        "classifier.2.weight": "#requant.spec<int8, symmetric, per_axis = 0, observer = minmax>",
        "classifier.2.bias": "#requant.float",
    }
    (conv,) = [d for d in by_config["QuantParams(features)"].decisions if d.nodes == ["node_conv2d"]]
    assert conv.inputs == {
        "x": "#requant.spec<uint8, affine, observer = percentile{percentile = 99.9}>",
        "features.0.weight": "#requant.spec<int8, symmetric, reduced, per_axis = 0, observer = minmax>",
        "features.0.bias": "#requant.derived<int32, product_of_scales(%x, %features.0.weight)>",
    }
    # features.3 sets its own parameters (float activations, weights left to nobody): nothing quantized there
    (conv2,) = [d for d in by_config["QuantParams(features.3)"].decisions if d.nodes == ["node_conv2d_1"]]
    assert conv2.inputs == {"relu": "#requant.float", "features.3.bias": "#requant.float"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'presets = "A16W8"',
            "unknown key 'presets'; known keys: accumulator_bits, bias_correction, bits, block_size, calib, configs",
        ),
        ("method = 3", "run.toml: method must be None, 'auto' or one of entropy, mean_minmax"),
        ('bias_correction = "no"', "run.toml: bias_correction must be True or False; got 'no' (str)"),
        ('keep_float_below = "high"', "run.toml: keep_float_below must be a finite number of dB"),
        (
            'smoothing = "yes"',
            "run.toml: smoothing must be an alpha in [0, 1] (0 or None: off; default 0.8, 0.5 on executorch-xnnpack); got 'yes' (str)",
        ),
        ("calib = [", "is not valid TOML"),
        ('preset = "INT9"', "preset: unknown preset 'INT9'; known: A16W8"),
        ('[[override]]\nop_type = "Conv"\nnode = "a"\nconfig = "float"', "override 1: needs exactly one of op_type"),
        ('[[override]]\nop_type = "Conv"\nconfig = "INT9"', "override 1.config: unknown config 'INT9'; known: float"),
        ('[[override]]\nop_type = "Conv"', "override 1: needs a config"),
        ('[configs.X]\nweight = "#requant.spec<int9, symmetric, observer = minmax>"', "configs.X.weight: invalid"),
        ('[configs.X]\nweight = { dtype = "int8", granularity = "per_axis" }', "needs an integer axis"),
        ('[configs.X]\nweights = "float"', "configs.X: unknown key 'weights'; known keys: base, input_activation"),
        ('[images]\npreset = "vgg"', "images: unknown preset 'vgg'"),
        ('[module_params.features]\nbias = "float"', "module_params.features: unknown key 'bias'"),
        ("", "no calib: give --calib or set 'calib' in the --config file"),
        (
            '[configs.X]\nweight = { dtype = "int8", observer = "percentile", observer_options = { percentile = 150 } }',
            "observer 'percentile': option 'percentile' must be a number in (50, 100], got 150",
        ),
        (
            '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = mse{bins = 0}>"',
            "observer 'mse': option 'bins' must be an integer >= 2, got 0",
        ),
        (
            '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = minmax{bins = 8}>"',
            "observer 'minmax' takes no options; got option 'bins'",
        ),
    ],
)
def test_config_file_mistakes_fail_cleanly(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    out = tmp_path / "out.onnx"
    result = run_cli(str(DIGITS / "digits_cnn.onnx"), "--config", str(config), "-o", str(out))
    assert result.returncode == 1, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("requant quantize: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    result = run_cli(str(DIGITS / "digits_cnn.onnx"), "--config", str(tmp_path / "nope.toml"), "-o", "x.onnx")
    assert result.returncode == 1
    assert f"no config file at '{tmp_path / 'nope.toml'}'" in result.stderr


def test_a_folder_or_non_utf8_file_as_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=f"'{tmp_path}' is a folder, not a config file"):
        read_config(tmp_path)
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('method = "d\xe9faut"\n'.encode("latin-1"))
    with pytest.raises(ConfigFileError, match=r"is not UTF-8 text \(TOML is UTF-8\): byte 0xe9 at offset 11"):
        read_config(latin)


@pytest.mark.parametrize("doc", ["docs/quickstart.md", "src/requant/config_file.py"])
def test_the_documented_config_file_reads(tmp_path: Path, doc: str) -> None:
    text = (Path(__file__).parent.parent / doc).read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "requant.toml").write_text(example)
    settings = read_config(tmp_path / "requant.toml")
    assert settings.calib is not None and settings.calib.startswith(str(tmp_path))
    assert settings.quantizer().order()  # every override and module parameter builds a quantizer
