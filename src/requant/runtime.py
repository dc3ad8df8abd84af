"""ONNX Runtime sessions, opened the one way every part of requant opens them (CPU provider).

One rule lives here: a process may have set up ONNX Runtime's global thread pool
(``onnxruntime.set_global_thread_pool_sizes``: a server, a benchmark), and ONNX Runtime then
refuses any session with a pool of its own ("use_per_session_threads must be false when using a
global thread pool"). requant's sessions (calibration, bias correction, lint, latency) then run on
that pool instead of failing. ONNX Runtime prints its refusal on standard output before raising;
that first attempt's print is swallowed, and once seen, sessions go to the pool directly.

A second: NumPy's BLAS computes on one thread while requant alternates it with ONNX Runtime
(:func:`one_blas_thread`). OpenBLAS's threads keep spinning after a product, on the cores ONNX
Runtime's runs need next: calibrating EfficientNet-Lite0 with the second moments of its kernels'
inputs, ONNX Runtime's runs took 6.5 s instead of 4.4 and the products 1.2 s instead of 0.3.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["cpu_session", "exact_twin", "one_blas_thread"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_blas_thread(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` with NumPy's BLAS limited to one thread while it runs (the caller's limit after)."""

    @functools.wraps(function)
    def limited(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

        with threadpool_limits(limits=1, user_api="blas"):
            return function(*args, **kwargs)

    return limited


_GLOBAL_POOL_ERROR = "use_per_session_threads must be false"
_global_pool: list[bool] = []  # set once this process is known to have ONNX Runtime's global pool


def cpu_session(source: Any, options: Any) -> Any:
    """An ``InferenceSession`` on the CPU provider for ``source`` (a path or serialized bytes)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    if _global_pool:
        options.use_per_session_threads = False
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except RuntimeError as exc:
        if _GLOBAL_POOL_ERROR not in str(exc):
            raise
        _global_pool.append(True)
        return cpu_session(source, options)


def exact_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the int8 weights of its uint8 x int8 GEMM kernels (and DynamicQuantizeLSTMs)
    stored as uint8 (+128, zero point +128): the same integers, which ONNX Runtime's exact uint8 x
    uint8 kernel then computes on any x86 CPU as a CPU with VNNI computes the original (int32 sums;
    without VNNI the uint8 x int8 kernels add pairs of products in int16, which full-range weights
    can saturate). Depthwise convs are left as they are (their kernel adds in int32 everywhere)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    constants = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def shifted(values: np.ndarray) -> np.ndarray:
        return (values.astype(np.int16) + 128).astype(np.uint8)

    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in constants or len(node.input) < 3:
            continue
        weight = numpy_helper.to_array(constants[node.input[0]])
        users = readers.get(node.output[0], [])
        depthwise = any(u.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in u.attribute) for u in users)
        if (
            weight.dtype != np.int8
            or depthwise
            or not users
            or any(u.op_type not in ("Conv", "Gemm", "MatMul") for u in users)
        ):
            continue
        zero = numpy_helper.to_array(constants[node.input[2]])
        constants[node.input[0]].CopyFrom(numpy_helper.from_array(shifted(weight), node.input[0]))
        name = f"{node.input[2]}_as_uint8_{node.output[0]}"
        model.graph.initializer.append(numpy_helper.from_array(shifted(zero), name))
        node.input[2] = name
    for node in model.graph.node:  # DynamicQuantizeLSTM: weights (1, 2) and their zero points (9, 11)
        if node.op_type == "DynamicQuantizeLSTM":
            for index in (1, 2, 9, 11):
                tensor = constants[node.input[index]]
                values = numpy_helper.to_array(tensor)
                if values.dtype == np.int8:
                    tensor.CopyFrom(numpy_helper.from_array(shifted(values), tensor.name))
    return model
