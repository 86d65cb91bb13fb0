"""Models the launcher ships. Any ``nn.Module`` (class or factory) can be named by ``model._target_`` instead."""

from .lenet import LeNet
from .mlp import MLP
from .resnet import Residual, resnet18

__all__ = ["LeNet", "MLP", "Residual", "resnet18"]
