"""The ``requant`` command."""

from requant.cli.main import main

__all__ = ["main"]
