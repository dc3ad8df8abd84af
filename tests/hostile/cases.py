"""Bad inputs, generated: models, data, options, config files and API arguments that must each get one
clear ``RequantError`` (CLI: one ``requant quantize: error: ...`` line, exit 1; usage errors exit 2),
no output file and untouched inputs.

Each :class:`Case` builds its inputs in a fresh folder from the bundled digits model and data, and
says what the message must contain. ``tests/hostile/test_hostile.py`` runs every case through the
command line (in-process) and, where it has one, through the API.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

DIGITS = Path(__file__).parent.parent.parent / "examples" / "digits"


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    message: str  # what the error must say (the offending thing and what was expected)
    argv: Callable[[Path], list[str]] | None = None  # the command line, built in the case's folder
    api: Callable[[Path], dict[str, Any]] | None = None  # requant.api.quantize's arguments
    code: int = 1  # the CLI's exit code (2: a usage error argparse reports)
    tags: tuple[str, ...] = field(default=())


def workspace(tmp: Path) -> None:
    """The good inputs every case starts from: the digits model, its calibration and evaluation data."""
    for name in ("digits_cnn.onnx", "calib.npz", "eval.npz"):
        shutil.copy(DIGITS / name, tmp / name)


def quantize(
    *extra: str, model: str = "digits_cnn.onnx", calib: str | None = "calib.npz"
) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        argv = ["quantize", str(tmp / model), "-o", str(tmp / "out.onnx"), "--no-measure"]
        if calib is not None:
            argv += ["--calib", str(tmp / calib)]
        return argv + [a.replace("{tmp}", str(tmp)) for a in extra]

    return build


def api(model: str = "digits_cnn.onnx", calib: Any = "calib.npz", **kwargs: Any) -> Callable[[Path], dict[str, Any]]:
    def build(tmp: Path) -> dict[str, Any]:
        data = tmp / calib if isinstance(calib, str) else calib
        given = {k: (tmp / v[len("{tmp}/") :] if isinstance(v, str) and v.startswith("{tmp}/") else v)
                 for k, v in kwargs.items()}  # fmt: skip
        return {"model": tmp / model if isinstance(model, str) else model, "calibration_data": data,
                "measure": False, **given}  # fmt: skip

    return build


# ---------------------------------------------------------------------------------------------- models


def _write(name: str, content: bytes | Callable[[Path], None]) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        if callable(content):
            content(tmp / name)
        else:
            (tmp / name).write_bytes(content)
        return name

    return make


def _edited(edit: Callable[[onnx.ModelProto], None], external: bool = False) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        model = onnx.load(DIGITS / "digits_cnn.onnx")
        if external:
            (path.parent / (path.name + ".data")).unlink(missing_ok=True)  # onnx.save appends to it
            onnx.save(model, path, save_as_external_data=True, location=path.name + ".data", size_threshold=0)
            model = onnx.load(path, load_external_data=False)
        edit(model)
        onnx.save(model, path)

    return make


def _opset(version: int) -> Callable[[onnx.ModelProto], None]:
    def edit(model: onnx.ModelProto) -> None:
        model.opset_import[0].version = version

    return edit


def _unknown_domain(model: onnx.ModelProto) -> None:
    model.graph.node[0].domain = "com.example"
    model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))


def _dangling_input(model: onnx.ModelProto) -> None:
    model.graph.node[0].input[0] = "nowhere"


def _external(key: str, value: str) -> Callable[[onnx.ModelProto], None]:
    def edit(model: onnx.ModelProto) -> None:
        for entry in model.graph.initializer[0].external_data:
            if entry.key == key:
                entry.value = value

    return edit


def _weight_value(value: float) -> Callable[[onnx.ModelProto], None]:
    def edit(model: onnx.ModelProto) -> None:
        weight = next(t for t in model.graph.initializer if len(t.dims) == 4)
        array = onnx.numpy_helper.to_array(weight).copy()
        array.flat[3] = value
        weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))

    return edit


def _drop_external(path: Path) -> None:
    _edited(lambda m: None, external=True)(path)
    (path.parent / (path.name + ".data")).unlink()


MODELS: list[tuple[str, Callable[[Path], None] | bytes, str]] = [
    ("garbage.onnx", b"\x08\x07\x12garbage", "could not parse '{tmp}/garbage.onnx' as an ONNX model"),
    ("empty.onnx", b"", "'{tmp}/empty.onnx' imports no version of the default ONNX domain"),
    ("png.onnx", b"\x89PNG\r\n\x1a\n" + bytes(40), "could not parse '{tmp}/png.onnx' as an ONNX model"),
    ("truncated.onnx", lambda p: p.write_bytes((DIGITS / "digits_cnn.onnx").read_bytes()[:5000]),
     "could not parse '{tmp}/truncated.onnx' as an ONNX model"),
    ("text.onnxtxt", b"<ir_version: 10>\ng (float X) => (float Y) { Y = Relu(X ", "could not parse '{tmp}/text.onnxtxt' as ONNX text"),
    ("latin1.onnxtxt", '<ir_version: 10, opset_import: ["" : 21]>\ng (float[1] X) => (float[1] Y) {\n Y = Relu(X) # \xe9\n}'.encode("latin-1"),
     "is not UTF-8 text (ONNX text syntax is UTF-8): byte 0xe9"),
    ("opset99.onnx", _edited(_opset(99)), "uses opset 99 of the default ONNX domain; the newest requant knows is"),
    ("domain.onnx", _edited(_unknown_domain), "uses operators from unknown domain(s) 'com.example': 'node_Shape_0' (com.example.Shape)"),
    ("dangling.onnx", _edited(_dangling_input), "fails ONNX's checker"),
    ("nodata.onnx", _drop_external, "initializer 'features.0.weight' keeps its data in 'nodata.onnx.data', which is missing"),
    ("absolute.onnx", _edited(_external("location", "/etc/hostname"), external=True),
     "keeps its data at '/etc/hostname', outside the model's folder"),
    ("parent.onnx", _edited(_external("location", "../w.bin"), external=True), "keeps its data at '../w.bin', outside"),
    ("offset.onnx", _edited(_external("offset", "ten"), external=True), "non-numeric external-data offset or length ('ten'"),
    ("short.onnx", _edited(_external("length", "999999999"), external=True), "needs bytes up to 999999999 of 'short.onnx.data', which has only 40488"),

]  # fmt: skip


# bad for quantizing only: opt and lint take such a model as it is
QUANTIZE_MODELS: list[tuple[str, Callable[[Path], None] | bytes, str]] = [
    ("nanweight.onnx", _edited(_weight_value(float("nan"))),
     "weight 'features.0.weight_bn' (read by node 'node_conv2d') holds 1 non-finite value(s), the first NaN at index [0, 0, 1, 0]"),
    ("infweight.onnx", _edited(_weight_value(float("inf"))),
     "weight 'features.0.weight_bn' (read by node 'node_conv2d') holds 1 non-finite value(s), the first infinite at index [0, 0, 1, 0]"),
]  # fmt: skip


def model_cases() -> list[Case]:
    cases = []
    for name, content, message in MODELS + QUANTIZE_MODELS:
        make = _write(name, content)

        def argv(tmp: Path, make: Callable[[Path], str] = make) -> list[str]:
            return quantize(model=make(tmp))(tmp)

        def arguments(tmp: Path, make: Callable[[Path], str] = make) -> dict[str, Any]:
            return api(model=make(tmp))(tmp)

        cases.append(Case("model", name, message, argv, arguments))
    cases += [
        Case("model", "missing", "no model file at '{tmp}/missing.onnx'", quantize(model="missing.onnx"),
             api(model="missing.onnx")),
        Case("model", "folder", "no model file at '{tmp}/sub'", lambda t: (t / "sub").mkdir() or quantize(model="sub")(t),
             lambda t: (t / "sub").mkdir(exist_ok=True) or api(model="sub")(t)),
        Case("model", "an int", "cannot load a int", None, api(model=5)),  # type: ignore[arg-type]
    ]  # fmt: skip
    return cases


# ------------------------------------------------------------------------------------------------ data


def _npz(name: str, **arrays: Any) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        np.savez(tmp / name, **arrays)
        return name

    return make


def _raw(name: str, content: bytes | Callable[[], bytes]) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        (tmp / name).write_bytes(content() if callable(content) else content)
        return name

    return make


def _good(n: int = 8) -> np.ndarray:
    with np.load(DIGITS / "calib.npz") as archive:
        return np.asarray(archive["x"][:n])


def _with(value: float, at: tuple[int, ...] = (3, 0, 4, 4), dtype: type = np.float32) -> np.ndarray:
    x = _good().astype(dtype)
    x[at] = value
    return x


def _object_npy(tmp: Path) -> str:
    np.save(tmp / "objects.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    return "objects.npy"


def _image_folder(tmp: Path) -> str:
    (tmp / "pictures").mkdir(exist_ok=True)
    (tmp / "pictures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    return "pictures"


def _hf_folder(tmp: Path) -> bool:
    """A folder with a Hugging Face config and weights' file (not read: the commands stop at the folder)."""
    (tmp / "hf").mkdir(exist_ok=True)
    (tmp / "hf" / "config.json").write_text('{"architectures": ["BertModel"]}')
    (tmp / "hf" / "model.safetensors").write_bytes(b"")
    return True


def _empty_folder(tmp: Path) -> str:
    (tmp / "nothing").mkdir(exist_ok=True)
    return "nothing"


DATA: list[tuple[str, Callable[[Path], str], str]] = [
    ("missing", lambda t: "missing.npz", "no calibration data at '{tmp}/missing.npz'"),
    ("text", _raw("text.npz", b"x,y\n1,2\n"), "calibration file '{tmp}/text.npz' is not a .npz file"),
    ("png", _raw("png.npy", b"\x89PNG\r\n\x1a\n" + bytes(40)), "calibration file '{tmp}/png.npy' is not a .npy file"),
    ("truncated", _raw("truncated.npz", lambda: (DIGITS / "calib.npz").read_bytes()[:3000]),
     "calibration file '{tmp}/truncated.npz' cannot be read as .npz"),
    ("object npy", _object_npy, "cannot be read as .npy: it holds object arrays, which would need unpickling"),
    ("object npz", _npz("objects.npz", x=np.array([None, 1], dtype=object)), "holds object arrays"),
    ("csv suffix", _raw("data.csv", b"1,2\n"), "'{tmp}/data.csv': calibration files are .npz or .npy"),
    ("images without preprocessing", _image_folder, "'{tmp}/pictures' holds images: state how to preprocess them"),
    ("empty folder", _empty_folder, "'{tmp}/nothing' holds no .npz or .npy files"),
    ("0-d", _npz("scalar.npz", x=np.float32(0.5)), "calibration array 'x' is 0-d (a scalar)"),
    ("wrong name", _npz("name.npz", image=_good()), "calibration sample 1: the model has no input named 'image' (its inputs: x)"),
    ("wrong rank", _npz("rank.npz", x=_good()[:, 0]), "calibration sample 1: input 'x' expects rank 4"),
    ("wrong size", _npz("size.npz", x=_good()[..., :7]), "calibration sample 1: input 'x' expects size 8 on axis 3"),
    ("strings", _npz("strings.npz", x=np.array(["a"] * 8)), "calibration sample 1: input 'x' expects float32, got <U1"),
    ("no samples", _npz("none.npz", x=_good()[:0]), "the calibration data set is empty"),
    ("NaN", _npz("nan.npz", x=_with(np.nan)), "calibration sample 4: input 'x' has 1 NaN value(s) (the first at index [0, 0, 4, 4])"),
    ("inf", _npz("inf.npz", x=_with(np.inf)), "calibration sample 4: input 'x' has 1 infinite value(s)"),
    ("-inf", _npz("ninf.npz", x=_with(-np.inf)), "calibration sample 4: input 'x' has 1 infinite value(s)"),
    ("outlier", _npz("outlier.npz", x=_with(1e30)), "calibration sample 4: input 'x' reaches 1e+30"),
    ("constant", _npz("zeros.npz", x=np.zeros_like(_good())),
     "calibration input 'x' holds one value (0) in every one of its 8 samples: its quantization range would be that one point"),
    ("beyond float32", _npz("huge.npz", x=_with(1e300, dtype=np.float64)),
     "calibration sample 4: input 'x' holds 1e+300, beyond float32's range (3.4e+38): it would become infinite"),
]  # fmt: skip


def data_cases() -> list[Case]:
    cases = []
    for name, make, message in DATA:

        def argv(tmp: Path, make: Callable[[Path], str] = make) -> list[str]:
            return quantize(calib=make(tmp))(tmp)

        def arguments(tmp: Path, make: Callable[[Path], str] = make) -> dict[str, Any]:
            return api(calib=make(tmp))(tmp)

        cases.append(Case("data", name, message, argv, arguments))
        if name in ("missing", "text", "wrong name", "NaN", "0-d"):  # the same, given as evaluation data

            def eval_argv(tmp: Path, make: Callable[[Path], str] = make) -> list[str]:
                return quantize("--eval", str(tmp / make(tmp)))(tmp)

            def eval_api(tmp: Path, make: Callable[[Path], str] = make) -> dict[str, Any]:
                return api(eval_data=f"{{tmp}}/{make(tmp)}")(tmp)

            wanted = message.replace("calibration", "evaluation")
            cases.append(Case("evaluation data", name, wanted, eval_argv, eval_api))
    labels = _npz("labels.npz", x=_good(), labels=np.zeros(3, np.int64))
    cases += [
        Case("evaluation data", "labels of the wrong length", "the evaluation data has 8 samples (first output rows) but 3 labels",
             lambda t: quantize("--eval", str(t / labels(t)))(t), lambda t: api(eval_data=f"{{tmp}}/{labels(t)}")(t)),
        Case("data", "a number", "cannot read calibration data from a int", None, api(calib=5)),
        Case("data", "a generator of strings", "calibration sample 1: expected a dict of input name -> array, got str",
             None, api(calib=iter(["a", "b"]))),
        Case("data", "a dict with a string", "calibration array 'x' is 0-d (a scalar)", None, api(calib={"x": "abc"})),
    ]  # fmt: skip
    return cases


# --------------------------------------------------------------------------------------------- options


def _folder(name: str) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        (tmp / name).mkdir(exist_ok=True)
        return str(tmp / name)

    return make


def option_cases() -> list[Case]:
    q = quantize
    return [
        Case("options", "keep-float-below nan", "keep_float_below must be a finite number of dB", q("--keep-float-below", "nan")),
        Case("options", "keep-float-below inf", "keep_float_below must be a finite number of dB", q("--keep-float-below", "inf")),
        Case("options", "keep-float-below text", "--keep-float-below: invalid float value: 'high'",
             q("--keep-float-below", "high"), code=2),
        Case("options", "unknown target", "argument --target: invalid choice: 'onnxruntime-gpu'", q("--target", "onnxruntime-gpu"), code=2),
        Case("options", "unknown preset", "argument --preset: invalid choice: 'INT9'", q("--preset", "INT9"), code=2),
        Case("options", "unknown method", "method must be None, 'auto' or one of entropy, mean_minmax, minmax, moving_average_minmax, mse, "
             "percentile, stem_percentile; got 'best' (str)", q("--method", "best")),
        Case("options", "unknown images", "argument --images: invalid choice: 'vgg'", q("--images", "vgg"), code=2),
        Case("options", "output onto the model", "-o '{tmp}/digits_cnn.onnx' is the input model: refusing to overwrite it",
             lambda t: [*q()(t)[:3], str(t / "digits_cnn.onnx"), *q()(t)[4:]]),
        Case("options", "output onto the data", "-o '{tmp}/calib.npz' is the calibration data: refusing to overwrite it",
             lambda t: [*q()(t)[:3], str(t / "calib.npz"), *q()(t)[4:]]),
        Case("options", "output in a missing folder", "-o '{tmp}/no/out.onnx': the folder '{tmp}/no' does not exist",
             lambda t: [*q()(t)[:3], str(t / "no" / "out.onnx"), *q()(t)[4:]]),
        Case("options", "output folder in a missing folder", "-o '{tmp}/no/int8': the folder '{tmp}/no' does not exist",
             lambda t: [*q()(t)[:3], str(t / "no" / "int8"), *q()(t)[4:]]),
        Case("options", "output name too long", "File name too long",
             lambda t: [*q()(t)[:3], str(t / ("m" * 251 + ".onnx")), *q()(t)[4:]]),
        Case("options", "report onto the output", "--report-json '{tmp}/out.onnx' is also -o: give each output its own file",
             q("--report-json", "{tmp}/out.onnx")),
        Case("options", "report onto the model", "--report-md '{tmp}/digits_cnn.onnx' is the input model",
             q("--report-md", "{tmp}/digits_cnn.onnx")),
        Case("options", "report in a missing folder", "--report-json '{tmp}/no/r.json': the folder '{tmp}/no' does not exist",
             q("--report-json", "{tmp}/no/r.json")),
        Case("options", "report is a folder", "--report-md '{tmp}/dir' is a folder", lambda t: q("--report-md", _folder("dir")(t))(t)),
        Case("options", "the two reports in one file", "--report-md '{tmp}/r.txt' is also --report-json",
             q("--report-json", "{tmp}/r.txt", "--report-md", "{tmp}/r.txt")),
        Case("options", "no calibration data", "no calib: give --calib or set 'calib' in the --config file", q(calib=None)),
        Case("options", "no output", "no output: give -o/--output or set 'output' in the --config file",
             lambda t: [a for a in q()(t) if a not in ("-o", str(t / "out.onnx"))]),
    ]  # fmt: skip


# -------------------------------------------------------------------------------------------- configs

CONFIGS: list[tuple[str, str, str]] = [
    ("unknown key", 'presets = "A16W8"', "unknown key 'presets'; known keys: accumulator_bits, bias_correction, bits, block_size, calib, configs"),
    ("method type", "method = 3", "run.toml: method must be None, 'auto' or one of entropy, mean_minmax"),
    ("flag type", 'bias_correction = "no"', "run.toml: bias_correction must be True or False; got 'no' (str)"),
    ("number type", 'keep_float_below = "high"', "run.toml: keep_float_below must be a finite number of dB"),
    ("bad TOML", "calib = [", "is not valid TOML"),
    ("unknown preset", 'preset = "INT9"', "preset: unknown preset 'INT9'; known: A16W8"),
    ("unknown target", 'target = "gpu"', "run.toml: target must be a target name, one of executorch-xnnpack, onnxruntime-cpu"),
    ("override with two finders", '[[override]]\nop_type = "Conv"\nnode = "a"\nconfig = "float"', "override 1: needs exactly one of op_type"),
    ("override without config", '[[override]]\nop_type = "Conv"', "override 1: needs a config"),
    ("override unknown config", '[[override]]\nop_type = "Conv"\nconfig = "INT9"', "override 1.config: unknown config 'INT9'; known: float"),
    ("bad dtype", '[configs.X]\nweight = "#requant.spec<int9, symmetric, observer = minmax>"', "configs.X.weight: invalid"),
    ("per-axis without axis", '[configs.X]\nweight = { dtype = "int8", granularity = "per_axis" }', "needs an integer axis"),
    ("config unknown port", '[configs.X]\nweights = "float"', "configs.X: unknown key 'weights'; known keys: base, input_activation"),
    ("unknown base", '[configs.X]\nbase = "INT9"', "configs.X: unknown base 'INT9'; known presets"),
    ("images preset", '[images]\npreset = "vgg"', "images: unknown preset 'vgg'"),
    ("negative crop", '[images]\npreset = "imagenet"\ncrop = -5', "run.toml: images.crop: image crop must be a positive integer (pixels), got -5"),
    ("mean as text", '[images]\nmean = "abc"', "run.toml: images: could not convert string to float: 'a'"),
    ("std of zero", '[images]\nstd = [0.0, 1.0, 1.0]\nmean = [0.0, 0.0, 0.0]', "run.toml: images.std: image std values must be positive"),
    ("module bias", '[module_params.features]\nbias = "float"', "module_params.features: unknown key 'bias'"),
    ("percentile out of range", '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = percentile{percentile = 150.0}>"',
     "observer 'percentile': option 'percentile' must be a number in (50, 100], got 150.0"),
    ("percentile text", '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = percentile{percentile = high}>"',
     "could not convert string to float: 'high'"),
    ("bins zero", '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = mse{bins = 0}>"',
     "observer 'mse': option 'bins' must be an integer >= 2, got 0"),
    ("option for minmax", '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = minmax{bins = 8}>"',
     "observer 'minmax' takes no options; got option 'bins'"),
    ("unknown observer", '[module_params.features]\nactivations = "#requant.spec<uint8, affine, observer = kl>"', "observer 'kl' is not one of"),
    ("calib not a string", "calib = 3", "calib: expected a path (a string), got 3"),
    ("invalid regex", '[[override]]\nnode_regex = "(["\nconfig = "float"',
     "run.toml: override 1.node_regex: '([' is not a regular expression: unterminated character set at position 1"),
    ("selector not a string", '[[override]]\nnode = 3\nconfig = "float"', "run.toml: override 1.node: expected a string, got 3"),
]  # fmt: skip


def config_cases() -> list[Case]:
    cases = []
    for name, text, message in CONFIGS:

        def argv(tmp: Path, text: str = text) -> list[str]:
            (tmp / "run.toml").write_text(text + "\n", encoding="utf-8")
            return quantize("--config", str(tmp / "run.toml"))(tmp)

        cases.append(Case("config", name, message, argv))
    latin = '[module_params.features]\nactivations = "d\xe9faut"\n'.encode("latin-1")
    cases += [
        Case("config", "missing", "no config file at '{tmp}/nope.toml'", quantize("--config", "{tmp}/nope.toml")),
        Case("config", "a folder", "'{tmp}/dir' is a folder, not a config file", lambda t: quantize("--config", _folder("dir")(t))(t)),
        Case("config", "not UTF-8", "is not UTF-8 text (TOML is UTF-8): byte 0xe9",
             lambda t: (t / "latin.toml").write_bytes(latin) and quantize("--config", str(t / "latin.toml"))(t)),
    ]  # fmt: skip
    return cases


# ---------------------------------------------------------------------------------------------- API


def api_cases() -> list[Case]:
    return [
        Case("api", "quantizer as text", "quantizer must be a requant Quantizer, or None for the defaults; got 'INT8' (str)",
             api=api(quantizer="INT8")),
        Case("api", "output as a number", "output must be a path (str or os.PathLike), or None; got 7 (int)", api=api(output=7)),
        Case("api", "target as a number", "target must be a target name, one of executorch-xnnpack, onnxruntime-cpu, onnxruntime-cpu-vnni, tosa-int8; got 3 (int)", api=api(target=3)),
        Case("api", "unknown target", "target must be a target name, one of executorch-xnnpack, onnxruntime-cpu", api=api(target="gpu")),
        Case("api", "unknown method", "method must be None, 'auto' or one of entropy, mean_minmax, minmax", api=api(method="best")),
        Case("api", "progress not callable", "progress must be None or a callable progress(done, total); got 3 (int)",
             api=api(progress=3)),
        Case("api", "measure as text", "measure must be True or False; got 'no' (str)", api=api(measure="no")),
        Case("api", "strict as a number", "strict must be True or False; got 1 (int)", api=api(strict=1)),
        Case("api", "bias_correction as text", "bias_correction must be True or False; got 'yes' (str)",
             api=api(bias_correction="yes")),
        Case("api", "keep_float_below as text", "keep_float_below must be a finite number of dB (e.g. 29), or None; got '29' (str)",
             api=api(keep_float_below="29")),
        Case("api", "keep_float_below nan", "keep_float_below must be a finite number of dB", api=api(keep_float_below=float("nan"))),
        Case("api", "output onto the model", "output '{tmp}/digits_cnn.onnx' is the model: refusing to overwrite it",
             api=api(output="{tmp}/digits_cnn.onnx")),
        Case("api", "eval as a number", "cannot read evaluation data from a int", api=api(eval_data=5)),
    ]  # fmt: skip


# ------------------------------------------------------------------------------- the other commands

TYPES: list[tuple[str, str]] = [  # MLIR's own messages, with the position
    ("garbage", "1:1: expected a builtin float or integer type or a quantized type, got 'garbage'"),
    ("!quant.uniform<i8:f32, 0.0>", "1:24: scale 0.000000e+00 out of expressed type range"),
    ("!quant.uniform<i8:f32:{0:1}, {{0.5:300}}>", "1:36: zero point 300 out of storage type i8 range [-128, 127]"),
    ("!quant.uniform<i8:f32, nan>", "1:24: expected floating point literal"),
    ("!quant.uniform<i8:f32, 0.5", "1:27: expected '>'"),
    ("tensor<2x!quant.uniform<i8:f32:1, {0.5, 0.25, 0.125}>>", "quantized dimension must be less than tensor rank"),
    ("", "1:1: expected an element type"),
    ("!quant.uniform<i8<-200:100>:f32, 0.5>", "1:19: illegal storage type minimum: -200"),
    ("!quant.uniform<i65:f32, 0.5>", "1:16: illegal storage type size: 65"),
    ("!quant.uniform<i8:f32:-1, {0.5}>", "1:8: illegal quantized dimension: -1"),
    ("!quant.uniform<i8:i32, 0.5>", "1:19: invalid kind of type specified: expected a floating-point type, got 'i32'"),
    (
        "tensor<2x3x!quant.uniform<i8:f32:1, {0.5, 0.25}>>",
        "quantized dimension size does not match number of scales (dimension 1 has size 3, the type has 2 scales)",
    ),
]


def other_command_cases() -> list[Case]:
    cases = []
    for name, content, message in MODELS:
        make = _write(name, content)
        for command in ("opt", "lint"):

            def argv(tmp: Path, make: Callable[[Path], str] = make, command: str = command) -> list[str]:
                model = str(tmp / make(tmp))
                return (
                    [command, model, "-p", "canonicalize", "-o", str(tmp / "out.onnx")]
                    if command == "opt"
                    else [command, model]
                )

            cases.append(Case(command, name, message.replace("{tmp}", "{tmp}"), argv))
    for text, message in TYPES:
        cases.append(Case("type", text or "empty", message, lambda t, text=text: ["type", text]))
    model = "{tmp}/digits_cnn.onnx"
    cases += [
        Case("opt", "unknown pass", "unknown pass 'canonicalise' (did you mean 'canonicalize'?)",
             lambda t: ["opt", model.format(tmp=t), "-p", "canonicalise"]),
        Case("opt", "empty pipeline", "empty pass name in pipeline 'canonicalize,'",
             lambda t: ["opt", model.format(tmp=t), "-p", "canonicalize,"]),
        Case("opt", "output onto the input", "is the input model: refusing to overwrite it",
             lambda t: ["opt", model.format(tmp=t), "-p", "canonicalize", "-o", model.format(tmp=t)]),
        Case("opt", "output in a missing folder", "the folder '{tmp}/no' does not exist",
             lambda t: ["opt", model.format(tmp=t), "-p", "canonicalize", "-o", str(t / "no" / "o.onnx")]),
        Case("lint", "missing", "no model file at '{tmp}/missing.onnx'", lambda t: ["lint", str(t / "missing.onnx")]),
        Case("lint", "a Hugging Face folder", "no model file at '{tmp}/hf': it is a Hugging Face folder, which requant "
             "quantize exports", lambda t: _hf_folder(t) and ["lint", str(t / "hf")]),
        Case("compare", "missing data", "no comparison data at '{tmp}/missing.npz'",
             lambda t: ["compare", model.format(tmp=t), model.format(tmp=t), "--data", str(t / "missing.npz")]),
        Case("compare", "nothing in common", "the quantized model quantizes no tensor the float model computes",
             lambda t: ["compare", model.format(tmp=t), model.format(tmp=t), "--data", str(t / "eval.npz")]),
        Case("compare", "zero samples", "--samples must be at least 1, got 0",
             lambda t: ["compare", model.format(tmp=t), model.format(tmp=t), "--data", str(t / "eval.npz"), "--samples", "0"]),
        Case("compare", "missing model", "no model file at '{tmp}/missing.onnx'",
             lambda t: ["compare", str(t / "missing.onnx"), model.format(tmp=t), "--data", str(t / "eval.npz")]),
        Case("opt", "missing", "no model file at '{tmp}/missing.onnx'",
             lambda t: ["opt", str(t / "missing.onnx"), "-p", "canonicalize"]),
    ]  # fmt: skip
    return cases


def all_cases() -> list[Case]:
    return model_cases() + data_cases() + option_cases() + config_cases() + api_cases() + other_command_cases()
