"""ResNet-18 for 32x32 inputs, as in the cuDNN-tuned write-up.

The ImageNet stem (7x7 stride 2 + max-pool) would shrink a 32x32 image to 8x8 before the first block; three 3x3
stride-1 convolutions keep the full resolution instead, which is what makes ResNet-18 reach ~95% on CIFAR-10.
"""
from torch import nn

from cifarkit.models.layers import Conv3x3
from cifarkit.models.registry import register


def _conv_bn(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    conv = Conv3x3(c_in, c_out) if stride == 1 else nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
    return [conv, nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(c_in, c_out, stride), nn.ReLU(inplace=True), *_conv_bn(c_out, c_out))
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks_per_stage=(2, 2, 2, 2), widths=(64, 128, 256, 512), num_classes: int = 10):
        super().__init__()
        stem_width = widths[0]
        self.stem = nn.Sequential(
            *_conv_bn(3, stem_width), nn.ReLU(inplace=True),
            *_conv_bn(stem_width, stem_width), nn.ReLU(inplace=True),
            *_conv_bn(stem_width, stem_width), nn.ReLU(inplace=True),
        )
        stages, c_in = [], stem_width
        for i, (count, width) in enumerate(zip(blocks_per_stage, widths)):
            for j in range(count):
                stages.append(BasicBlock(c_in, width, stride=2 if i > 0 and j == 0 else 1))
                c_in = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


@register
def resnet18() -> nn.Module:
    return ResNet((2, 2, 2, 2))
