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


def create(name: str) -> nn.Module:
    if name not in _MODELS:
        raise CifarkitError(f"unknown model {name!r}; choose from {', '.join(names())}")
    return _MODELS[name]()


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
