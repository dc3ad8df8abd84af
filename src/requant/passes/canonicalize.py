"""``canonicalize``: the clean-up every model gets before quantization, in this fixed order.

Constants first (so folding and batch-norm folding see initializers), then the
removals that expose patterns, then the folds (with shapes inferred, since the
MatMul patterns need ranks), then each kernel its own bias, per-consumer dequantize, names, and shapes
again last (so every value the later stages see has a name, a type and a shape).
"""

PIPELINE = [
    "constants-to-initializers",
    "remove-identity",
    "remove-dropout",
    "fold-constants",
    "infer-shapes",
    "fold-batchnorm",
    "fold-conv-affine",
    "relu-into-concat",
    "fold-pad",
    "fuse-matmul-add",
    "order-gelu",
    "unshare-biases",
    "dequantize-per-consumer",
    "unique-names",
    "infer-shapes",
]
