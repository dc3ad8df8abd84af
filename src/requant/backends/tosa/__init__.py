"""Integer-only TOSA from a quantized (QDQ) model: the ``tosa-int8`` target's backend.

The QDQ model requant writes for ONNX Runtime already holds every decision: each activation's
``QuantizeLinear`` (scale, zero point), each kernel's int8 weights (per output channel, zero point
0) and int32 bias. Lowering reads those and writes a TOSA 1.0 program (the int profile) in which
nothing is float:

- the function takes the model's inputs quantized (int8) and returns its outputs quantized; the
  host quantizes and dequantizes with the parameters of :class:`Edge` (the MLIR file's header);
- a ``Conv`` becomes ``tosa.conv2d`` / ``tosa.depthwise_conv2d`` (NHWC; transposes where the
  layout changes), a ``ConvTranspose`` ``tosa.transpose_conv2d``, a ``Gemm`` ``tosa.matmul`` plus
  an int32 ``tosa.add`` of its bias, a ``MatMul`` ``tosa.matmul`` (a constant weight, or two
  activations batch by batch); each kernel's int32 accumulator goes to the next int8 tensor
  through ``tosa.rescale`` with a fixed-point multiplier and shift per output channel (``input
  scale x weight scale / output scale``), and a Relu or Clip after it becomes a ``tosa.clamp`` on
  the int8 result;
- ``MaxPool``, ``Reshape`` / ``Flatten``, ``Transpose``, ``Relu`` and ``Clip`` between conversions of one scale run
  on the int8 values; an elementwise ``Add`` of two int8 tensors rescales both to int32 on a common
  scale, adds, and rescales to its output.

uint8 activations (ONNX Runtime's presets) become int8 exactly: ``q - 128`` with zero point
``zp - 128``. Shapes are static (the batch is fixed to 1).

The package, by what each module owns:

- :mod:`~requant.backends.tosa.program`: the program (ops, edges) and TOSA's fixed-point scales;
- :mod:`~requant.backends.tosa.lower`: the driver (:func:`lower_to_tosa`) and the table of lowerings by op;
- :mod:`~requant.backends.tosa.lowering`: what every lowering shares (constants, rescales, layouts);
- one module per op family: ``kernels``, ``movement``, ``pooling``, ``elementwise``, ``normalization``;
- :mod:`~requant.backends.tosa.mlir` writes the program as MLIR text, :mod:`~requant.backends.tosa.interpreter`
  computes it in NumPy, bit for bit as TOSA defines it, and :mod:`~requant.backends.tosa.tools` checks
  it with ``mlir-opt`` and runs it in IREE.
"""

from requant.backends.tosa.lower import LOWERINGS, lower_to_tosa
from requant.backends.tosa.program import ROUNDING, Edge, TosaError, TosaOp, TosaProgram, multiplier_shift

__all__ = ["LOWERINGS", "ROUNDING", "Edge", "TosaError", "TosaOp", "TosaProgram", "lower_to_tosa", "multiplier_shift"]
