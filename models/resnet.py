"""ResNet-18 as the d2l notes build it (d2l's ``Residual`` block, ``resnet_block`` stages), for any channels/classes."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F


class Residual(nn.Module):
    """Two 3x3 convs with batch norm and a skip; a 1x1 conv on the skip when shape or stride changes."""

    def __init__(self, in_channels: int, out_channels: int, use_1x1conv: bool = False, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def _stage(in_channels: int, out_channels: int, num_residuals: int, first: bool) -> nn.Sequential:
    blocks = [
        Residual(in_channels, out_channels, use_1x1conv=True, stride=2)
        if i == 0 and not first
        else Residual(out_channels, out_channels)
        for i in range(num_residuals)
    ]
    return nn.Sequential(*blocks)


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """ResNet-18: 7x7 stem, four stages of two residual blocks (64, 128, 256, 512), global pool, linear."""
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )
    net.add_module("resnet_block1", _stage(64, 64, 2, first=True))
    net.add_module("resnet_block2", _stage(64, 128, 2, first=False))
    net.add_module("resnet_block3", _stage(128, 256, 2, first=False))
    net.add_module("resnet_block4", _stage(256, 512, 2, first=False))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net
