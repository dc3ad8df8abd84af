"""A decoder run in ONNX Runtime: the second moments of its linear layers' inputs (calibration), its
perplexity on windows of text, and the latency of a prefill and of one decoding step.

Every window is one prefill (an empty past). Perplexity is ``exp`` of the mean negative log-likelihood
of each window's tokens after its first, given the tokens before them in the window.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from requant.llm.decoder import Decoder, DecoderError
from requant.report.latency import interleaved_latency_ms, session

__all__ = ["input_moments", "latency_ms", "perplexity", "probe_session", "session"]

Array = npt.NDArray[Any]
PREFILL = 128  # tokens of the prefill whose latency is measured; the decoding step follows it


def probe_session(decoder: Decoder, outputs: Sequence[str]) -> Any:
    """A session of the float model that also returns the values ``outputs`` (its weights read from
    the model's own external data, in its folder)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    from requant.runtime import cpu_session

    proto = ir.to_proto(decoder.model)
    known = {o.name for o in proto.graph.output}
    for name in outputs:
        if name not in known:
            proto.graph.output.add().name = name
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle while NumPy sums its outputs
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(decoder.path.parent))
    try:
        return cpu_session(proto.SerializeToString(), options)
    except Exception as exc:  # ONNX Runtime raises its own kinds (Fail, InvalidGraph, NotImplemented)
        first = str(exc).strip().splitlines()[0]
        raise DecoderError(f"ONNX Runtime cannot run '{decoder.path}': {first}") from None


def input_moments(
    decoder: Decoder, values: Sequence[str], windows: Sequence[Array], progress: Callable[[int, float], None]
) -> dict[str, Array]:
    """``sum x x^T`` (float64, ``[K, K]``) of each value in ``values`` over every token of ``windows``."""
    probe = probe_session(decoder, values)
    totals: dict[str, Array] = {}
    started = time.perf_counter()
    for i, ids in enumerate(windows):
        outputs = probe.run(list(values), decoder.feeds(ids))
        with threadpool_limits(limits=os.cpu_count(), user_api="blas"):  # the session is idle (no spinning)
            for name, x in zip(values, outputs, strict=True):
                rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
                product = (rows.T @ rows).astype(np.float64)
                totals[name] = totals[name] + product if name in totals else product
        progress(i + 1, time.perf_counter() - started)
    return totals


def _window_nll(logits: Array, ids: Array) -> float:
    """The summed negative log-likelihood of ``ids[1:]`` under ``logits[:-1]`` (one window)."""
    z = np.asarray(logits[0, :-1], np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    return float(np.sum(log_norm - z[np.arange(z.shape[0]), ids[0, 1:]]))


def perplexity(decoder: Decoder, run: Any, windows: Sequence[Array]) -> float:
    """The perplexity on ``windows`` of the model ``run`` runs (a session, fed as ``decoder``'s: :func:`session`)."""
    total, count = 0.0, 0
    for ids in windows:
        (logits,) = run.run(["logits"], decoder.feeds(ids))
        total += _window_nll(logits, ids)
        count += ids.shape[1] - 1
    return math.exp(total / count) if count and math.isfinite(total) else math.inf


def latency_ms(decoder: Decoder, runs: Sequence[Any], prompt: Array) -> dict[str, list[float]]:
    """Each session's milliseconds for a prefill of ``prompt`` (``[1, PREFILL]`` tokens or fewer) and for one
    decoding step after it, measured interleaved (:mod:`requant.report.latency`; sessions made by
    :func:`session`: two threads, not spinning)."""
    prefill = decoder.feeds(prompt)
    names = [o.name for o in runs[0].get_outputs()]
    first = dict(zip(names, runs[0].run(None, prefill), strict=True))
    step = decoder.feeds(prompt[:, -1:], decoder.presents(first))
    return {"prefill": interleaved_latency_ms(runs, prefill), "decode": interleaved_latency_ms(runs, step)}
