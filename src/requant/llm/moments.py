"""Each linear layer's input moments ``sum x x^T``, gathered one section of the decoder at a time
(:mod:`requant.llm.sections`) as the rounding asks for its layers, in graph order.

The calibration windows run through a section's session and each of its linear layers' inputs is summed
into ``sum x x^T`` (float64 ``[K, K]``; layers reading one value share it); the values the next sections read
are carried forward and the section's session is closed. Only the section being rounded has its moments in
memory: asking for a later section's layer moves on (the moments before are dropped, or saved to ``keep``);
asking again for an earlier one reads it back from ``keep`` (a size budget's second rounding), or is an error.

Windows held out of the calibration (``held``) travel with the others without being counted; their float
logits' negative log-likelihood is summed on the way (:attr:`LayerMoments.held_nll`): the float side of the
held-out check, without a run of the whole model.

The bound: one section's weights (as ONNX Runtime holds them) and its layers' moments, the values carried
between sections for every window (the hidden state: windows x tokens x hidden x 4 bytes, and what the
layers share, such as the attention mask's), and the quantized weights made so far.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from requant.errors import RequantError
from requant.llm.decoder import Decoder
from requant.llm.memory import large_blocks_mapped, write
from requant.llm.runs import window_nll
from requant.llm.sections import SECTION_BYTES, Section, SectionRun, section_of

__all__ = ["LayerMoments"]

Array = npt.NDArray[Any]
BATCH = 4  # windows whose values are held before their products are taken


class LayerMoments(Mapping[str, Array]):
    """The input moments of ``layers`` (node name -> the value it reads), by node name; see the module's
    docstring. ``progress(sections done, seconds)`` after each section (settable once :attr:`sections` is
    known); ``most``: the sections' weights (:func:`~requant.llm.sections.sections`); ``prepare(moments)``: given
    each section's moments by node name before any is asked for (it may change them in place:
    :mod:`requant.llm.awq`)."""

    def __init__(self, decoder: Decoder, layers: Mapping[str, str], windows: Sequence[Array],
                 held: Sequence[Array] = (), keep: Path | None = None,
                 progress: Callable[[int, float], None] | None = None, most: int = SECTION_BYTES,
                 prepare: Callable[[Mapping[str, Array]], None] | None = None) -> None:  # fmt: skip
        self._layers, self._keep, self.progress, self.prepare = dict(layers), keep, progress, prepare
        self._counted, self._held = len(windows), list(held)
        run = SectionRun(ir.to_proto(decoder.model), decoder.model.graph, decoder.path.parent, most)
        self.sections = run.sections
        where = section_of(run.sections, decoder.model.graph)
        self._section = {name: where[name] for name in self._layers}
        self._names = {s.name: [n for n in self._layers if self._section[n] == s.name] for s in run.sections}
        self._order = [s.name for s in run.sections]
        feeds = [decoder.feeds(ids) for ids in [*windows, *held]]
        self._steps: Iterator[tuple[Section, int, dict[str, Array]]] = run.run(feeds, self._wanted)
        self._done: list[str] = []  # the sections run through, in order
        self._current: dict[str, Array] = {}  # the last one's moments by node name
        self.held_nll, self.seconds = 0.0, 0.0

    def _wanted(self, section: Section, window: int) -> list[str]:
        """A calibration window: the section's layers' inputs; a held-out one: the last section's logits."""
        if window >= self._counted:
            return ["logits"] if section.name == self._order[-1] else []
        return sorted({self._layers[n] for n in self._names[section.name]})

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __getitem__(self, name: str) -> Array:
        section = self._section[name]  # KeyError: not a layer of this model
        if section in self._done and section != self._done[-1]:
            return self._read_back(name, section)
        while section not in self._done:
            self._next_section()
        return self._current[name]

    def finish(self) -> None:
        """Run the sections no layer asked for (the held-out windows' logits come from the last one)."""
        while len(self._done) < len(self._order):
            self._next_section()

    def _read_back(self, name: str, section: str) -> Array:
        if self._keep is None:
            raise RequantError(f"the moments of {name} (section {section}) were dropped when the next section "
                               "ran: nothing kept them")  # fmt: skip
        loaded: Array = np.load(self._kept(name), mmap_mode="r")
        return loaded

    def _kept(self, name: str) -> Path:
        assert self._keep is not None
        return self._keep / f"{list(self._layers).index(name)}.npy"

    def _next_section(self) -> None:
        started = time.perf_counter()
        if self._done and self._keep is not None:  # the section before, for a second reading
            for name in self._names[self._done[-1]]:
                write(self._kept(name), self._current[name])
        with large_blocks_mapped():  # the pass's freed arrays given back to the system (requant.llm.memory)
            section, totals = self._pass()
        self._done.append(section.name)
        self._current = {n: totals[self._layers[n]] for n in self._names[section.name]}
        self.seconds += time.perf_counter() - started
        if self.prepare is not None:  # (its time is the rounding's)
            self.prepare(self._current)
        if self.progress is not None:
            self.progress(len(self._done), self.seconds)

    def _pass(self) -> tuple[Section, dict[str, Array]]:
        """The next section's pass over the windows: it, and the sums by value read."""
        totals: dict[str, Array] = {}
        products: dict[int, Array] = {}  # a float32 product per size, reused (fresh ones: 6 s of page faults)
        pending: list[tuple[int, dict[str, Array]]] = []  # BATCH windows' values, then their products (ONNX
        last = self._counted + len(self._held) - 1  # Runtime's threads and BLAS's taking turns at every window:
        while True:  # SmolLM2's runs took 24 s instead of 20)
            section, w, got = next(self._steps)
            pending.append((w, {n: got[n] for n in self._wanted(section, w)}))
            if len(pending) == BATCH or w == last:
                with threadpool_limits(limits=os.cpu_count(), user_api="blas"):  # the session idles meanwhile
                    for window, values in pending:
                        self._count(totals, values, window, products)
                pending = []
            if w == last:
                return section, totals

    def _count(self, totals: dict[str, Array], got: dict[str, Array], w: int, products: dict[int, Array]) -> None:
        if w >= self._counted:  # a held-out window: its logits only
            if "logits" in got:
                self.held_nll += window_nll(got["logits"], self._held[w - self._counted])
            return
        for name, x in got.items():
            rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
            k = rows.shape[1]
            if k not in products:
                products[k] = np.empty((k, k), np.float32)
            product = np.matmul(rows.T, rows, out=products[k])  # summed into float64 (converted on the way)
            if name in totals:
                np.add(totals[name], product, out=totals[name])
            else:
                totals[name] = product.astype(np.float64)
