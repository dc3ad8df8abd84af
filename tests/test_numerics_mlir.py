"""qcast(..., rounding="toward_zero") against MLIR's own lowering of quant.qcast, run by MLIR's JIT.

MLIR 22's ``lower-quant-ops`` computes ``fptosi(x / scale + zero_point)`` in the expressed type
(f16 stays f16) and clamps, after the conversion, only to narrowed storage bounds; for
full-range storage the conversion of an out-of-range value is undefined, so the values here
stay where it is defined. requant additionally saturates everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from requant.types import UniformQuantizedType, qcast, scast
from tests.mlir_oracle import MlirOracle

pytestmark = pytest.mark.mlir

CASES = [
    UniformQuantizedType("i8", "f32", 0.5, 3),
    UniformQuantizedType("i8", "f32", float(np.float32(0.0371)), -7),
    UniformQuantizedType("u8", "f32", float(np.float32(2 / 255)), 128),
    UniformQuantizedType("i8", "f32", 0.25, 0, storage_min=-100, storage_max=100),
    UniformQuantizedType("i16", "f32", float(np.float32(1e-3)), 1000),
    UniformQuantizedType("i32", "f32", float(np.float32(1e-4)), 123456),
    UniformQuantizedType("i8", "f16", float(np.float16(0.1)), 5),
    UniformQuantizedType("u8", "f16", 0.5, 200),
]


def _values(t: UniformQuantizedType, rng: np.random.Generator) -> np.ndarray:
    # where the converted value fits the storage integer (MLIR's fptosi is defined there)
    bits = t.storage_type
    lo = (bits.min - t.zero_point + 1) * t.scale
    hi = (bits.max - t.zero_point - 1) * t.scale
    k = np.arange(-20, 20)
    special = np.concatenate([(k + 0.5) * t.scale, (k + 0.5 - t.zero_point) * t.scale, [-0.4 * t.scale, 0.0, -0.0]])
    x = np.concatenate([rng.uniform(lo, hi, 300), special])
    if t.has_storage_bounds:
        x = np.concatenate([x, [lo, hi]])  # MLIR clamps to narrowed bounds: test that too
    dtype = np.float16 if t.expressed == "f16" else np.float32
    x = x.astype(dtype)
    return x[(x.astype(np.float64) >= lo) & (x.astype(np.float64) <= hi)]


@pytest.mark.parametrize("t", CASES, ids=str)
def test_toward_zero_is_mlir_lowering(mlir: MlirOracle, t: UniformQuantizedType) -> None:
    x = _values(t, np.random.default_rng(0))
    theirs = mlir.qcast(str(t), t.expressed, max(8, t.storage_width), [float(v) for v in x])
    ours = qcast(x, t, "toward_zero")
    assert scast(ours, f"i{t.storage_width}").tolist() == theirs
