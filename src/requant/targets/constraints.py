"""The constraints a target's ops put on the types of their ports, as data: propagation resolves them.

Seeds 000 and 002 name three kinds; requant keeps each where it is decided:

- **same scale** (this module, per target, by op type): an op that moves or selects values (MaxPool,
  Reshape, a Concat on TOSA) reads and writes one quantized type. Calibration and the quantizers can
  leave its input and output on different ones (a Concat's inputs are calibrated apart; a user's
  config can ask for another type after a pool): there two constraints meet, and the target says what
  happens (:class:`SameScale`'s ``meet``). Propagation (:mod:`requant.propagation.propagate`) finds
  every such meeting after the types are known, in any order of the quantizers, and records it with
  its reason;
- **multiplier scale**: a bias's scale is its kernel's input scale times its weight scale, on every
  target (the op's arithmetic, :mod:`requant.ir.traits`' ``WEIGHTED``): the pattern quantizer's
  ``DerivedSpec``, resolved by propagation once the weights are encoded;
- **fixed scale**: parameters a kernel needs whatever calibration sees: a config's ``FixedSpec``,
  and a target's floor on a scale (ONNX Runtime's QLinearSoftmax: ``KernelModel.softmax_overflow``);
- **joined ranges** (this module, per target, by op type: :class:`Join`): an op that joins tensors into
  one (a Concat) writes one type for inputs calibrated apart; an input whose range spans fewer than
  ``MIN_STEPS`` of the output's steps loses what it says (a detector's head concatenating box
  coordinates in pixels with probabilities: its scores round to 0 or 1). Propagation resolves it once
  the types are known (the join kept float where the target can; reported by :mod:`requant.stages.joins`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import onnx_ir as ir

__all__ = ["MIN_STEPS", "RESCALE", "RUNTIME_FLOAT", "Join", "SameScale"]

# an input of a join must span at least this many steps of the join's output type (4 bits): fewer, and
# what it says is lost (probabilities beside pixel coordinates: less than one step)
MIN_STEPS = 16
RESCALE: Literal["rescale"] = "rescale"
RUNTIME_FLOAT: Literal["float"] = "float"


@dataclass(frozen=True)
class SameScale:
    """The op's data inputs and its output carry one quantized type.

    ``meet``: what the target does where they differ: ``"rescale"``, propagation inserts a rescale
    before the op that brings each differing input to the output's type (an ``Identity`` whose output
    has that type: the integer lowering writes it as ``tosa.rescale``); ``"float"``, nothing is written
    and the runtime computes the op in float between its conversions (recorded: it costs a
    DequantizeLinear and a QuantizeLinear, and the int8 op). ``why``: the target's reason, for the
    report. ``applies``: whether a node of the op type is bound by it (e.g. a nearest Resize only);
    every node when None.
    """

    meet: Literal["rescale", "float"]
    why: str
    applies: Callable[[ir.Node], bool] | None = None

    def binds(self, node: ir.Node) -> bool:
        return self.applies is None or self.applies(node)


@dataclass(frozen=True)
class Join:
    """The op joins its data inputs into one output type.

    ``meet``: what the target does where an input spans fewer than ``MIN_STEPS`` of the output's
    steps: ``"float"``, the join is computed in float between its inputs' conversions (each input
    keeps its own type; requant keeps the node float); ``"rescale"``, nothing better exists (an
    integer-only target): it is reported. ``why``: the target's reason, for the report.
    """

    meet: Literal["rescale", "float"]
    why: str
