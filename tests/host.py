"""What this machine's ONNX Runtime computes, measured: its uint8 x int8 kernels add products in int16
pairs that can saturate on CPUs without VNNI, and exactly in int32 with it. One ``MatMulInteger``
whose pair sums leave int16 tells which (``host_kernel_model`` reads the CPU's flags instead; under
``bench/ort_without_vnni.py``'s copy of ONNX Runtime, which runs the AVX2 kernels on a VNNI CPU, the
two differ, and the tests must follow what the runtime does). Tests that run a saturating model in
ONNX Runtime assert what this runtime does, whichever it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from bench.ort_without_vnni import MARKER
from onnx import TensorProto, helper

from requant.targets.kernels import ONNXRUNTIME_X86, ONNXRUNTIME_X86_VNNI, KernelModel

# the copy of ONNX Runtime bench/ort_without_vnni.py patches carries its marker
MASKED = (Path(ort.__file__).parent / MARKER).is_file()


def _probe() -> KernelModel:
    """255 x 127 summed over 64 products: 2,072,640 in int32, 32 saturated pairs of 32,767 in int16."""
    k = 64
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, k]),
         helper.make_tensor_value_info("b", TensorProto.INT8, [k, 1])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a, b = np.full((1, k), 255, np.uint8), np.full((k, 1), 127, np.int8)
    y = int(session.run(None, {"a": a, "b": b})[0][0, 0])
    if y == 255 * 127 * k:
        return ONNXRUNTIME_X86_VNNI
    assert y == 32767 * (k // 2), f"ONNX Runtime's MatMulInteger gave {y}: neither int32 nor int16 pairs"
    return ONNXRUNTIME_X86


HOST = _probe()
PAIRS_SATURATE = HOST is ONNXRUNTIME_X86


# In a fresh interpreter that imports nothing but ONNX Runtime: run one QGEMM, then ask Linux
# (arch_prctl ARCH_GET_XCOMP_PERM) whether the process may use AMX tile data (XFEATURE 18). MLAS's
# MlasInitAMX asks for it exactly when CPUID and XCR0 offer AMX-TILE and AMX-INT8, and takes the AMX
# QGEMM when granted; a kernel before 5.16 answers EINVAL (no AMX for anyone there). Another library of
# the process may ask too (NumPy's OpenBLAS on a Sapphire Rapids): then the answer is yes on an AMX CPU
# whoever asked, so the check can pass there without MLAS, never fail with it.
_AMX_PROBE = """
import ctypes, numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "g",
    [helper.make_tensor_value_info("a", TensorProto.UINT8, [64, 64]),
     helper.make_tensor_value_info("b", TensorProto.INT8, [64, 64])],
    [helper.make_tensor_value_info("y", TensorProto.INT32, [64, 64])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
session.run(None, {"a": np.ones((64, 64), np.uint8), "b": np.ones((64, 64), np.int8)})
mask = ctypes.c_ulong(0)
granted = ctypes.CDLL(None).syscall(ctypes.c_long(158), ctypes.c_long(0x1022), ctypes.byref(mask)) == 0 and mask.value >> 18 & 1
print(bool(granted))
"""


def mlas_took_amx() -> bool:
    """Whether this machine's ONNX Runtime runs its uint8 x int8 GEMMs on AMX tiles (a fresh process)."""
    run = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, text=True, check=True)
    return run.stdout.strip() == "True"
