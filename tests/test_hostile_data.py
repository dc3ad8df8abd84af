"""Bad data files, bad evaluation data and one-shot data: a clear error before any output, or it works."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import requant.api
from requant.calibration import CalibrationError

DIGITS = Path(__file__).parent.parent / "examples" / "digits"
MODEL = DIGITS / "digits_cnn.onnx"


def _quantize_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out" / "int8.onnx"
    out.parent.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "requant", "quantize", str(MODEL), "-o", str(out), "--no-measure", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert not any(out.parent.iterdir()), "a failed run left a file"
    return result


def _files(tmp_path: Path) -> dict[str, Path]:
    """Calibration files that are not what they claim, each written the way a careless user makes them."""
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    (tmp_path / "png.npy").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (tmp_path / "truncated.npz").write_bytes((DIGITS / "calib.npz").read_bytes()[:3000])
    np.save(tmp_path / "objects.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "objects.npz", x=np.array([None, 1], dtype=object))
    return {p.stem: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("text", "calibration file '{path}' is not a .npz file (a zip archive of .npy arrays): it starts with b'x,'"),
        ("png", "calibration file '{path}' is not a .npy file (NumPy's array format): it starts with b'\\x89PNG"),
        ("truncated", "calibration file '{path}' cannot be read as .npz: "),
        ("objects", "cannot be read as .npy: it holds object arrays, which would need unpickling"),
    ],
)
def test_unreadable_data_files_are_named_and_never_unpickled(tmp_path: Path, name: str, message: str) -> None:
    path = _files(tmp_path)[name]
    before = path.read_bytes()
    with pytest.raises(CalibrationError) as raised:
        requant.api.quantize(MODEL, path, measure=False)
    assert message.format(path=path) in str(raised.value)
    assert path.read_bytes() == before
    npz = _files(tmp_path)["objects"].with_suffix(".npz")
    with pytest.raises(CalibrationError, match="holds object arrays"):
        requant.api.quantize(MODEL, npz, measure=False)


def test_the_cli_says_which_file_and_exits_1(tmp_path: Path) -> None:
    path = _files(tmp_path)["truncated"]
    result = _quantize_cli(tmp_path, "--calib", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"requant quantize: error: calibration file '{path}' cannot be read as .npz" in result.stderr


def test_evaluation_data_is_checked_as_evaluation_data(tmp_path: Path) -> None:
    calib = str(DIGITS / "calib.npz")
    with np.load(DIGITS / "eval.npz") as archive:
        x, labels = archive["x"], archive["labels"]
    np.savez(tmp_path / "short_labels.npz", x=x, labels=labels[:100])
    np.savez(tmp_path / "bad_name.npz", image=x)
    bad = x.copy()
    bad[7, 0, 3, 3] = np.nan
    np.savez(tmp_path / "nan.npz", x=bad, labels=labels)
    cases = {
        "missing.npz": f"no evaluation data at '{tmp_path / 'missing.npz'}'",
        "short_labels.npz": "the evaluation data has 450 samples (first output rows) but 100 labels",
        "bad_name.npz": "evaluation sample 1: the model has no input named 'image' (its inputs: x)",
        "nan.npz": "evaluation sample 8: input 'x' has 1 NaN value(s) (the first at index [0, 0, 3, 3])",
    }
    for name, message in cases.items():
        with pytest.raises(CalibrationError) as raised:
            requant.api.quantize(MODEL, calib, eval_data=tmp_path / name, measure=False)
        assert message in str(raised.value), name
    result = _quantize_cli(tmp_path, "--calib", calib, "--eval", str(tmp_path / "missing.npz"))
    assert result.returncode == 1 and f"no evaluation data at '{tmp_path / 'missing.npz'}'" in result.stderr


def test_a_one_shot_generator_is_read_once() -> None:
    with np.load(DIGITS / "calib.npz") as archive:
        x = archive["x"][:200]
    reads = []

    def samples() -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(x)):
            reads.append(i)
            yield {"x": x[i : i + 1]}

    from_generator = requant.api.quantize(MODEL, samples(), measure=False)
    assert reads == list(range(200))  # calibration read it all once; bias correction replayed the first 64
    from_list = requant.api.quantize(MODEL, [{"x": x[i : i + 1]} for i in range(200)], measure=False)
    assert from_generator.report["bias_correction"]["kernels"] == from_list.report["bias_correction"]["kernels"]


def test_a_dimension_declared_as_minus_one_is_dynamic(tmp_path: Path) -> None:
    """Models converted from Paddle declare dynamic dimensions as the literal -1."""
    import onnx

    model = onnx.load(MODEL)
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_value = -1
    onnx.save(model, tmp_path / "minus_one.onnx")
    result = requant.api.quantize(tmp_path / "minus_one.onnx", DIGITS / "calib.npz", measure=False)
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 2, "QGemm": 1}


def test_outputs_are_written_all_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The reports are staged before the model is saved: when saving fails, none is left behind."""
    import requant.frontends
    from requant.cli.main import main
    from requant.frontends import SaveError

    def refuse(model: object, path: object) -> None:
        raise SaveError(f"could not save the model to '{path}': No space left on device")

    calib, out = str(DIGITS / "calib.npz"), tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(requant.frontends, "save_onnx", refuse)
    args = ["quantize", str(MODEL), "-o", str(out / "m.onnx"), "--calib", calib, "--no-measure",
            "--report-json", str(out / "r.json"), "--report-md", str(out / "r.md")]  # fmt: skip
    assert main(args) == 1
    assert "could not save the model" in capsys.readouterr().err and not any(out.iterdir())
    monkeypatch.undo()
    too_long = _quantize_cli(tmp_path, "--calib", calib, "-o", str(out / ("m" * 251 + ".onnx")))
    assert too_long.returncode == 1 and "File name too long" in too_long.stderr, too_long.stderr
    (tmp_path / "folder.json").mkdir()
    result = _quantize_cli(tmp_path, "--calib", calib, "--report-json", str(tmp_path / "folder.json"))
    assert result.returncode == 1 and f"--report-json '{tmp_path / 'folder.json'}' is a folder" in result.stderr


def test_old_and_ir3_style_models_quantize() -> None:
    """An opset-7 model (converted up) and one listing its weights among its inputs (IR 3's way)."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(4, 8)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])
    inputs = [x, helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 8])]
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8])
    data = [{"X": rng.normal(size=(1, 4)).astype(np.float32)} for _ in range(8)]
    for opset, ir_version in ((7, 3), (13, 7)):
        graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g", inputs, [y], [weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
        result = requant.api.quantize(model, data, measure=False)
        assert [v.name for v in result.model.graph.inputs] == ["X"], opset
        assert sum(result.report["lint"]["int8_kernels"].values()) == 1, opset
        proto = ir.to_proto(result.model)
        scales = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.name.endswith("_scale")}
        dx, dw = float(scales["X_scale"]) / 2, scales["W_scale"] / 2  # rounding: half a step each
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        for sample in data:
            x, w = sample["X"], numpy_helper.to_array(weight)
            bound = np.abs(x) @ np.broadcast_to(dw, w.shape) + dx * np.abs(w).sum(0) + 4 * dx * dw
            assert (np.abs(session.run(None, sample)[0] - x @ w) <= bound + 1e-5).all(), opset


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"quantizer": "INT8"}, "quantizer must be a requant Quantizer, or None for the defaults; got 'INT8' (str)"),
        ({"output": 7}, "output must be a path (str or os.PathLike), or None; got 7 (int)"),
        (
            {"target": 3},
            "target must be a target name, one of executorch-xnnpack, onnxruntime-cpu, onnxruntime-cpu-vnni, tosa-int8; got 3 (int)",
        ),
        (
            {"method": "foo"},
            "method must be None, 'auto' or one of entropy, mean_minmax, minmax, moving_average_minmax, mse, percentile",
        ),
        ({"progress": 3}, "progress must be None or a callable progress(done, total); got 3 (int)"),
        ({"measure": "no"}, "measure must be True or False; got 'no' (str)"),
        ({"bias_correction": 1}, "bias_correction must be True or False; got 1 (int)"),
        ({"keep_float_below": "29"}, "keep_float_below must be a finite number of dB"),
    ],
)
def test_api_arguments_of_the_wrong_kind_are_named(arguments: dict[str, Any], message: str) -> None:
    from requant.errors import RequantError

    with pytest.raises(RequantError) as raised:
        requant.api.quantize(MODEL, DIGITS / "calib.npz", **arguments)
    assert message in str(raised.value)


def test_a_npz_is_read_one_sample_at_a_time(tmp_path: Path) -> None:
    """Rows come from each array's stream in the zip: memory holds one sample, not the file."""
    import tracemalloc

    from requant.calibration.samples import iter_samples
    from requant.frontends import load_onnx

    model = load_onnx(MODEL)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (20000, 1, 8, 8)).astype(np.float32)  # 5 MB
    np.savez(tmp_path / "plain.npz", x=x)
    np.savez_compressed(tmp_path / "packed.npz", x=x)
    np.savez(tmp_path / "fortran.npz", x=np.asfortranarray(x[:50]))
    np.savez(tmp_path / "labelled.npz", x=x[:50], labels=np.arange(50))
    for name in ("plain.npz", "packed.npz"):
        sum(1 for _ in iter_samples(model, tmp_path / name))  # the modules it imports are not data
        tracemalloc.start()
        count = sum(1 for _ in iter_samples(model, tmp_path / name))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == 20000 and peak < 1_000_000, (name, peak)  # the whole array is 5 MB
    for source, rows in (("fortran.npz", x[:50]), ("packed.npz", x)):
        got = np.concatenate([s["x"] for s in iter_samples(model, tmp_path / source)])
        assert np.array_equal(got, rows)
    assert len(list(iter_samples(model, tmp_path / "labelled.npz", "evaluation"))) == 50  # labels are not an input


def test_an_unwritable_output_folder_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user without write permission sees it (the tests run as root, so access is denied by hand)."""
    import os

    from requant.frontends import SaveError

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    with pytest.raises(SaveError, match=f"output '{tmp_path / 'm.onnx'}': the folder '{tmp_path}' is not writable"):
        requant.api.quantize(MODEL, DIGITS / "calib.npz", output=tmp_path / "m.onnx", measure=False)
    assert not any(tmp_path.iterdir())


def test_a_model_computing_nan_gets_no_nan_figures() -> None:
    """A float model whose output is NaN on some samples: the evaluation says where, not 'cosine nan'."""
    from requant.frontends import load_onnx_text

    model = load_onnx_text("""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[1,4] X) => (float[1,4] Y) {
            W = Constant <value = float[4,4] {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}> ()
            m = MatMul(X, W)
            Y = Sqrt(m)
        }""")
    rng = np.random.default_rng(0)
    calib = [{"X": rng.uniform(0, 1, (1, 4)).astype(np.float32)} for _ in range(8)]
    evaluation = [*calib[:2], {"X": -np.ones((1, 4), np.float32)}]
    with pytest.raises(CalibrationError, match="evaluation sample 3: the float model's first output is not finite"):
        requant.api.quantize(model, calib, eval_data=evaluation, measure=False)
