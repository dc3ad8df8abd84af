"""Each linear layer's rounding chosen by the error it leaves on the layer's own output.

For a weight ``W`` (``[K, N]``) stored as ``W_q``, the layer's output error over its calibration inputs is
``sum ||x (W_q - W)||^2 = trace(E^T H E)`` with ``E = W_q - W`` and ``H = sum x x^T``: no input is needed
again once ``H`` is known. Each candidate is tried and the one with the least error kept; its SQNR (the
output's energy ``trace(W^T H W)`` over that error) and every candidate's are the report's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.llm.blocks import (
    Blocked,
    BlockFormat,
    block_scales,
    dequantized_rows,
    padded_rows,
    quantize_with,
    round_to_nearest,
)
from requant.llm.clip import clipped_scales
from requant.llm.gptq import gptq

__all__ = ["METHODS", "output_error", "round_layer"]

Array = npt.NDArray[Any]

# nearest; GPTQ in the inputs' order; GPTQ with the inputs of the largest second moments first; and
# nearest and GPTQ in activation order at the scales of the clipping search (requant.llm.clip)
METHODS = ("nearest", "gptq", "gptq_activation_order", "clip", "clip_gptq")


def output_error(w: Array, blocked: Blocked, h: Array) -> float:
    """``trace(E^T H E)``: the squared error the stored weight adds to the layer's output, summed over the
    inputs ``H`` was gathered from. In float32 (the weights' own precision; summed in float64): half the time of
    float64's product, the choice's scores the same to 1e-4 dB or closer on SmolLM2."""
    return _energy(np.asarray(w, np.float32).T - dequantized_rows(blocked), np.asarray(h, np.float32))


def _energy(e: Array, h32: Array) -> float:
    """``trace(e h e^T)`` of float32 ``e`` (``[N, K]``: one row per output) and ``h32`` (``[K, K]``)."""
    return float(np.sum((e @ h32) * e, dtype=np.float64))


def _db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf


# the two activation-order GPTQs in one pass for layers of at most this many outputs: their column loop is
# Python-bound there (SmolLM2's down_proj, [1536, 576]: 0.68 s -> 0.37 s for both); a wide layer's is
# memory-bound and twice the width is slower (its LM head, [576, 49152]: 6.0 s -> 7.0 s)
PAIR_MAX_OUTPUTS = 8192


def _activation_order_pair(
    w: Array, h: Array, fmt: BlockFormat, clip: tuple[Array, Array], rows: Array | None = None
) -> dict[str, Blocked]:
    """``gptq_activation_order`` and ``clip_gptq`` in one GPTQ pass: the weight's outputs twice side by side,
    the first copy at its ranges' scales, the second at the clipping search's (GPTQ treats each output alone,
    and both share ``H``'s order and factor). ``rows``: ``w`` as :func:`~requant.llm.blocks.padded_rows` cuts it."""
    n = w.shape[1]
    rows = padded_rows(w, fmt) if rows is None else rows
    plain = block_scales(rows, fmt)
    given = (np.concatenate([plain[0], clip[0]]), np.concatenate([plain[1], clip[1]]))
    both = gptq(np.concatenate([w, w], axis=1), h, fmt, order="activation", given=given,
                rows=np.concatenate([rows, rows]))  # fmt: skip
    halves = (slice(0, n), slice(n, 2 * n))
    return {method: Blocked(both.codes[part], both.scales[part], both.zero_points[part], both.k, fmt)
            for method, part in zip(("gptq_activation_order", "clip_gptq"), halves, strict=True)}  # fmt: skip


def _rounded(method: str, w: Array, h: Array, fmt: BlockFormat, clip: tuple[Array, Array] | None,
             rows: Array) -> Blocked:  # fmt: skip
    """``w`` rounded by ``method`` (``clip``: the clipping search's scales and zero points, for its methods;
    ``rows``: ``w`` as :func:`~requant.llm.blocks.padded_rows` cuts it)."""
    if method == "nearest":
        return round_to_nearest(w, fmt, rows)
    if method == "clip":
        assert clip is not None
        return quantize_with(w, clip[0], clip[1], fmt, rows)
    if method == "clip_gptq":
        return gptq(w, h, fmt, order="activation", given=clip, rows=rows)
    return gptq(w, h, fmt, order="activation" if method == "gptq_activation_order" else "natural", rows=rows)


def round_layer(
    w: Array, h: Array, fmt: BlockFormat, methods: tuple[str, ...] = METHODS
) -> tuple[Blocked, dict[str, Any]]:
    """``w`` in blocks of ``fmt`` by whichever of ``methods`` leaves the least output error on inputs of
    second moments ``h``; the record: the method chosen, each one's output SQNR (dB), and the chosen one's error
    (what a size budget ranks layers by, :mod:`requant.llm.budget`)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"rounding methods are {', '.join(METHODS)}; got {list(methods)}")
    rows = padded_rows(w, fmt)  # the weight cut into blocks (a transpose), once for every method
    k, n = w.shape
    w32, h32 = rows.reshape(n, -1)[:, :k].astype(np.float32), np.asarray(h, np.float32)  # the errors' products
    signal = _energy(w32, h32)
    best: tuple[float, str, Blocked] | None = None
    scores: dict[str, float] = {}
    clip = clipped_scales(w, h, fmt, rows=rows) if any(m.startswith("clip") for m in methods) else None
    pair = "gptq_activation_order" in methods and "clip_gptq" in methods and n <= PAIR_MAX_OUTPUTS
    ready = _activation_order_pair(w, h, fmt, clip, rows) if pair and clip is not None else {}
    for method in methods:
        blocked = ready[method] if method in ready else _rounded(method, w, h, fmt, clip, rows)
        error = _energy(w32 - dequantized_rows(blocked), h32)
        scores[method] = _db(signal, error)
        if best is None or error < best[0]:
            best = (error, method, blocked)
    assert best is not None
    return best[2], {"chosen": best[1], "output_sqnr_db": scores, "output_error": best[0]}
