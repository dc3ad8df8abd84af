"""One exception hierarchy for everything requant raises on purpose.

Every error a user can trigger with bad input is a :class:`RequantError`; the
CLI turns it into a message and a non-zero exit. Subclasses name the stage.
"""

from __future__ import annotations

__all__ = ["ArgumentError", "QuantTypeError", "RequantError"]


class RequantError(Exception):
    """Root of requant's errors: bad input, unsupported request, failed check. ``detail``: the full text of what
    caused it where the message summarizes it in a line (torch's export report), which ``requant --verbose``
    prints."""

    detail: str = ""


class QuantTypeError(RequantError, ValueError):
    """A quantized type, its text, or a value checked against it is invalid."""


class ArgumentError(RequantError, TypeError):
    """An API function was given an argument of the wrong kind; the message says what it accepts."""
