"""Latency of several models, measured the only way that holds on a shared machine: interleaved.

Each model gets an ONNX Runtime session (CPU, ``threads`` intra-op threads, batch as given);
blocks of about ``block_ms`` of runs of each model alternate until ``budget_s`` seconds are
spent (at least ``min_rounds`` rounds), and each model's time per run is the median over its
blocks. Timing the float model's runs and then the int8 model's lets anything else the machine
does in between land on one side (a detector measured 0.35x and 2.83x for two near-identical
models that way; interleaved, 0.90 and 0.87).

The sessions do not spin while idle (``session.intra_op.allow_spinning = 0``): idle sessions whose
pool threads spin steal the cores from the one being timed (on the 2-core project machine, MobileNetV2
measured 23 ms interleaved with spinning pools, 4.7 ms alone). Without spinning every model pays
the same small wake-up cost; ratios match single-session measurements (0.72 against 0.71).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from requant.runtime import cpu_session

__all__ = ["interleaved_latency_ms", "interleaved_rounds", "medians", "session", "slower_share"]


def session(model: Any, threads: int = 2, spinning: bool = False, folder: str | None = None, arena: bool = True,
            fused: bool = True) -> Any:  # fmt: skip
    """An ONNX Runtime CPU session for ``model`` (a path, bytes or ``ModelProto``; ``threads`` 0: ONNX Runtime's
    default; ``folder``: where the external data of a model given as bytes is; ``arena`` False: tensors
    allocated and freed one by one, not from ONNX Runtime's arena, which keeps its largest size until the
    session closes and grows by powers of two: a decoder's sections ran at 1.7-2.0 GB with it, 1.1-1.4 without,
    as fast; ``fused`` False: ONNX Runtime's QDQ fusions off, each op in float between its conversions)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    options.enable_cpu_mem_arena = arena
    if not fused:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    source = model.SerializeToString() if hasattr(model, "SerializeToString") else model
    return cpu_session(source, options)


def interleaved_rounds(
    sessions: Sequence[Any],
    sample: Mapping[str, np.ndarray],
    budget_s: float = 2.0,
    block_ms: float = 10.0,
    min_rounds: int = 5,
    max_rounds: int = 50,
) -> list[list[float]]:
    """The milliseconds per run of each session on ``sample`` in each round of alternating blocks (one block of
    each session a round, in turn: round ``i`` of two sessions is a pair measured side by side)."""
    feeds = dict(sample)
    sizes = []
    for s in sessions:  # warm up, and size each model's block
        s.run(None, feeds)
        start = time.perf_counter()
        s.run(None, feeds)
        s.run(None, feeds)
        once = max((time.perf_counter() - start) / 2, 1e-6)
        sizes.append(max(1, int(block_ms / 1e3 / once)))
    times: list[list[float]] = [[] for _ in sessions]
    started = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - started < budget_s):
        for i, s in enumerate(sessions):
            begin = time.perf_counter()
            for _ in range(sizes[i]):
                s.run(None, feeds)
            times[i].append((time.perf_counter() - begin) / sizes[i] * 1e3)
        rounds += 1
    return times


def medians(rounds: Sequence[Sequence[float]]) -> list[float]:
    """Each session's median milliseconds over its rounds (:func:`interleaved_rounds`)."""
    return [float(np.median(t)) for t in rounds]


def interleaved_latency_ms(sessions: Sequence[Any], sample: Mapping[str, np.ndarray], **given: Any) -> list[float]:
    """The median milliseconds per run of each session on ``sample``, measured in alternating blocks."""
    return medians(interleaved_rounds(sessions, sample, **given))


def slower_share(base: Sequence[float], other: Sequence[float]) -> float:
    """The share of rounds in which ``other`` took longer than ``base`` (rounds paired as measured)."""
    pairs = list(zip(base, other, strict=True))
    return sum(b > a for a, b in pairs) / len(pairs) if pairs else 0.0
