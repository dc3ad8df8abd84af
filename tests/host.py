"""What this machine's ONNX Runtime computes, measured: its uint8 x int8 kernels add products in int16
pairs that can saturate on CPUs without VNNI, and exactly in int32 with it. One ``MatMulInteger``
whose pair sums leave int16 tells which (``host_kernel_model`` reads the CPU's flags instead; under
``bench/ort_without_vnni.py``'s copy of ONNX Runtime, which runs the AVX2 kernels on a VNNI CPU, the
two differ, and the tests must follow what the runtime does). Tests that run a saturating model in
ONNX Runtime assert what this runtime does, whichever it is."""

from __future__ import annotations

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
