"""Kernel models: how a target's integer kernels really add their products, as data.

A kernel model is a list of rules: for a weighted op (``Conv``, ``Gemm``, ``MatMul``) with inputs
and weights of given storage types, which :class:`~requant.types.accumulation.Accumulation` the
runtime's kernel uses. The weight-encoding step proves against it that no pair can saturate
(:mod:`requant.encoding.weight_encoding`), ``requant lint`` checks other tools' models with it,
and the reference in :mod:`requant.types.accumulation` computes what the kernel computes.

ONNX Runtime 1.31 on x86-64 (MLAS), established by running every case against ONNX Runtime with
adversarial weights and inputs (``tests/test_kernel_model.py``) and read from MLAS's source:

- uint8 x int8, CPUs without VNNI (AVX2, and AVX-512 without VNNI): every GEMM (``QGemm``,
  ``QLinearMatMul``, ``MatMulIntegerToFloat``, ``DynamicQuantizeMatMul``, ``MatMulInteger``, and
  ``DynamicQuantizeLSTM``'s two GEMMs: its input, and its hidden state at each step, quantized to uint8
  over its whole range by the kernel, times the weights of every gate row) and
  every ``QLinearConv`` that is not depthwise (MLAS's ConvSym kernel for one group whose input
  channels are a multiple of 4 and output channels a multiple of 8, at least 16; a QGEMM over an
  NHWC im2col otherwise, one per group) multiply with ``vpmaddubsw``: reduction elements ``2j``
  and ``2j + 1`` are added in int16 with saturation. A convolution's reduction runs over the kernel
  positions (row by row) and, within each, the input channels of its group; an odd channel count
  pairs across positions.
- depthwise ``QLinearConv`` (ConvSym's depthwise kernel, or the generic one): products widened to
  int32, exact.
- uint8 x uint8 (``vpmaddwd`` on zero-extended words) and int8 x int8 (no x86 ConvSym or QGEMM
  for signed inputs without AVX-VNNI-INT8: the portable kernel): exact.
- With AVX-VNNI or AVX512-VNNI, ``vpdpbusd`` adds four products straight into int32: exact.
- With AMX-INT8 (Intel Sapphire Rapids and later; MLAS takes it where CPUID has AMX-TILE and AMX-INT8,
  XCR0 has the tile state and Linux grants the process its use): every uint8 x int8 QGEMM (``QGemm``,
  ``MatMulIntegerToFloat``, ``QLinearMatMul``, ``DynamicQuantizeLSTM``, and a ``QLinearConv`` that
  runs as an im2col GEMM) multiplies on AMX tiles, ``tdpbusd``: four products at a time into int32,
  exact, as VNNI. A ``QLinearConv`` that takes ConvSym runs AVX512-VNNI's (or AVX-VNNI's) ConvSym
  kernel, a depthwise one MLAS's depthwise kernel: exact too. So AMX computes what VNNI computes, bit
  for bit; only its speed differs (``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from requant.types.accumulation import INT16_PAIRS, INT32, Accumulation

__all__ = [
    "HOST_MODELS",
    "ONNXRUNTIME_X86",
    "ONNXRUNTIME_X86_AMX",
    "ONNXRUNTIME_X86_VNNI",
    "QLINEAR_SOFTMAX_OVERFLOW",
    "KernelModel",
    "KernelRule",
    "Reduction",
    "host_kernel_model",
    "is_depthwise",
    "softmax_length",
]


@dataclass(frozen=True)
class KernelRule:
    """One row of a kernel model: ``ops`` with ``inputs`` x ``weights`` storage (None: any),
    ``depthwise`` (None: either), run by ``kernel``, accumulate so."""

    kernel: str
    ops: frozenset[str]
    accumulation: Accumulation
    inputs: str | None = None
    weights: str | None = None
    depthwise: bool | None = None

    def matches(self, op_type: str, inputs: str, weights: str, depthwise: bool) -> bool:
        return (
            op_type in self.ops
            and self.inputs in (None, inputs)
            and self.weights in (None, weights)
            and self.depthwise in (None, depthwise)
        )


@dataclass(frozen=True)
class KernelModel:
    """The accumulation of each integer kernel of a target; the first rule that matches wins."""

    name: str
    cpus: str  # where the model holds, for the report
    rules: tuple[KernelRule, ...]
    # a fused int8 Softmax multiplies its largest exp by floor(1 / output scale) in float32: where that
    # exceeds this many times the axis length, the product overflows and the output is the zero point
    softmax_overflow: float | None = None

    @property
    def exact(self) -> bool:
        """Whether every integer kernel of the model adds its products exactly in int32."""
        return all(rule.accumulation is INT32 for rule in self.rules)

    def find(self, op_type: str, inputs: str, weights: str, depthwise: bool = False) -> KernelRule | None:
        return next((r for r in self.rules if r.matches(op_type, inputs, weights, depthwise)), None)

    def __str__(self) -> str:
        return self.name


_CONV, _LINEAR, _LSTM = frozenset({"Conv"}), frozenset({"Gemm", "MatMul"}), frozenset({"LSTM"})
# ONNX Runtime 1.31's QLinearSoftmax (contrib_ops/cpu/quantization/qlinear_softmax.cc): its exp table
# tops out at FLT_MAX / (D e**5) for D values along the axis, and each entry is multiplied by
# floor(1 / output scale) in float32: beyond D e**5 (148.41 D) the largest ones become inf, then 0
# (measured: a 4-value softmax whose calibrated top was 0.38 returned 0 for it from 0.00168 down)
QLINEAR_SOFTMAX_OVERFLOW = 148.0


def softmax_length(dims: list[int | None], axis: int | None, opset: int) -> int | None:
    """How many values a Softmax normalizes together: its axis's (opset 13 on; default -1), or, before
    opset 13, every dimension from its axis on (default 1); None where one of them is not static."""
    if not dims:
        return None
    axis = (axis if axis is not None else (-1 if opset >= 13 else 1)) % len(dims)
    along = dims[axis:] if opset < 13 else dims[axis : axis + 1]
    return math.prod(d for d in along if d is not None) if all(isinstance(d, int) for d in along) else None


# the kernels that pick no VNNI or AMX path (MLAS's own depthwise kernel; uint8 x uint8 and int8 x int8, which
# the u8s8 dispatch never takes): the same int32 sums on every x86-64 CPU class
_DEPTHWISE = KernelRule("QLinearConv depthwise (MLAS depthwise kernel)", _CONV, INT32, depthwise=True)
_SAME_SIGNS = (
    KernelRule("uint8 x uint8 (MLAS U8U8, vpmaddwd)", _CONV | _LINEAR | _LSTM, INT32, "u8", "u8"),
    KernelRule("int8 x int8 (MLAS portable kernel)", _CONV | _LINEAR, INT32, "i8", "i8"),
)

ONNXRUNTIME_X86 = KernelModel(
    "ONNX Runtime x86-64 without VNNI",
    "x86-64 CPUs with AVX2 or AVX-512 but no VNNI (AMD before Zen 4, Intel before Cascade Lake / Ice Lake)",
    (
        _DEPTHWISE,
        KernelRule("QLinearConv (MLAS ConvSym / QGEMM, vpmaddubsw)", _CONV, INT16_PAIRS, "u8", "i8"),
        KernelRule("QGemm, MatMulIntegerToFloat, QLinearMatMul (QGEMM, vpmaddubsw)", _LINEAR, INT16_PAIRS, "u8", "i8"),
        KernelRule("DynamicQuantizeLSTM (QGEMM, vpmaddubsw)", _LSTM, INT16_PAIRS, "u8", "i8"),
        *_SAME_SIGNS,
    ),
    QLINEAR_SOFTMAX_OVERFLOW,
)

ONNXRUNTIME_X86_VNNI = KernelModel(
    "ONNX Runtime x86-64 with VNNI",
    "x86-64 CPUs with AVX-VNNI, AVX512-VNNI or AMX (Intel Cascade Lake / Ice Lake / Alder Lake and later, "
    "AMD Zen 4 and later)",
    (KernelRule("uint8 x int8 (MLAS vpdpbusd)", _CONV | _LINEAR | _LSTM, INT32),),
    QLINEAR_SOFTMAX_OVERFLOW,
)

ONNXRUNTIME_X86_AMX = KernelModel(
    "ONNX Runtime x86-64 with AMX",
    "x86-64 CPUs with AMX-INT8 (Intel Sapphire Rapids and later): VNNI's exact int32 sums, the GEMMs on AMX tiles",
    (
        _DEPTHWISE,
        KernelRule("QLinearConv (MLAS ConvSym, vpdpbusd; or an im2col QGEMM on AMX tiles)", _CONV, INT32, "u8", "i8"),
        KernelRule("QGemm, MatMulIntegerToFloat, QLinearMatMul (QGEMM, AMX tdpbusd)", _LINEAR, INT32, "u8", "i8"),
        KernelRule("DynamicQuantizeLSTM (QGEMM, AMX tdpbusd)", _LSTM, INT32, "u8", "i8"),
        *_SAME_SIGNS,
    ),
    QLINEAR_SOFTMAX_OVERFLOW,
)

# what host_kernel_model can answer, by name (a report's "this_cpu")
HOST_MODELS = {m.name: m for m in (ONNXRUNTIME_X86, ONNXRUNTIME_X86_VNNI, ONNXRUNTIME_X86_AMX)}

VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # as Linux names them in /proc/cpuinfo
AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})  # both, as MLAS asks CPUID (Linux lists them once the OS allows)


def host_kernel_model(cpuinfo: str | None = None) -> KernelModel:
    """The kernel model of the CPU this runs on (``cpuinfo``: the text of ``/proc/cpuinfo``, read when
    None): with AMX when its flags name both of ``AMX_FLAGS``, with VNNI when they name one of
    ``VNNI_FLAGS``, else without (also when they cannot be read: the model that proves less). For
    measuring and testing what this CPU computes, and for the report's advice (``this_cpu``); the
    quantized model never depends on it (the same bytes on every machine)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if platform.machine().lower() not in ("x86_64", "amd64") or not path.is_file():
            return ONNXRUNTIME_X86
        cpuinfo = path.read_text(errors="replace")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    if flags >= AMX_FLAGS:
        return ONNXRUNTIME_X86_AMX
    return ONNXRUNTIME_X86_VNNI if VNNI_FLAGS & flags else ONNXRUNTIME_X86


@dataclass(frozen=True)
class Reduction:
    """A weighted op's weight as the rows of its kernel's GEMM, in the kernel's reduction order.

    ``rows(weight)`` is ``[N, K]``: one row per output channel, ``K`` the reduction of its group
    (a convolution's kernel positions, each with its group's input channels; an LSTM's weight
    ``[directions, 4 x hidden, K]`` gives a row per direction and gate); ``weight_of(rows)`` is the
    inverse.
    """

    op_type: str
    shape: tuple[int, ...]
    trans_b: bool = False
    group: int = 1

    def rows(self, weight: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if self.op_type == "Conv":
            cout = weight.shape[0]
            return np.moveaxis(weight, 1, -1).reshape(cout, -1)  # [Cout, kh, kw, Cin/g]
        if self.op_type == "LSTM":
            return weight.reshape(-1, weight.shape[-1])
        if self.op_type == "Gemm" and self.trans_b:
            return weight
        return weight.T  # MatMul and Gemm: [K, N]

    def weight_of(self, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if self.op_type == "Conv":
            cout, cin = self.shape[:2]
            return np.moveaxis(rows.reshape(cout, *self.shape[2:], cin), -1, 1)
        if self.op_type == "LSTM":
            return rows.reshape(self.shape)
        if self.op_type == "Gemm" and self.trans_b:
            return rows
        return rows.T


def is_depthwise(weight_shape: tuple[int, ...], group: int) -> bool:
    """ONNX Runtime's depthwise test: one input and one output channel per group (a channel
    multiplier above 1 runs as one small GEMM per group instead)."""
    return len(weight_shape) > 2 and weight_shape[1] == 1 and weight_shape[0] == group
