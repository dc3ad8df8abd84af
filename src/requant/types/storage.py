"""Storage (integer) types: ``i8``, ``u4``, ``i32``... and their ranges and numpy containers."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from requant.errors import QuantTypeError

__all__ = ["MAX_STORAGE_BITS", "StorageType", "storage_type"]

MAX_STORAGE_BITS = 32
_SPELLING = re.compile(r"(si|ui|i|u)([0-9]+)")


@dataclass(frozen=True)
class StorageType:
    """An integer storage type of 1 to 32 bits, signed (``iN``) or unsigned (``uN``)."""

    signed: bool
    width: int

    def __str__(self) -> str:
        return f"{'i' if self.signed else 'u'}{self.width}"

    @property
    def min(self) -> int:
        """Smallest storable value (MLIR's ``getDefaultMinimumForInteger``)."""
        return -(1 << (self.width - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        """Largest storable value (MLIR's ``getDefaultMaximumForInteger``)."""
        return (1 << (self.width - 1)) - 1 if self.signed else (1 << self.width) - 1

    @property
    def numpy_dtype(self) -> np.dtype[np.integer]:
        """The smallest numpy integer type that holds every stored value.

        Widths below 8 live in int8/uint8 (one value per byte, not packed).
        """
        for bits in (8, 16, 32):
            if self.width <= bits:
                return np.dtype(f"{'int' if self.signed else 'uint'}{bits}")
        raise AssertionError("width checked on construction")  # pragma: no cover


def storage_type(text: str) -> StorageType:
    """Parse a storage spelling: ``i8``, ``si8`` (signed), ``u8``, ``ui8`` (unsigned)."""
    if not isinstance(text, str):
        raise QuantTypeError(f"storage type must be a string such as 'i8' or 'u8', got {text!r}")
    match = _SPELLING.fullmatch(text)
    if match is None:
        if text[:1] in ("i", "u") or text[:2] in ("si", "ui"):
            raise QuantTypeError(f"expected storage type width in {text!r}")
        raise QuantTypeError(f"illegal storage type prefix in {text!r} (expected 'i' or 'u')")
    width = int(match.group(2))
    if width == 0 or width > MAX_STORAGE_BITS:
        raise QuantTypeError(f"illegal storage type size: {width}")
    return StorageType(signed=match.group(1) in ("i", "si"), width=width)
