"""LeNet as the d2l notes write it by hand, as a module: conv 20@3x3 -> ReLU -> avgpool 2 -> conv 50@5x5 -> ReLU ->
avgpool 2 -> fc 128 -> ReLU -> fc classes. The flattened size follows ``image_size`` (800 for 28x28 inputs)."""

from __future__ import annotations

from torch import Tensor, nn


class LeNet(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = ((image_size - 2) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"LeNet needs image_size >= 12, got {image_size}; HINT: set data.image_size=28")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=3),
            nn.ReLU(),
            nn.AvgPool2d(2, 2),
            nn.Conv2d(20, 50, kernel_size=5),
            nn.ReLU(),
            nn.AvgPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
