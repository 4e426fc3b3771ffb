"""FastNet: a small, wide, residual-free network for fast CIFAR-10 training, after the airbench speedruns.

Ideas from Jordan (2024), "94% on CIFAR-10 in 3.29 seconds on a single GPU" (arXiv 2404.00498), and Page's
"How to train your ResNet"; the code is our own:
- a frozen 2x2 first convolution initialized to whiten image patches (eigenvectors of their covariance), so the
  first layer starts decorrelated instead of learning to be;
- three conv groups (conv, max-pool, BN, GELU, conv, BN, GELU) and no residuals: short and wide suits a short run,
  with the convolutions initialized as partial identities;
- BatchNorm scales frozen at 1 (only the shifts learn), and logits scaled down so early softmax is not saturated.
"""
from __future__ import annotations

import torch
from torch import nn

from cifarkit.models.layers import Conv3x3
from cifarkit.models.pooling import MaxPool2x2
from cifarkit.models.registry import register

WHITEN_PATCH = 2
WHITEN_EPS = 5e-4  # added to eigenvalues before the inverse square root; keeps near-zero directions finite
LOGIT_SCALE = 1 / 9  # the head's output is divided so initial logits are small (airbench's value)


def _norm(channels: int) -> nn.BatchNorm2d:
    # Momentum 0.4 forgets old statistics fast, which a run of a few epochs needs; the scale stays fixed at 1.
    norm = nn.BatchNorm2d(channels, momentum=0.4, eps=1e-12)
    norm.weight.requires_grad_(False)
    return norm


def _conv(c_in: int, c_out: int, pooled: bool = False) -> nn.Conv2d:
    conv = Conv3x3(c_in, c_out, pooled)
    # Partial identity init: the first c_in filters pass their input channel through, so a net without residual
    # connections still starts close to an identity map and trains from its first steps.
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:min(c_in, c_out)])
    return conv


class ConvGroup(nn.Sequential):
    def __init__(self, c_in: int, c_out: int):
        super().__init__(
            _conv(c_in, c_out, pooled=True), MaxPool2x2(), _norm(c_out), nn.GELU(),
            _conv(c_out, c_out), _norm(c_out), nn.GELU(),
        )


class ResidualConvGroup(ConvGroup):
    """ConvGroup with a third convolution, and the pooled input added back after it (airbench96's group): depth
    without a longer path for the gradient. Its first seven modules are ConvGroup's, in ConvGroup's order."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(c_in, c_out)
        self.append(_conv(c_out, c_out))
        self.append(_norm(c_out))

    def forward(self, x):
        conv1, pool, norm1, act, conv2, norm2, _, conv3, norm3 = self
        x = act(norm1(pool(conv1(x))))
        return act(x + norm3(conv3(act(norm2(conv2(x))))))


class FastNet(nn.Module):
    def __init__(self, widths=(64, 256, 256), num_classes: int = 10, residual: bool = False):
        super().__init__()
        whiten_channels = 2 * 3 * WHITEN_PATCH**2  # each eigenvector and its negation (GELU is not odd)
        self.whiten = nn.Conv2d(3, whiten_channels, WHITEN_PATCH, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        groups, c_in = [], whiten_channels
        for width in widths:
            groups.append((ResidualConvGroup if residual else ConvGroup)(c_in, width))
            c_in = width
        self.body = nn.Sequential(nn.GELU(), *groups)  # 31 -> 15 -> 7 -> 3 pixels
        self.head = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes, bias=False))

    def forward(self, x):
        return self.head(self.body(self.whiten(x))) * LOGIT_SCALE

    @property
    def conv_groups(self) -> list[ConvGroup]:
        """The conv groups, input side first: the units that `train.group_train_epochs` freezes."""
        return [module for module in self.body if isinstance(module, ConvGroup)]

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor) -> None:
        """Set the whitening filters from normalized training images (N x 3 x 32 x 32)."""
        patches = images.float().unfold(2, WHITEN_PATCH, 1).unfold(3, WHITEN_PATCH, 1)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * WHITEN_PATCH**2)
        patches = patches - patches.mean(0)
        covariance = patches.T @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance.double())
        filters = (eigenvectors.T / (eigenvalues + WHITEN_EPS).sqrt()[:, None]).float()
        filters = filters.view(-1, 3, WHITEN_PATCH, WHITEN_PATCH)
        self.whiten.weight.copy_(torch.cat([filters, -filters]))
        self.whiten.bias.zero_()


@register
def fastnet() -> nn.Module:
    return FastNet((64, 256, 256))


@register
def fastnet_wide() -> nn.Module:
    # airbench95's widths: about 2.5x the compute of fastnet for ~1 more point in a longer run.
    return FastNet((128, 384, 384))


@register
def fastnet_deep() -> nn.Module:
    # airbench96's net: three convolutions per group with a residual, widths 128/384/512, for 96% in a longer run.
    return FastNet((128, 384, 512), residual=True)


@register
def fastnet_deep_half() -> nn.Module:
    # fastnet_deep at half its widths: about fastnet's MACs, with the residual third convolution per group that a long
    # distilled run can use.
    return FastNet((64, 192, 256), residual=True)


@register
def fastnet_proxy() -> nn.Module:
    # airbench96's proxy (widths 32/64/64): cheap enough to rank every batch's images by loss for a larger net.
    return FastNet((32, 64, 64))
