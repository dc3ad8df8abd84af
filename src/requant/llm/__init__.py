"""Language models: weights in blocks of 4 or 8 bits (ONNX Runtime's ``MatMulNBits``), rounded against each
layer's calibration inputs (docs/llm.md).

- :mod:`requant.llm.blocks`: the block format (scales and zero points per block of inputs), round to
  nearest, and ``MatMulNBits``' packing;
- :mod:`requant.llm.gptq`: GPTQ's error feedback for block weights (natural or activation order);
- :mod:`requant.llm.rounding`: each layer's rounding chosen by its output error on its inputs.
"""
