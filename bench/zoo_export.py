"""Export the zoo's Ultralytics checkpoints (``.pt``) to ONNX, in a venv of their own (``make zoo`` makes it).

Ultralytics imports torchvision, and the registry's torchvision 0.28 wheel is a CUDA build: its ``_C.so``
needs ``libtorch_cuda.so``, absent beside the CPU torch 2.13, so ``import torchvision`` fails registering its
ops' meta kernels ("operator torchvision::nms does not exist"). Nothing an ONNX export runs needs those ops
(no NMS in the graph), so this script puts an empty module where ``torchvision._meta_registrations`` would
load; the rest of torchvision (transforms) imports. That is why requant's own venv never gets ultralytics.

    build/zoo-venv/bin/python bench/zoo_export.py OUT_DIR PACKAGE_FILE...   # each file: package/path/to.pt
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def main() -> None:
    from ultralytics import YOLO  # after the module above

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2:]:
        name, checkpoint = spec.split("=", 1)
        target = out / f"{name}.onnx"
        if target.exists():
            continue
        model = YOLO(checkpoint)
        size = (model.ckpt.get("train_args", {}) if isinstance(model.ckpt, dict) else {}).get("imgsz", 640)
        exported = model.export(format="onnx", imgsz=size, verbose=False)  # Ultralytics' defaults: opset, onnxslim
        shutil.copy(exported, target)
        print(f"{name}: {model.task}, {len(model.names)} classes, {size}x{size} -> {target}", flush=True)


if __name__ == "__main__":
    main()
