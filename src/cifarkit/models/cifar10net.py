"""CIFAR10Net from the GPU-vs-CPU study: three VGG-style blocks, 815,018 parameters."""
from torch import nn

from cifarkit.models.registry import register


def _block(c_in: int, c_out: int) -> nn.Sequential:
    # Conv biases are kept although BatchNorm follows: the study's network has them, and its 815,018 count does too.
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


@register
def cifar10net() -> nn.Module:
    return nn.Sequential(
        _block(3, 32), _block(32, 64), _block(64, 128),  # 32x32 -> 16 -> 8 -> 4
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 256), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(256, 10),
    )
