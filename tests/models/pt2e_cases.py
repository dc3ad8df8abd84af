"""Small PyTorch modules whose PT2E annotations the golden tests print (tests/golden/pt2e/)."""

from __future__ import annotations

from typing import Any


def make_residual_net() -> Any:
    """Conv+ReLU, a 1x1 conv summed with its input, max pool, a mul by a number, a cat, a pooled
    linear head: each role of the XNNPACK table once."""
    import torch
    from torch import nn

    class ResidualNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.conv2 = nn.Conv2d(8, 8, 1)
            self.fc = nn.Linear(16, 4)

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.conv(x))
            z = nn.functional.max_pool2d(self.conv2(y) + y, 2)
            z = torch.cat([z, z * 2.0], 1)
            return self.fc(nn.functional.adaptive_avg_pool2d(z, 1).flatten(1))

    torch.manual_seed(0)
    return ResidualNet().eval()
