"""Optimizers, learning-rate schedules and the weight EMA, built from the recipe through tables, not if/elif ladders.

Every schedule is stepped once per optimizer step, so warmup and decay are smooth whatever the epoch length.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from cifarkit.config import OptimConfig, ScheduleConfig


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay on BatchNorm scales and on biases only shrinks them toward zero without regularizing anything useful.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {
    "sgd": lambda groups, c: torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov),
    "adam": lambda groups, c: torch.optim.Adam(groups, lr=c.lr, betas=c.betas),
    "adamw": lambda groups, c: torch.optim.AdamW(groups, lr=c.lr, betas=c.betas),
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.name](_param_groups(model, cfg.weight_decay), cfg)


SCHEDULES = {
    "constant": lambda opt, c, steps, per_epoch: lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0),
    "cosine": lambda opt, c, steps, per_epoch: lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
    "step": lambda opt, c, steps, per_epoch: lr_scheduler.StepLR(opt, step_size=c.step_epochs * per_epoch,
                                                                 gamma=c.gamma),
    # OneCycle peaks at the optimizer's lr: the recipe's lr *is* max_lr.
    "onecycle": lambda opt, c, steps, per_epoch: lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=steps, pct_start=c.pct_start),
}


def build_schedule(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, epochs: int,
                   steps_per_epoch: int) -> lr_scheduler.LRScheduler:
    warmup = math.ceil(cfg.warmup_epochs * steps_per_epoch)
    total = epochs * steps_per_epoch
    main = SCHEDULES[cfg.name](optimizer, cfg, max(total - warmup, 1), steps_per_epoch)
    if warmup == 0:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=cfg.warmup_start_factor, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def build_ema(model: nn.Module, decay: float | None) -> AveragedModel | None:
    """An exponential moving average of the weights and BatchNorm statistics, updated after every step."""
    if decay is None:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
