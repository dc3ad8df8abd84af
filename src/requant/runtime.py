"""ONNX Runtime sessions, opened the one way every part of requant opens them (CPU provider).

One rule lives here: a process may have set up ONNX Runtime's global thread pool
(``onnxruntime.set_global_thread_pool_sizes``: a server, a benchmark), and ONNX Runtime then
refuses any session with a pool of its own ("use_per_session_threads must be false when using a
global thread pool"). requant's sessions (calibration, bias correction, lint, latency) then run on
that pool instead of failing. ONNX Runtime prints its refusal on standard output before raising;
that first attempt's print is swallowed, and once seen, sessions go to the pool directly.

Another: a model requant wrote that ONNX Runtime refuses is a :class:`SessionError`, never ONNX Runtime's
traceback. It names the stage that opened the session (:func:`in_stage`), the node ONNX Runtime names, and
each input of that node with the shape the model declares and, where they differ, the shape its graph
computes (ONNX's inference over the model without its declared inner shapes): a rewrite that gave a value
a shape or rank its graph does not compute is how requant's own models got refused.

A third: ``REQUANT_THREADS`` (an environment variable, a whole number of at least 1) caps the threads of every
session requant opens (calibration, comparisons, checks, the latency measurement). ONNX Runtime's
default, a spinning thread per physical core, suits one process on its own machine; processes sharing the cores
(a CI runner's jobs, ``pytest -n 2``, a cluster's workers on one node) each spin on all of them: the four
heaviest model tests of the suite, run two at a time on 2 cores, took 91 s with the default and 79 s with one
thread each.

A second: NumPy's BLAS computes on one thread while requant alternates it with ONNX Runtime
(:func:`one_blas_thread`). OpenBLAS's threads keep spinning after a product, on the cores ONNX
Runtime's runs need next: calibrating EfficientNet-Lite0 with the second moments of its kernels'
inputs, ONNX Runtime's runs took 6.5 s instead of 4.4 and the products 1.2 s instead of 0.3.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import os
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
import onnx
from onnx import numpy_helper

from requant.errors import RequantError

__all__ = [
    "THREADS_VARIABLE",
    "SessionError",
    "cpu_session",
    "exact_twin",
    "in_stage",
    "one_blas_thread",
    "session_threads",
]

THREADS_VARIABLE = "REQUANT_THREADS"


_P = ParamSpec("_P")
_R = TypeVar("_R")


class SessionError(RequantError):
    """ONNX Runtime refused a model requant wrote for it (a session of a stage: calibration, a check)."""


_stage: contextvars.ContextVar[str] = contextvars.ContextVar("requant_stage", default="")


def in_stage(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator: the sessions ``function`` opens belong to stage ``name`` (what a refusal names)."""

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(function)
        def staged(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            token = _stage.set(name)
            try:
                return function(*args, **kwargs)
            finally:
                _stage.reset(token)

        return staged

    return decorate


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


def cpu_session(source: Any, options: Any, stage: str = "", *, written: bool = True) -> Any:
    """An ``InferenceSession`` on the CPU provider for ``source`` (a path or serialized bytes); a refusal is a
    :class:`SessionError` naming ``stage`` (else the stage running: :func:`in_stage`), the node and its inputs.
    ``written`` False: the model is the user's as given (lint's), not one requant wrote."""
    try:
        return _opened(source, options)
    except RequantError:
        raise
    except Exception as exc:  # ONNX Runtime's own exception classes (Fail, InvalidGraph, NotImplemented, ...)
        raise SessionError(refusal(source, exc, stage or _stage.get() or "a session", written)) from None


def session_threads() -> int | None:
    """``REQUANT_THREADS``, the threads each of requant's sessions may use (None: ONNX Runtime's default)."""
    given = os.environ.get(THREADS_VARIABLE, "").strip()
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise RequantError(f"{THREADS_VARIABLE}={given!r}: expected a whole number of threads, at least 1")
    return int(given)


def _opened(source: Any, options: Any) -> Any:
    import onnxruntime as ort  # type: ignore[import-untyped]

    threads = session_threads()
    if threads is not None and not 0 < options.intra_op_num_threads <= threads:  # a cap, on every session
        options.intra_op_num_threads = threads

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
        return _opened(source, options)


def refusal(source: Any, exc: Exception, stage: str, written: bool = True) -> str:
    """What to say when ONNX Runtime refuses ``source`` (a path or bytes) with ``exc`` in ``stage``; ``written``:
    requant wrote it (else it is the user's model as given)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = re.sub(r"Load model from \S+ failed: ?", "", message)  # a temporary file, gone by now
    named = re.search(r"Node \(([^)]*)\)|node '([^']+)'|Name:'([^']+)'", message)
    where = ""
    if named:
        try:
            proto = onnx.load(source, load_external_data=False) if not isinstance(source, bytes) else (
                onnx.ModelProto.FromString(source))  # fmt: skip
            where = _node_inputs(proto, next(g for g in named.groups() if g))
        except Exception:  # the diagnosis is a courtesy: ONNX Runtime's words are said whatever happens here
            where = ""
    if not written:
        return f"{stage}: ONNX Runtime could not load the model{where}: {message}"
    return (
        f"{stage}: ONNX Runtime refused the model requant wrote for it{where}: {message}. Unless the model given "
        "does not load in ONNX Runtime either, this is requant's fault: please report it with the model"
    )


def _node_inputs(proto: onnx.ModelProto, name: str) -> str:
    """`` at OP 'name' (its inputs: x: declared [dims], the graph computes [dims]; ...)``, or ``""``."""
    node = next((n for n in proto.graph.node if n.name == name), None)
    if node is None:
        return ""
    declared = _shapes(proto.graph)
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.value_info[:]
    computed = _shapes(onnx.shape_inference.infer_shapes(bare, strict_mode=False, data_prop=True).graph)
    inputs = []
    for value in filter(None, node.input):
        said = f"{value}: {declared.get(value) or computed.get(value) or '?'}"
        if value in computed and value in declared and computed[value] != declared[value]:
            said += f", but its graph computes {computed[value]}: this value's declared shape is wrong"
        inputs.append(said)
    return f" at {node.op_type} '{name}' (its inputs: {'; '.join(inputs)})"


def _shapes(graph: onnx.GraphProto) -> dict[str, str]:
    """Each value's shape as the graph declares it (``[2, N]``; ``?`` an unknown dimension), constants' too."""
    found = {t.name: str(list(t.dims)) for t in graph.initializer}
    for node in graph.node:  # Constant nodes' values
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            found[node.output[0]] = str(list(node.attribute[0].t.dims))
    for info in (*graph.input, *graph.value_info, *graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in
                    info.type.tensor_type.shape.dim]  # fmt: skip
            found[info.name] = "[" + ", ".join(dims) + "]"
    return found


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
