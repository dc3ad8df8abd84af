"""The C allocator told to give the large blocks of a section's pass back to the system when they are freed.

glibc's ``malloc`` maps a block of ``M_MMAP_THRESHOLD`` bytes or more on its own and unmaps it when freed; the
threshold starts at 128 KiB and rises to the size of each such block freed (up to 32 MiB), after which blocks
below it come from the heap, whose freed space is kept for reuse. A decoder's section pass frees arrays of
every size (the windows' values, carried from one section to the next, and ONNX Runtime's tensors): with the
rising threshold (and ONNX Runtime's arena, now off: ``report.latency.session(..., arena=False)``), the 6-layer
synthetic decoder of ``bench/bench_llm_memory.py`` (hidden 1536) peaked at 2.7 GB and crept up layer by layer;
with a threshold of 4 MiB during the passes its sections' passes peak at 1.4-1.44 GB from the second layer on.
A lower threshold holds less (1 MiB: 1.16 GB) but maps every megabyte-sized tensor afresh, page by page:
SmolLM2's passes took 33-36 s instead of 29-30 at 1 MiB, 30.3 at 4 MiB. During the rounding the threshold is
32 MiB (what glibc's rises to): with 1 MiB there, SmolLM2's rounding took 41 s instead of 31.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PASS_THRESHOLD", "REST_THRESHOLD", "large_blocks_mapped", "no_room", "on_disk", "write"]

PASS_THRESHOLD = 4 << 20
REST_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _mallopt(threshold: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


@contextmanager
def large_blocks_mapped() -> Iterator[bool]:
    """Within: blocks of ``PASS_THRESHOLD`` bytes or more mapped on their own (given back when freed); after:
    ``REST_THRESHOLD`` (fixed, no longer rising). Yields whether glibc took it (False: not Linux, or a C library
    without ``mallopt``)."""
    taken = _mallopt(PASS_THRESHOLD)
    try:
        yield taken
    finally:
        if taken:
            _mallopt(REST_THRESHOLD)


def on_disk(data: npt.NDArray[Any], path: Path) -> npt.NDArray[Any]:
    """``data`` written to ``path`` (``.npy``, :func:`write`) and read back memory-mapped, read-only: its pages the
    file's, which the system drops when it needs to, not the process's memory."""
    write(path, data)
    mapped: npt.NDArray[Any] = np.load(path, mmap_mode="r")
    return mapped


def write(path: Path, data: npt.NDArray[Any]) -> None:
    """``data`` saved to the temporary file ``path`` (``.npy``); a full disk (any ``OSError``) is a
    :class:`~requant.frontends.SaveError` that says where the temporary files go (:func:`no_room`)."""
    try:
        np.save(path, data)
    except OSError as exc:
        raise no_room(exc, path.parent) from None


def no_room(exc: OSError, folder: Path) -> Exception:
    """The error for a temporary file that could not be written in ``folder``."""
    from requant.frontends import SaveError

    return SaveError(f"could not write requant's temporary files in '{folder.parent}' ({exc.strerror or exc}): "
                     "TMPDIR chooses where they go; they take about the float model's size")  # fmt: skip
