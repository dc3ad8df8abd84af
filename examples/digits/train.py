"""Train the bundled default model: a small CNN on scikit-learn's 8x8 digits.

Writes, next to this file: ``digits_cnn.onnx`` (the float model, exported through requant's
PyTorch front door), ``calib.npz`` (the training images, for calibration) and ``eval.npz`` (the
test images and their ``labels``). Deterministic: the same files every run.

    .venv/bin/python examples/digits/train.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))


def main() -> None:
    import torch

    import requant
    from requant.frontends import save_onnx
    from tests.models.digits import digits_split, train_digits_cnn

    net, accuracy = train_digits_cnn()
    x_train, _, x_test, y_test = digits_split()
    model = requant.load(net, example_inputs=(torch.from_numpy(x_test[:4]),),
                         dynamic_shapes=({0: torch.export.Dim("batch")},))  # fmt: skip
    save_onnx(model, HERE / "digits_cnn.onnx")
    name = str(model.graph.inputs[0].name)
    np.savez_compressed(HERE / "calib.npz", **{name: x_train})
    np.savez_compressed(HERE / "eval.npz", **{name: x_test, "labels": y_test})
    print(f"test accuracy {accuracy:.4f}; wrote digits_cnn.onnx, calib.npz, eval.npz")


if __name__ == "__main__":
    main()
