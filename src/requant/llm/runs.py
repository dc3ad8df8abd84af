"""A decoder run in ONNX Runtime: its perplexity on windows of text (whole, or a section at a time), and the
latency of a prefill and of one decoding step.

Every window is one prefill (an empty past). Perplexity is ``exp`` of the mean negative log-likelihood
of each window's tokens after its first, given the tokens before them in the window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.llm.decoder import Decoder
from requant.llm.sections import SectionRun
from requant.report.latency import interleaved_latency_ms, session

__all__ = ["latency_ms", "nll_perplexity", "perplexity", "sectioned_perplexity", "session", "window_nll"]

Array = npt.NDArray[Any]
PREFILL = 128  # tokens of the prefill whose latency is measured; the decoding step follows it


def window_nll(logits: Array, ids: Array) -> float:
    """The summed negative log-likelihood of ``ids[1:]`` under ``logits[:-1]`` (one window)."""
    z = np.asarray(logits[0, :-1], np.float64)  # a copy: worked on in place (a window's logits are large)
    z -= z.max(axis=-1, keepdims=True)
    picked = z[np.arange(z.shape[0]), ids[0, 1:]]
    log_norm = np.log(np.exp(z, out=z).sum(axis=-1))
    return float(np.sum(log_norm - picked))


def nll_perplexity(total: float, windows: Sequence[Array]) -> float:
    """``exp`` of ``total`` (the summed negative log-likelihood of ``windows``) over the tokens it covers."""
    count = sum(ids.shape[1] - 1 for ids in windows)
    return math.exp(total / count) if count and math.isfinite(total) else math.inf


def perplexity(decoder: Decoder, run: Any, windows: Sequence[Array]) -> float:
    """The perplexity on ``windows`` of the model ``run`` runs whole (a session, fed as ``decoder``'s:
    :func:`session`)."""
    total = 0.0
    for ids in windows:
        (logits,) = run.run(["logits"], decoder.feeds(ids))
        total += window_nll(logits, ids)
    return nll_perplexity(total, windows)


def sectioned_perplexity(decoder: Decoder, model: ir.Model, folder: Path, windows: Sequence[Array]) -> float:
    """The perplexity on ``windows`` of ``model`` (fed as ``decoder``; its weights' external data in ``folder``),
    run a section at a time (:mod:`requant.llm.sections`: one section's weights in memory at once). The same
    logits as a session of the whole model (SmolLM2 and the tests' tiny decoder: bit for bit)."""
    run = SectionRun(ir.to_proto(model), model.graph, folder)
    last = run.sections[-1].name
    total = 0.0
    for _, w, got in run.run([decoder.feeds(ids) for ids in windows],
                                   lambda s, _w: ["logits"] if s.name == last else []):  # fmt: skip
        if "logits" in got:
            total += window_nll(got["logits"], windows[w])
    return nll_perplexity(total, windows)


def latency_ms(decoder: Decoder, runs: Sequence[Any], prompt: Array) -> dict[str, list[float]]:
    """Each session's milliseconds for a prefill of ``prompt`` (``[1, PREFILL]`` tokens or fewer) and for one
    decoding step after it, measured interleaved (:mod:`requant.report.latency`; sessions made by
    :func:`session`: two threads, not spinning)."""
    prefill = decoder.feeds(prompt)
    names = [o.name for o in runs[0].get_outputs()]
    first = dict(zip(names, runs[0].run(None, prefill), strict=True))
    step = decoder.feeds(prompt[:, -1:], decoder.presents(first))
    return {"prefill": interleaved_latency_ms(runs, prefill), "decode": interleaved_latency_ms(runs, step)}
