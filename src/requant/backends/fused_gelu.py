"""A GELU kept float between a ``DequantizeLinear`` and its readers becomes ONNX Runtime's ``Gelu`` kernel.

A written-out erf GELU (:mod:`requant.passes.order_gelu`) that ONNX Runtime's table keeps float reads its
input from a ``DequantizeLinear``. ONNX Runtime's session gives each reader of a dequantized value its own
``DequantizeLinear`` first (``EnsureUniqueDQForNodeUnit``), so the GELU's ``Div`` and ``Mul`` then read two
values, and its ``GeluFusion`` (which needs both to read one) no longer fuses the five ops: they run as five
float kernels over the whole tensor, where the float model ran one (measured on a 1 x 8 x 32 x 32 GELU in
ONNX Runtime 1.31: fused without the ``DequantizeLinear``, five ops with it). This rewrite writes the fused
kernel itself: ``com.microsoft`` ``Gelu`` (``x * 0.5 * (1 + erf(x / sqrt 2))``, the same function), reading
the dequantized value. Only there: a GELU after a float op ONNX Runtime fuses itself, with the Add before
it when there is one (``BiasGelu``).

Run on the QDQ model, for targets that run ONNX Runtime's contrib ops (not an integer-only one, where no
GELU stays float).
"""

from __future__ import annotations

import onnx_ir as ir

from requant.backends.dynamic_lstm import MS_DOMAIN
from requant.ir.queries import is_op
from requant.passes._rewrite import replace_chain
from requant.passes.order_gelu import find

__all__ = ["write_gelus"]


def write_gelus(model: ir.Model) -> list[str]:
    """Each ordered erf GELU of the main graph whose input is a ``DequantizeLinear``'s output, as one
    ``com.microsoft`` ``Gelu``; the names of the Gelus written."""
    written = []
    for gelu in find(model.graph):
        producer = gelu.x.producer()
        if not gelu.ordered or producer is None or not is_op(producer, "DequantizeLinear"):
            continue
        nodes = [gelu.scale, gelu.erf, gelu.add, *gelu.tail]
        name = gelu.tail[1].name or gelu.erf.name or "Gelu"
        fused = ir.Node(MS_DOMAIN, "Gelu", [gelu.x], num_outputs=1, name=name)
        replace_chain(nodes, fused)
        written.append(name)
    if written:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return written
