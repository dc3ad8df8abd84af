"""A size budget for a language model's weight blocks (``--max-size``): the layers whose 4-bit blocks leave the
most output error per byte get 8 bits, until the model would outgrow the budget.

Each layer's rounding leaves an output error ``trace(E^T H E)`` on the calibration inputs
(:mod:`requant.llm.rounding`); at 8 bits nearest rounding leaves about 1/256 of a 4-bit error, so 8 bits
removes nearly all of it, at :func:`stored_bytes` ``(8 bits) - (4 bits)`` more. The layers are taken in
decreasing order of error per extra byte and kept where they still fit (the ratio rule of a knapsack).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from requant.llm.blocks import BlockFormat

__all__ = ["Candidate", "promoted", "stored_bytes"]


def stored_bytes(fmt: BlockFormat, k: int, n: int) -> int:
    """The bytes ``MatMulNBits`` stores for a ``[k, n]`` weight in ``fmt``: codes, float32 scales and (asymmetric)
    zero points packed as the codes (:func:`~requant.llm.blocks.pack`)."""
    blocks = fmt.blocks(k)
    codes = n * blocks * fmt.block_size * fmt.bits // 8
    zero_points = 0 if fmt.symmetric else n * -(-blocks * fmt.bits // 8)
    return codes + 4 * n * blocks + zero_points


@dataclass(frozen=True)
class Candidate:
    """A layer that may get 8 bits: its name, its output error in its own format, and the bytes 8 bits add."""

    name: str
    error: float
    extra: int


def promoted(candidates: Sequence[Candidate], room: int) -> list[str]:
    """The candidates that get 8 bits within ``room`` bytes: the most error per extra byte first, each one that
    still fits."""
    chosen = []
    for candidate in sorted(candidates, key=lambda c: (-c.error / max(c.extra, 1), c.name)):
        if candidate.extra <= room:
            chosen.append(candidate.name)
            room -= candidate.extra
    return chosen
