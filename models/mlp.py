"""A plain MLP on flattened images. ``hidden``/``depth`` scale it (1024 x 6 ~ 6.3M parameters, 25 MB of grads)."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(
        self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, hidden: int = 256, depth: int = 2
    ) -> None:
        super().__init__()
        if depth < 1 or hidden < 1:
            raise ValueError(f"MLP needs depth >= 1 and hidden >= 1, got depth={depth} hidden={hidden}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
