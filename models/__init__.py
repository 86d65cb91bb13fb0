"""Models the launcher ships. Any ``nn.Module`` (class or factory) can be named by ``model._target_`` instead."""

from .lenet import LeNet
from .mlp import MLP
from .resnet import Residual, resnet18
from .text_classifier import ClassifierOutput, TextClassifier

__all__ = ["ClassifierOutput", "LeNet", "MLP", "Residual", "TextClassifier", "resnet18"]
