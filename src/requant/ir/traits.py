"""Facts about ONNX operators, one table per kind of fact. Generic code keys on these, not on op names.

``WEIGHTED``: which input is the weight and which the bias (None if the op has none).
``MORE_WEIGHTS``: further constant weights, quantized like the first (an LSTM's recurrence weight).
``WEIGHT_CHANNEL_AXIS``: the output-channel axis of the weight, for per-channel quantization.
``NON_DATA_INPUTS``: inputs that are parameters (shapes, axes, bounds), never quantized.
``DATA_MOVEMENT``: ops that move or select values without computing new ones: their output can
share the quantization parameters of their data input(s).
``LAYOUT_ONLY``: data-movement ops each of whose output elements is one of their input elements,
unchanged (no max, no padding, no interpolation): a tree of them moves integers as well as floats.
``ELEMENTWISE_BINARY``: ops with two activation inputs.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = [
    "DATA_MOVEMENT",
    "ELEMENTWISE_BINARY",
    "LAYOUT_ONLY",
    "MORE_WEIGHTS",
    "NON_DATA_INPUTS",
    "WEIGHTED",
    "data_inputs",
    "weight_channel_axis",
    "weight_inputs",
]

WEIGHTED: dict[str, tuple[int, int | None]] = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "Gemm": (1, 2),
    "MatMul": (1, None),
    "LSTM": (1, None),  # its bias (input 3) is added in float by every kernel that runs it
}

MORE_WEIGHTS: dict[str, tuple[int, ...]] = {"LSTM": (2,)}

# LSTM: W [directions, 4 x hidden, input], R [directions, 4 x hidden, hidden]: a channel is a gate row
WEIGHT_CHANNEL_AXIS: dict[str, int] = {"Conv": 0, "ConvTranspose": 1, "MatMul": 1, "LSTM": 1}

NON_DATA_INPUTS: dict[str, tuple[int, ...]] = {
    "Clip": (1, 2),
    "Reshape": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1, 2, 3),
    "Resize": (1, 2, 3),
    "Gather": (1,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "Expand": (1,),
    "Tile": (1,),
    **dict.fromkeys(("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2"), (1,)),  # axes
    "Dropout": (1, 2),
    "LSTM": (3, 4, 5, 6, 7),  # bias, sequence lengths, initial states, peepholes: float inside the kernel
}

# data-movement ops and which inputs carry data ("all": every input)
DATA_MOVEMENT: dict[str, tuple[int, ...] | str] = {
    "Reshape": (0,),
    "Transpose": (0,),
    "Flatten": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Concat": "all",
    "Split": (0,),
    "Slice": (0,),
    "Gather": (0,),
    "MaxPool": (0,),
    "Max": "all",
    "Min": "all",
    "Pad": (0,),
    "Resize": (0,),
    "Expand": (0,),
    "Tile": (0,),
    "DepthToSpace": (0,),
    "SpaceToDepth": (0,),
}

LAYOUT_ONLY = frozenset(
    {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice"}
    | {"DepthToSpace", "SpaceToDepth"}
)

ELEMENTWISE_BINARY = frozenset({"Add", "Mul", "Sub", "Div"})


def weight_channel_axis(node: ir.Node) -> int:
    """The output-channel axis of ``node``'s weight (Gemm: 0 with ``transB``, else 1)."""
    if node.op_type == "Gemm":
        trans = node.attributes.get("transB")
        return 0 if trans is not None and trans.as_int() else 1
    return WEIGHT_CHANNEL_AXIS[node.op_type]


def weight_inputs(op_type: str) -> tuple[int, ...]:
    """The indices of an op's weight inputs (none for ops without weights)."""
    first = WEIGHTED.get(op_type)
    return () if first is None else (first[0], *MORE_WEIGHTS.get(op_type, ()))


def data_inputs(node: ir.Node) -> list[int]:
    """Indices of ``node``'s inputs that carry data (not shapes, axes or bounds)."""
    spec = DATA_MOVEMENT.get(node.op_type)
    if spec == "all":
        return [i for i, v in enumerate(node.inputs) if v is not None]
    if isinstance(spec, tuple):
        return [i for i in spec if i < len(node.inputs) and node.inputs[i] is not None]
    skip = NON_DATA_INPUTS.get(node.op_type, ())
    return [i for i, v in enumerate(node.inputs) if v is not None and i not in skip]
