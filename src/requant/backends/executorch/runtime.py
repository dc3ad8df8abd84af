"""Run a ``.pte`` with ExecuTorch's runtime, or an eager PyTorch module, as ONNX Runtime's sessions run:
``run(None, feeds)`` with a dict of input name -> array, a list of arrays back. requant's comparison
and latency code (:mod:`requant.report.agreement`, :mod:`requant.report.latency`) reads them as it
reads ONNX Runtime's.

Two sharp edges of ExecuTorch 1.5.1's Python runtime, measured on MobileNetV2 (see docs/targets.md):

- ``Runtime.load_program(buffer)`` reads ``buffer`` in place and does not keep it: a program loaded from
  a temporary (``load_program(edge.to_executorch().buffer)``) read freed memory, its outputs garbage or
  its first run failing on a tensor of size 362,295,808. :class:`PteSession` keeps the bytes it loads.
- A ``.pte`` takes its input in the memory order of the example it was exported with, and reads any
  tensor given in that order whatever its strides say: exported from a channels-last-strided example
  (a NumPy transpose, ``np.stack`` of HWC crops), it read a contiguous tensor as channels-last and the
  other way round, top-1 agreement with float 0.19 either way. requant exports from contiguous
  examples and feeds contiguous tensors, always (:func:`contiguous`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ModuleSession", "PteSession", "contiguous"]


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def contiguous(array: Any) -> torch.Tensor:
    """A tensor of ``array`` with row-major strides, every one of them: what a ``.pte`` reads right.

    ``Tensor.contiguous()`` is not enough: a [1, 1, 8, 8] slice of a NumPy array with an added axis has
    strides (64, 1, 8, 1); torch calls it contiguous, ExecuTorch reads its dim order as channels-last,
    and XNNPACK then failed to run ("Propagating input shapes failed": the digits CNN, measured)."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.asarray(array))
    if tensor.stride() != _row_major(tensor.shape):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        if tensor.stride() != _row_major(tensor.shape):  # size-1 dims keep odd strides through a clone
            tensor = torch.empty(tuple(tensor.shape), dtype=tensor.dtype).copy_(tensor)
    return tensor


class PteSession:
    """A ``.pte``'s ``forward`` run by ExecuTorch's runtime; ``names``: its inputs, in order."""

    def __init__(self, pte: bytes, names: Sequence[str]) -> None:
        from executorch.runtime import Runtime

        self.pte = bytes(pte)  # kept alive: the runtime reads it in place (module docstring)
        self.program = Runtime.get().load_program(self.pte)
        self.method = self.program.load_method("forward")
        self.names = list(names)

    def run(self, _outputs: Any, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        results = self.method.execute([contiguous(feeds[n]) for n in self.names])
        return [np.asarray(r.numpy() if isinstance(r, torch.Tensor) else r) for r in results]


class ModuleSession:
    """An eager module (the float model, or the converted PT2E one) run on contiguous inputs."""

    def __init__(self, module: Any, names: Sequence[str]) -> None:
        self.module, self.names = module, list(names)

    def run(self, _outputs: Any, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.module(*[contiguous(feeds[n]) for n in self.names])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().numpy() for o in outs]
