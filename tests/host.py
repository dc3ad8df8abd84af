"""What this machine's CPU computes: ONNX Runtime's uint8 x int8 kernels add products in int16 pairs
that can saturate without VNNI, and exactly with it (:func:`requant.targets.kernels.host_kernel_model`).
Tests that run a saturating model in ONNX Runtime assert what this CPU does, whichever it is."""

from __future__ import annotations

from requant.targets.kernels import ONNXRUNTIME_X86, host_kernel_model

PAIRS_SATURATE = host_kernel_model() is ONNXRUNTIME_X86
