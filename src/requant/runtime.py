"""ONNX Runtime sessions, opened the one way every part of requant opens them (CPU provider).

One rule lives here: a process may have set up ONNX Runtime's global thread pool
(``onnxruntime.set_global_thread_pool_sizes``: a server, a benchmark), and ONNX Runtime then
refuses any session with a pool of its own ("use_per_session_threads must be false when using a
global thread pool"). requant's sessions (calibration, bias correction, lint, latency) then run on
that pool instead of failing. ONNX Runtime prints its refusal on standard output before raising;
that first attempt's print is swallowed, and once seen, sessions go to the pool directly.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

__all__ = ["cpu_session"]

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
