"""A language model's memory (docs/llm.md, "Memory"): a section at a time, whatever the number of layers.

The bound itself, on a decoder larger than the memory the process may take, is bench/bench_llm_memory.py's
(minutes); here, what makes it: the rounding's memory does not grow with the layers, and freed arrays go back to
the system.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

from requant.llm.blocks import BlockFormat
from requant.llm.budget import stored_bytes
from requant.llm.decoder import open_decoder
from requant.llm.moments import LayerMoments
from requant.llm.nbits import linear_weights, to_matmul_nbits
from requant.llm.text import load_tokenizer, token_windows
from requant.stages.blocks import METHODS, scale_search
from tests.models.tiny_decoder import docs_text, make_random_decoder

HIDDEN, MLP = 256, 768


def test_freed_large_arrays_go_back_to_the_system_once_the_threshold_is_fixed() -> None:
    """glibc's rising mmap threshold keeps freed 6 MB arrays in the heap (below a small array still held); within
    requant.llm.memory.large_blocks_mapped (a section's pass) they are unmapped when freed."""
    script = textwrap.dedent("""
        import re, sys
        import numpy as np
        import contextlib
        from requant.llm.memory import large_blocks_mapped
        def data():
            return int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) >> 10
        big = np.ones(2 << 20)  # 16 MB, mapped and unmapped: glibc's threshold rises to it
        del big
        with large_blocks_mapped() if sys.argv[1] == "fixed" else contextlib.nullcontext(True) as taken:
            assert taken
            before = data()
            arrays, held = [], []
            for _ in range(20):
                arrays.append(np.ones(6 << 17))  # 6 MB each
                held.append(np.ones(1000))  # a small array after each
            del arrays
            print(data() - before)
    """)
    kept = {how: int(subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                                    check=True).stdout) for how in ("fixed", "rising")}  # fmt: skip
    assert kept["rising"] >= 100 and kept["fixed"] <= 4, kept


@pytest.fixture(scope="module")
def decoders(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return {layers: make_random_decoder(tmp_path_factory.mktemp(f"random{layers}"), layers, HIDDEN, MLP, heads=4)
            for layers in (2, 6)}  # fmt: skip


def _rounding_peak(folder: Path, kept: Path) -> int:
    """The most NumPy and Python held at once (traced) while the decoder's layers are scaled and rounded a layer
    to a section, their scaled weights and blocks kept in ``kept``."""
    decoder = open_decoder(folder)
    windows = token_windows(docs_text()[0], load_tokenizer(decoder.tokenizer), 4, "calibration")
    graph = decoder.model.graph
    layers = {name: str(node.inputs[0].name) for name, (node, _) in linear_weights(graph).items()}  # type: ignore[union-attr]
    tracemalloc.start()
    try:
        fmt = BlockFormat(4, 128, True)
        moments = LayerMoments(decoder, layers, windows, most=1, prepare=scale_search(decoder.model.graph, fmt, kept))
        to_matmul_nbits(decoder.model, fmt, moments, METHODS, folder=kept)
        moments.finish()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_rounding_holds_one_sections_memory_whatever_the_number_of_layers(
    decoders: dict[int, Path], tmp_path: Path
) -> None:
    """Six layers take no more memory than two, to less than one layer's packed blocks: the moments are one
    section's, the values carried the same, the scaled weights and rounded layers on disk (held, four more
    layers' would show)."""
    peaks = {}
    for layers, folder in decoders.items():
        (tmp_path / str(layers)).mkdir()
        peaks[layers] = _rounding_peak(folder, tmp_path / str(layers))
    one_layer = sum(stored_bytes(BlockFormat(4, 128, True), k, n)
                    for k, n in ((HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN)))  # fmt: skip
    assert peaks[6] - peaks[2] < one_layer, (peaks, one_layer)
