"""The recipe's data and augment sections: what the data layer takes from a recipe."""
from __future__ import annotations

from dataclasses import dataclass, field

from cifarkit.artifacts.preprocess import MEAN as CIFAR10_MEAN
from cifarkit.artifacts.preprocess import STD as CIFAR10_STD


@dataclass
class AugmentConfig:
    crop_pad: int = 0  # random crop after zero padding by this many pixels (0 = off)
    translate: int = 0  # random shift by up to this many pixels, reflect padding (0 = off)
    flip: bool = False  # random horizontal flip
    alternate_flip: bool = False  # with flip: random in epoch 1, then each image mirrored opposite to last epoch
    cutout: int = 0  # side of the zeroed square, in pixels (0 = off)
    autoaugment: str | None = None  # torchvision AutoAugment policy name, e.g. "cifar10"
    # Low-resolution early epochs: the first early_crop_epochs train on random early_crop x early_crop windows of
    # the (translated) images, at that share of the pixels' cost. Objects keep their scale, the later epochs see
    # whole images. 0 = off.
    early_crop: int = 0
    early_crop_epochs: int = 0
    # Per-image colour jitter of the normalized image, x -> (x + b) * c with b ~ U(-brightness, brightness) and
    # c ~ 1 + U(-contrast, contrast), in units of the channels' standard deviations. 0 = off.
    brightness: float = 0.0
    contrast: float = 0.0


@dataclass
class DataConfig:
    subset: int | None = None  # class-balanced training subset size; None = all 50,000
    val_split: int = 0  # training images held out to select the checkpoint (never the test set)
    mean: tuple[float, float, float] = CIFAR10_MEAN
    std: tuple[float, float, float] = CIFAR10_STD
    augment: AugmentConfig = field(default_factory=AugmentConfig)
