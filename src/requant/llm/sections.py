"""A decoder run a section at a time: its decoder layers, what comes before them and what comes after, each
section an ONNX model of its own, so that one section's weights and the values at its edges are what a run
holds in memory, not the whole model.

The nodes named ``.../layers.<i>/...`` (onnxruntime-genai's builder's names, and the scopes of a
``torch.onnx.export``) are layer ``i``; the nodes before the first layer form the ``prologue`` (the
embedding, the attention mask's reformatting), those after the last the ``epilogue`` (the LM head); a node
named no layer between two layers joins the layer before it. Consecutive layers share a section
(``layers.<i>-<j>``) while their weights come to at most :data:`SECTION_BYTES`. A model whose nodes name no layer,
that holds a subgraph, or whose sections would read a later section's value, is one section (``model``).

:class:`SectionRun` runs windows through the sections in order: a section's session is opened, every window
goes through it (the values later sections read carried forward, the others dropped), and it is closed
before the next one opens.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.llm.decoder import DecoderError
from requant.report.latency import session

__all__ = ["SECTION_BYTES", "Section", "SectionRun", "section_of", "sections"]

Array = npt.NDArray[Any]
_LAYER = re.compile(r"(?:^|[/.])layers\.(\d+)[./]")
# consecutive layers share a section up to this many bytes of weights: fewer, larger runs (SmolLM2's 14 MB
# layers four to a section: its calibration runs took 21 s in 33 sections, 17 s in 10, 15 s whole)
SECTION_BYTES = 64 << 20


@dataclass(frozen=True)
class Section:
    """Some of a graph's nodes (their positions in graph order), the values they read from the graph's
    inputs or earlier sections (``inputs``) and the values later sections read from them (``carried``)."""

    name: str
    nodes: tuple[int, ...]
    inputs: tuple[str, ...]
    carried: tuple[str, ...]


def _layer(node: ir.Node) -> int | None:
    found = _LAYER.search(str(node.name or ""))
    return int(found.group(1)) if found else None


def _keys(nodes: Sequence[ir.Node]) -> list[int] | None:
    """Each node's section as a number: -1 the prologue, ``i`` layer ``i``, one past the last layer the
    epilogue; None when the nodes name no layer, a later layer's node comes before an earlier one's, or a
    node holds a subgraph (it may read values its inputs do not name)."""
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in nodes for a in n.attributes.values()):
        return None
    layers = [_layer(n) for n in nodes]
    named = [k for k in layers if k is not None]
    if not named or any(b < a for a, b in itertools.pairwise(named)):
        return None
    last = max(i for i, k in enumerate(layers) if k is not None)
    keys, current = [], -1
    for i, k in enumerate(layers):
        current = k if k is not None else (named[-1] + 1 if i > last else current)
        keys.append(current)
    return keys


def _grouped(nodes: Sequence[ir.Node], keys: list[int], most: int) -> tuple[list[int], dict[int, str]]:
    """The keys with consecutive layers merged while their weights come to at most ``most`` bytes (a layer
    larger than that alone), and each section's name."""
    weights: dict[int, dict[int, int]] = {}  # by key, each initializer's bytes once
    for key, node in zip(keys, nodes, strict=True):
        for v in node.inputs:
            if v is not None and v.is_initializer() and v.const_value is not None:
                weights.setdefault(key, {})[id(v)] = v.const_value.nbytes
    layers = {k for k in (_layer(n) for n in nodes) if k is not None}
    group: dict[int, int] = {}
    names: dict[int, str] = {}
    first, size = None, 0
    for key in sorted(set(keys)):
        if key not in layers:
            group[key], names[key], first = key, "prologue" if key < 0 else "epilogue", None
            continue
        grows = sum(weights.get(key, {}).values())
        if first is None or size + grows > most:
            first, size = key, 0
        group[key], size = first, size + grows
        names[first] = f"layers.{first}" if key == first else f"layers.{first}-{key}"
    return [group[k] for k in keys], names


def sections(graph: ir.Graph, most: int = SECTION_BYTES) -> list[Section]:
    """``graph`` cut into sections (see the module's docstring), in the order they run; consecutive layers
    share a section while their weights come to at most ``most`` bytes."""
    nodes = list(graph)
    keys = _keys(nodes)
    if keys is None:
        return [_whole(graph)]
    keys, names = _grouped(nodes, keys, most)
    where = {id(n): keys[i] for i, n in enumerate(nodes)}
    maker = {id(v): keys[i] for i, n in enumerate(nodes) for v in n.outputs}
    found = []
    for key in sorted(set(keys)):
        mine = [i for i, k in enumerate(keys) if k == key]
        inputs: dict[str, None] = {}
        carried: dict[str, None] = {}
        for i in mine:
            for v in nodes[i].inputs:
                source = maker.get(id(v)) if v is not None and not v.is_initializer() else key
                if source is not None and source > key:  # read before it is made: no order of sections runs it
                    return [_whole(graph)]
                if source != key:
                    inputs[str(v.name)] = None  # type: ignore[union-attr]
            carried.update((str(v.name), None) for v in nodes[i].outputs if any(where[id(u.node)] != key
                                                                               for u in v.uses()))  # fmt: skip
        found.append(Section(names[key], tuple(mine), tuple(inputs), tuple(carried)))
    return found


def _whole(graph: ir.Graph) -> Section:
    names = tuple(str(v.name) for v in graph.inputs)
    return Section("model", tuple(range(len(list(graph)))), names, ())


def section_of(found: Sequence[Section], graph: ir.Graph) -> dict[str, str]:
    """The section of each node, by node name."""
    nodes = list(graph)
    return {str(nodes[i].name): s.name for s in found for i in s.nodes}


def _dtype(array: Array) -> int:
    return int(onnx.helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype))


class SectionRun:
    """Windows run through a model's sections in order (see the module's docstring). ``proto``: the model
    (its weights left in their external data, found in ``folder``); ``most``: as :func:`sections`'."""

    def __init__(self, proto: onnx.ModelProto, graph: ir.Graph, folder: Path, most: int = SECTION_BYTES) -> None:
        self.proto, self.folder = proto, folder
        self.sections = sections(graph, most)
        self._initializers = {t.name: t for t in proto.graph.initializer}

    def _model(self, section: Section, example: Mapping[str, Array], outputs: Sequence[str]) -> bytes:
        """The section as a model of its own: its nodes, the initializers they read, its inputs (typed as
        ``example``'s arrays) and ``outputs``."""
        model = onnx.ModelProto()
        model.ir_version, model.producer_name = self.proto.ir_version, "requant.llm.sections"
        model.opset_import.extend(self.proto.opset_import)
        graph = model.graph
        graph.name = section.name
        nodes = [self.proto.graph.node[i] for i in section.nodes]
        graph.node.extend(nodes)
        read = {name for node in nodes for name in node.input}
        graph.initializer.extend(self._initializers[n] for n in sorted(read) if n in self._initializers)
        for name in section.inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(name, _dtype(example[name]), None))
        for name in outputs:
            graph.output.add().name = name
        serialized: bytes = model.SerializeToString()
        return serialized

    def _session(self, section: Section, example: Mapping[str, Array], outputs: Sequence[str]) -> Any:
        """The section's session (a :class:`~requant.llm.decoder.DecoderError` when ONNX Runtime refuses it)."""
        try:
            return session(self._model(section, example, outputs), threads=0, folder=str(self.folder), arena=False)
        except Exception as exc:  # ONNX Runtime raises its own kinds (Fail, InvalidGraph, NotImplemented)
            first = str(exc).strip().splitlines()[0]
            raise DecoderError(f"ONNX Runtime cannot run the model in '{self.folder}' (its section "
                               f"{section.name}): {first}") from None  # fmt: skip

    def run(
        self,
        feeds: Sequence[Mapping[str, Array]],
        wanted: Callable[[Section, int], Sequence[str]],
    ) -> Iterator[tuple[Section, int, dict[str, Array]]]:
        """For each section in order and each window (``feeds``: the graph's inputs of each), the values
        ``wanted`` names for that section and window and those it carries forward: ``(section, window, {name:
        value})`` (a section's input among them is given as it came). The values a later section reads are
        carried from one section to the next; nothing else is kept. A window whose section gives nothing wanted
        or carried is not run."""
        carried = [dict(f) for f in feeds]
        for s, section in enumerate(self.sections):
            later = {n for after in self.sections[s + 1 :] for n in after.inputs}
            forward = [n for n in section.carried if n in later]
            asks = [[*wanted(section, w), *forward] for w in range(len(carried))]
            made = list(dict.fromkeys(n for names in asks for n in names if n not in section.inputs))
            session = self._session(section, carried[0], made) if made else None
            for w, values in enumerate(carried):
                outputs = [n for n in dict.fromkeys(asks[w]) if n not in section.inputs]
                got = {n: values[n] for n in asks[w] if n in section.inputs}
                if outputs and session is not None:
                    fed = {n: values[n] for n in section.inputs}
                    got.update(zip(outputs, session.run(outputs, fed), strict=True))
                if w == len(carried) - 1:  # closed before the last window's values go out (the rounding is next)
                    session = None
                yield section, w, got
                values.update((n, got[n]) for n in forward)
                for name in [n for n in values if n not in later]:
                    del values[name]
