"""Passes over the IR: one file per pass, named like the pass (``fold_batchnorm.py`` is ``fold-batchnorm``).

Modules whose names start with ``_`` are the infrastructure: the base class,
the lazy registry and the pass manager.
"""

from requant.passes._base import NodeRewrite, Pass
from requant.passes._manager import PassOptions, PassRecord, run_passes
from requant.passes._registry import UnknownPassError, get_passes, parse_pipeline, pass_names

__all__ = [
    "NodeRewrite",
    "Pass",
    "PassOptions",
    "PassRecord",
    "UnknownPassError",
    "get_passes",
    "parse_pipeline",
    "pass_names",
    "run_passes",
]
