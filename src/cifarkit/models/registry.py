"""Models are built by name, timm-style: each family registers its constructors with `@register`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from cifarkit.core.constants import CLASSES  # noqa: F401  (models.CLASSES: what each output means)
from cifarkit.core.errors import CifarkitError

_MODELS: dict[str, Callable[[], nn.Module]] = {}


def register(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    _MODELS[fn.__name__] = fn
    return fn


def names() -> list[str]:
    return sorted(_MODELS)


def create(name: str, norm_momentum: float | None = None) -> nn.Module:
    """The model registered as `name`; with `norm_momentum`, its BatchNorm layers keep their running statistics
    with that momentum instead of the model's own."""
    if name not in _MODELS:
        raise CifarkitError(f"unknown model {name!r}; choose from {', '.join(names())}")
    model = _MODELS[name]()
    if norm_momentum is not None:
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            norm.momentum = norm_momentum
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module) -> int:
    """Multiply-accumulates for one 3x32x32 image, from torch's FLOP counter (which counts 2 FLOPs per MAC)."""
    from torch.utils.flop_counter import FlopCounterMode
    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    model.train(was_training)
    return counter.get_total_flops() // 2
