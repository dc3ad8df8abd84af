"""PyTorch's own deployment path: requant as a PT2E quantizer (:class:`RequantQuantizer`), and the flow that
quantizes a module for ExecuTorch's XNNPACK delegate and writes a ``.pte`` (target ``executorch-xnnpack``).

Needs the ``executorch`` extra: ``pip install 'requant[executorch]'`` (executorch 1.5.1, torchao 0.18.0,
beside torch 2.13.0). Importing torchao 0.18.0 on a CPU-only machine logs warnings that say nothing to a
user of this path (its CUDA kernels' libraries do not load; a deprecation inside torch): they are
silenced while it is imported here, and only then.
"""

import contextlib
import logging
from collections.abc import Iterator

from requant.errors import RequantError


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


try:
    with _quiet("torchao", "torch.utils._pytree"):
        import executorch.exir  # noqa: F401
        import torchao.quantization.pt2e  # noqa: F401
except ImportError as exc:
    raise RequantError(
        "the executorch-xnnpack target and requant.pt2e need ExecuTorch and torchao: "
        f"pip install 'requant[executorch]' ({exc})"
    ) from None

from requant.pt2e.quantizer import RequantQuantizer, annotations_text  # noqa: E402

__all__ = ["RequantQuantizer", "annotations_text"]
