"""Golden pass tests: a model in ONNX text syntax, a pipeline, the expected printed IR or error.

A test file looks like::

    # pipeline: fold-batchnorm
    # free comments...
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[1,3,4,4] X) => (float[1,8,4,4] Y) { ... }
    # expected:
    module ir_version=10 opsets={"": 21}
    ...

or ends with ``# expected error: <first line of the message>``. ``pytest
--update-golden`` rewrites the expected part from what the code prints now.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from requant.errors import RequantError
from requant.frontends import load_onnx_text
from requant.ir import print_model
from requant.passes import PassOptions, parse_pipeline, run_passes
from tests.golden_file import header_value, model_text

__all__ = ["PassCase", "check_numerics", "read_case", "run_case"]

EXPECTED = "# expected:"
EXPECTED_ERROR = "# expected error:"


@dataclass
class PassCase:
    path: Path
    pipeline: str
    model_text: str
    expected: str
    header: str


def read_case(path: Path) -> PassCase:
    text = path.read_text()
    pipeline = header_value(text, "pipeline")
    if EXPECTED_ERROR in text:
        head, _, tail = text.partition(EXPECTED_ERROR)
        expected = EXPECTED_ERROR + tail
    else:
        head, _, tail = text.partition(EXPECTED + "\n")
        expected = tail
    return PassCase(path, pipeline, model_text(head), expected, head)


def run_case(case: PassCase) -> tuple[str, ir.Model | None]:
    """The text the case produces (printed IR, or the error line), and the model."""
    model = load_onnx_text(case.model_text, case.path.name)
    try:
        model, _ = run_passes(model, parse_pipeline(case.pipeline), PassOptions(verify_each=True))
    except RequantError as exc:
        return f"{EXPECTED_ERROR} {str(exc).splitlines()[0]}\n", None
    return print_model(model), model


def _inputs(model: ir.Model, rng: np.random.Generator) -> dict[str, Any]:
    feeds: dict[str, Any] = {}
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        shape = [d if isinstance(d, int) else 2 for d in (value.shape or [])]
        dtype = value.dtype.numpy() if value.dtype is not None else np.float32
        if np.issubdtype(dtype, np.floating):
            feeds[str(value.name)] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[str(value.name)] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[str(value.name)] = rng.integers(0, 8, shape).astype(dtype)
    return feeds


def _run(model: ir.Model, feeds: dict[str, Any]) -> list[Any]:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def check_numerics(case: PassCase, after: ir.Model) -> None:
    """ONNX Runtime gives the same outputs before and after the pipeline (to float tolerance)."""
    before = load_onnx_text(case.model_text, case.path.name)
    feeds = _inputs(before, np.random.default_rng(0))
    expected, got = _run(before, feeds), _run(after, feeds)
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        assert e.shape == g.shape and e.dtype == g.dtype
        if np.issubdtype(e.dtype, np.floating):
            # folding reorders float arithmetic: a few ulps of the largest magnitude involved
            tol = 64 * np.finfo(e.dtype).eps * max(1.0, float(np.max(np.abs(e))) if e.size else 1.0)
            np.testing.assert_allclose(g, e, rtol=0, atol=tol)
        else:
            np.testing.assert_array_equal(g, e)
