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


def make_cancelling_heads() -> Any:
    """Class scores, and a second output that is the sum of two 1x1 convs whose weights nearly cancel
    (``b = -a + 0.002 noise``): each conv's int8 output carries noise larger than their sum."""
    import torch
    from torch import nn

    class CancellingHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.a, self.b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)
            self.fc = nn.Linear(8, 5)
            with torch.no_grad():
                self.b.weight.copy_(-self.a.weight + 0.002 * torch.randn_like(self.a.weight))
                self.b.bias.copy_(-self.a.bias)

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.conv(x))
            return self.fc(nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)), self.a(y) + self.b(y)

    torch.manual_seed(0)
    return CancellingHeads().eval()


def make_two_input_net() -> Any:
    """``x`` through two convs, ``u`` through one, summed, pooled, a linear head: an op reading the
    second input comes after ops reading the first."""
    import torch
    from torch import nn

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.a2, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 5)

        def forward(self, x: Any, u: Any) -> Any:
            z = self.a2(torch.relu(self.a(x))) + torch.relu(self.b(u))
            return self.fc(nn.functional.adaptive_avg_pool2d(z, 1).flatten(1))

    torch.manual_seed(0)
    return TwoInputs().eval()


def make_depthwise_block(pad: bool = False) -> Any:
    """A MobileNet block: conv -> batch norm -> ReLU6 -> [zero padding, as EfficientNet-Lite's "same"] ->
    depthwise conv -> pointwise conv, with a few of the first conv's channels 20x the others."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expand, self.bn = nn.Conv2d(3, 16, 1), nn.BatchNorm2d(16)
            self.depthwise = nn.Conv2d(16, 16, 3, groups=16, padding=0 if pad else 1)
            self.project = nn.Conv2d(16, 8, 1)
            with torch.no_grad():
                self.expand.weight[:4] *= 20.0
                self.bn.running_mean.uniform_(-0.1, 0.1)
                self.bn.running_var.uniform_(0.8, 1.2)

        def forward(self, x: Any) -> Any:
            y = nn.functional.relu6(self.bn(self.expand(x)))
            y = nn.functional.pad(y, [0, 1, 0, 1]) if pad else y
            return self.project(self.depthwise(y))

    torch.manual_seed(0)
    return Block().eval()


def make_post_norm_block() -> Any:
    """A post-LN transformer block in small: a LayerNorm whose output (three channels 20x the others) feeds two
    linear layers and the residual sum, a gated product, a linear head: what smoothing meets in a BERT."""
    import torch
    from torch import nn

    class PostNormBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
            self.q, self.k, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
            with torch.no_grad():
                self.norm.weight[:3] = 20.0

        def forward(self, x: Any) -> Any:
            h = self.norm(self.inp(x))
            return self.out(self.q(h) * torch.sigmoid(self.k(h)) + h)

    torch.manual_seed(0)
    return PostNormBlock().eval()
