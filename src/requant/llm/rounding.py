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

from requant.encoding.rounding import output_error as encoding_error
from requant.llm.blocks import Blocked, BlockFormat, block_scales, dequantize, quantize_with, round_to_nearest
from requant.llm.clip import clipped_scales
from requant.llm.gptq import gptq

__all__ = ["METHODS", "output_error", "round_layer"]

Array = npt.NDArray[Any]

# nearest; GPTQ in the inputs' order; GPTQ with the inputs of the largest second moments first; and
# nearest and GPTQ in activation order at the scales of the clipping search (requant.llm.clip)
METHODS = ("nearest", "gptq", "gptq_activation_order", "clip", "clip_gptq")


def output_error(w: Array, blocked: Blocked, h: Array) -> float:
    """``trace(E^T H E)``: the squared error the stored weight adds to the layer's output, summed over the
    inputs ``H`` was gathered from."""
    return encoding_error(np.asarray(w).T, dequantize(blocked).T, h)  # its weights are [N, K]


def _db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf


# the two activation-order GPTQs in one pass for layers of at most this many outputs: their column loop is
# Python-bound there (SmolLM2's down_proj, [1536, 576]: 0.89 s -> 0.56 s); a wide layer's is memory-bound
# and twice the width is slower (its LM head, [576, 49152]: 13.1 s -> 18.2 s)
PAIR_MAX_OUTPUTS = 8192


def _activation_order_pair(w: Array, h: Array, fmt: BlockFormat, clip: tuple[Array, Array]) -> dict[str, Blocked]:
    """``gptq_activation_order`` and ``clip_gptq`` in one GPTQ pass: the weight's outputs twice side by side,
    the first copy at its ranges' scales, the second at the clipping search's (GPTQ treats each output alone,
    and both share ``H``'s order and factor)."""
    n = w.shape[1]
    plain = block_scales(w, fmt)
    given = (np.concatenate([plain[0], clip[0]]), np.concatenate([plain[1], clip[1]]))
    both = gptq(np.concatenate([w, w], axis=1), h, fmt, order="activation", given=given)
    halves = (slice(0, n), slice(n, 2 * n))
    return {method: Blocked(both.codes[part], both.scales[part], both.zero_points[part], both.k, fmt)
            for method, part in zip(("gptq_activation_order", "clip_gptq"), halves, strict=True)}  # fmt: skip


def _rounded(method: str, w: Array, h: Array, fmt: BlockFormat, clip: tuple[Array, Array] | None) -> Blocked:
    """``w`` rounded by ``method`` (``clip``: the clipping search's scales and zero points, for its methods)."""
    if method == "nearest":
        return round_to_nearest(w, fmt)
    if method == "clip":
        assert clip is not None
        return quantize_with(w, clip[0], clip[1], fmt)
    if method == "clip_gptq":
        return gptq(w, h, fmt, order="activation", given=clip)
    return gptq(w, h, fmt, order="activation" if method == "gptq_activation_order" else "natural")


def round_layer(
    w: Array, h: Array, fmt: BlockFormat, methods: tuple[str, ...] = METHODS
) -> tuple[Blocked, dict[str, Any]]:
    """``w`` in blocks of ``fmt`` by whichever of ``methods`` leaves the least output error on inputs of
    second moments ``h``; the record: the method chosen, each one's output SQNR (dB), and the chosen one's error
    (what a size budget ranks layers by, :mod:`requant.llm.budget`)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"rounding methods are {', '.join(METHODS)}; got {list(methods)}")
    wd = np.asarray(w, np.float64)
    signal = float(np.sum((np.asarray(h, np.float64) @ wd) * wd))
    best: tuple[float, str, Blocked] | None = None
    scores: dict[str, float] = {}
    clip = clipped_scales(w, h, fmt) if any(m.startswith("clip") for m in methods) else None
    pair = "gptq_activation_order" in methods and "clip_gptq" in methods and w.shape[1] <= PAIR_MAX_OUTPUTS
    ready = _activation_order_pair(w, h, fmt, clip) if pair and clip is not None else {}
    for method in methods:
        blocked = ready[method] if method in ready else _rounded(method, w, h, fmt, clip)
        error = output_error(w, blocked, h)
        scores[method] = _db(signal, error)
        if best is None or error < best[0]:
            best = (error, method, blocked)
    assert best is not None
    return best[2], {"chosen": best[1], "output_sqnr_db": scores, "output_error": best[0]}
