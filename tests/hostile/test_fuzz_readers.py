"""Property-based fuzzing of the two readers users feed by hand: the config file and calibration data.

Whatever the bytes, the reader returns or raises a ``RequantError``: never another exception.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from requant.calibration.samples import iter_samples
from requant.config_file import read_config
from requant.errors import RequantError
from requant.frontends import load_onnx

DIGITS = Path(__file__).parent.parent.parent / "examples" / "digits"
MODEL = load_onnx(DIGITS / "digits_cnn.onnx")

KEYS = ["calib", "eval", "output", "target", "method", "preset", "strict", "bias_correction", "keep_float_below",
        "report", "images", "configs", "override", "module_params", "nonsense"]  # fmt: skip
scalars = st.one_of(
    st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["float", "INT8_PER_CHANNEL_WEIGHTS", "mse", "onnxruntime-cpu", "imagenet",
                     "#requant.spec<uint8, affine, observer = percentile{percentile = 99.0}>"]),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from([*KEYS, "op_type", "node", "config", "base", "weight", "input_activation", "activations", "weights", "preset"]), inner,
    max_size=3), max_leaves=8)  # fmt: skip


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{ " + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + " }"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
def test_any_config_is_read_or_refused_with_a_config_error(table: dict[str, object]) -> None:
    text = "".join(f"{key} = {_toml(value)}\n" for key, value in table.items())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.toml"
        path.write_text(text, encoding="utf-8")
        try:
            settings_ = read_config(path)
            settings_.quantizer()  # the configs, overrides and module parameters build a quantizer
        except RequantError:
            pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([".npz", ".npy"]))
def test_any_bytes_as_a_data_file_are_read_or_refused_with_a_calibration_error(content: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"data{suffix}"
        path.write_bytes(content)
        with contextlib.suppress(RequantError):
            list(iter_samples(MODEL, path))


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def _filled(shape: tuple[int, ...], dtype: str, fill: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # 1e300 as float16, nan as int: what users make
        return np.full(shape, fill).astype(dtype)


arrays = st.builds(
    _filled,
    st.lists(st.integers(0, 9), max_size=5).map(tuple),
    st.sampled_from(["float32", "float64", "float16", "int64", "uint8", "bool", "U3", "complex64"]),
    st.sampled_from([0.0, 1.0, -1e30, 1e300, float("nan"), float("inf")]),
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["x", "y", "labels", ""]), arrays, max_size=3), st.integers(0, 2))
def test_any_arrays_are_checked_or_refused_with_a_calibration_error(
    given_arrays: dict[str, np.ndarray], start: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.npz"
        path.write_bytes(_npz_bytes(given_arrays))
        for source in (path, given_arrays, [given_arrays][start:]):
            try:
                for sample in iter_samples(MODEL, source):
                    assert sample["x"].dtype == np.float32 and np.isfinite(sample["x"]).all()
            except RequantError:
                pass
