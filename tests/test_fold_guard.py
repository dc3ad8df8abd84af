"""fold-constants skips onnxscript's folder only where the folder would change nothing.

The guard (``_may_fold``) saves importing onnxscript (0.2 s); if it ever said "nothing to fold"
where the folder folds, canonicalization would silently differ. Every golden model and the real
exported models are checked against the folder itself.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import onnxscript.optimizer
import pytest

import requant
from requant.frontends import load_onnx, load_onnx_text
from requant.passes import get_passes, run_passes
from requant.passes.fold_constants import _may_fold
from tests.pass_harness import read_case

ROOT = Path(__file__).parent.parent
CASES = sorted((Path(__file__).parent / "golden" / "passes").glob("*.test"))


def _before_folding(model: ir.Model) -> ir.Model:
    """The model as fold-constants sees it in canonicalize (the passes before it have run)."""
    passes = get_passes("canonicalize")
    before = passes[: next(i for i, p in enumerate(passes) if p.name == "fold-constants")]
    model, _ = run_passes(model, before)
    return model


def _folder_changes(model: ir.Model) -> bool:
    return bool(onnxscript.optimizer.fold_constants(model.clone(), onnx_shape_inference=False).modified)


def _check(model: ir.Model) -> bool:
    model = _before_folding(model)
    may = _may_fold(model)
    assert may or not _folder_changes(model), "the guard skipped a graph the folder would change"
    return may


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_guard_never_skips_a_golden_model_the_folder_changes(path: Path) -> None:
    case = read_case(path)
    try:
        model = load_onnx_text(case.model_text, path.name)
    except requant.RequantError:
        pytest.skip("the case is about a model that does not load")
    _check(model)


def test_the_exported_digits_cnn_skips_the_folder() -> None:
    """Its only shape arithmetic reads the dynamic batch size: nothing folds, nothing imported."""
    assert not _check(load_onnx(ROOT / "examples" / "digits" / "digits_cnn.onnx"))


SHAPES = {
    # a static dimension read from a shape folds to a constant
    "static_dim": """<ir_version: 10, opset_import: ["" : 21]>
        g (float[N,4] X) => (float[N,2,2] Y) {
            s = Shape <start = 1> (X)
            two = Constant <value = int64[1] {2}> ()
            t = Concat <axis = 0> (two, two)
            n = Shape <end = 1> (X)
            u = Concat <axis = 0> (n, t)
            Y = Reshape(X, u)
            Z = Identity(s)
        }""",
    # reshaping to the shape the tensor has becomes an Identity
    "same_shape": """<ir_version: 10, opset_import: ["" : 21]>
        g (float[N,4] X) => (float[N,4] Y) {
            n = Shape <end = 1> (X)
            four = Constant <value = int64[1] {4}> ()
            u = Concat <axis = 0> (n, four)
            Y = Reshape(X, u)
        }""",
    # one static index of a shape
    "gather_static": """<ir_version: 10, opset_import: ["" : 21]>
        g (float[N,4] X) => (float[N,4] Y) {
            s = Shape(X)
            i = Constant <value = int64[1] {1}> ()
            d = Gather <axis = 0> (s, i)
            n = Shape <end = 1> (X)
            u = Concat <axis = 0> (n, d)
            Y = Reshape(X, u)
        }""",
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_arithmetic_that_folds_runs_the_folder(name: str) -> None:
    model = _before_folding(load_onnx_text(SHAPES[name], name))
    assert _folder_changes(model)
    assert _may_fold(model)


@pytest.mark.parametrize("name", ["mobilenet_v2", "minilm"])
def test_guard_on_real_exports(name: str) -> None:
    from tests.models import exported

    _check(exported("minilm_static" if name == "minilm" else name))


def test_an_index_out_of_a_shape_leaves_the_decision_to_the_folder() -> None:
    """The guard does not fail on a Gather past the end of a shape; the folder runs and reports it."""
    text = """<ir_version: 10, opset_import: ["" : 21]>
        g (float[N,4] X) => (int64[1] Y) {
            s = Shape(X)
            i = Constant <value = int64[1] {5}> ()
            Y = Gather <axis = 0> (s, i)
        }"""
    assert _may_fold(_before_folding(load_onnx_text(text, "gather_out_of_range")))
