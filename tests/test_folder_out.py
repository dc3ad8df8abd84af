"""``requant quantize IN -o DIR``: the model, ``requant.toml``, the reports and the source folder's side files in
one folder; the recipe replays the run to the byte; a refused or failed run leaves no folder."""

from __future__ import annotations

import io
import shutil
import tomllib
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

from requant.cli import main

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


def _quantize(*args: str) -> int:
    with redirect_stdout(io.StringIO()):
        return main(["quantize", *args])


def test_a_folder_out_holds_the_model_its_recipe_reports_and_side_files_and_the_recipe_replays_it(
    tmp_path: Path,
) -> None:
    source = tmp_path / "source"  # as an Optimum export lays a model out: the ONNX file beside its config
    source.mkdir()
    shutil.copy(DIGITS / "digits_cnn.onnx", source / "model.onnx")
    (source / "config.json").write_text('{"model_type": "digits"}\n')
    (source / "tokenizer.model").write_bytes(bytes(range(256)))  # copied as bytes, not text
    (source / "notes.txt").write_text("not read by any loader\n")
    out = tmp_path / "int8"
    assert _quantize(str(source / "model.onnx"), "-o", str(out), "--calib", str(DIGITS / "calib.npz"), "--eval",
                     str(DIGITS / "eval.npz"), "--no-measure", "--smoothing", "0.5") == 0  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.onnx", "report.json", "report.md", "requant.toml", "tokenizer.model"
    ]  # fmt: skip
    assert (out / "tokenizer.model").read_bytes() == bytes(range(256))
    assert (out / "config.json").read_text() == '{"model_type": "digits"}\n'
    recipe = tomllib.loads((out / "requant.toml").read_text())
    assert recipe["calib"] == str(DIGITS / "calib.npz") and recipe["smoothing"] == 0.5 and recipe["measure"] is False
    replayed = tmp_path / "replayed.onnx"
    assert _quantize(str(source / "model.onnx"), "--config", str(out / "requant.toml"), "-o", str(replayed)) == 0
    assert replayed.read_bytes() == (out / "model.onnx").read_bytes()


def test_a_folder_out_onto_the_input_or_after_a_failure_leaves_nothing(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(DIGITS / "digits_cnn.onnx", source / "model.onnx")
    before = (source / "model.onnx").read_bytes()
    assert _quantize(str(source / "model.onnx"), "-o", str(source), "--calib", str(DIGITS / "calib.npz")) != 0
    assert sorted(p.name for p in source.iterdir()) == ["model.onnx"] and (source / "model.onnx").read_bytes() == before
    bad = tmp_path / "bad.npz"
    x = np.load(DIGITS / "calib.npz")["x"][:8].copy()
    x[3, 0, 0, 0] = np.nan
    np.savez(bad, x=x)
    assert _quantize(str(source / "model.onnx"), "-o", str(tmp_path / "int8"), "--calib", str(bad)) != 0
    assert not (tmp_path / "int8").exists()

