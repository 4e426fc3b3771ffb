"""SimpleCNN from the PyTorch+CUDA tutorial: three conv-ReLU-maxpool stages and one linear layer."""
from torch import nn

from cifarkit.models.registry import register


@register
def simplecnn() -> nn.Module:
    layers = []
    for c_in, c_out in ((3, 32), (32, 64), (64, 128)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128 * 4 * 4, 10))
