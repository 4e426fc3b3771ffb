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


def _param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Weights, and BatchNorm/bias vectors, whose lr and weight decay are set apart (by default no decay: it
    would only shrink them toward zero without regularizing anything). Frozen parameters are left out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = [p for p in trainable if p.ndim > 1]
    vectors = [p for p in trainable if p.ndim <= 1]
    return [{"params": weights, "weight_decay": cfg.weight_decay, "lr": cfg.lr},
            {"params": vectors, "weight_decay": cfg.vector_weight_decay, "lr": cfg.lr * cfg.vector_lr_scale}]


OPTIMIZERS = {
    "sgd": lambda groups, c: torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov),
    "adam": lambda groups, c: torch.optim.Adam(groups, lr=c.lr, betas=c.betas),
    "adamw": lambda groups, c: torch.optim.AdamW(groups, lr=c.lr, betas=c.betas),
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.name](_param_groups(model, cfg), cfg)


SCHEDULES = {
    "constant": lambda opt, c, steps, per_epoch: lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0),
    "cosine": lambda opt, c, steps, per_epoch: lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
    # With a linear warmup this is the triangular schedule of the fast CIFAR-10 runs.
    "linear": lambda opt, c, steps, per_epoch: lr_scheduler.LinearLR(opt, 1.0, c.final_factor, total_iters=steps),
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


class Lookahead:
    """Lookahead with an EMA (Zhang et al. 2019, as used by the airbench speedruns): every `every` steps the slow
    copy moves toward the trained weights, and the trained weights jump back onto it.

    The slow copy's decay ramps up as (step / total)^3, so early training runs free and the end is averaged.
    It covers parameters and BatchNorm statistics alike, so the result is a consistent model.
    """

    def __init__(self, model: nn.Module, every: int, decay: float, total_steps: int):
        self.every, self.decay, self.total_steps = every, decay, total_steps
        self.steps = 0
        self.slow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    def step(self, model: nn.Module) -> None:
        self.steps += 1
        if self.steps == self.total_steps:  # the run ends on the slow weights
            self._sync(model, keep=1.0)
        elif self.steps % self.every == 0:
            self._sync(model, keep=self.decay ** self.every * (self.steps / self.total_steps) ** 3)

    @torch.no_grad()
    def _sync(self, model: nn.Module, keep: float) -> None:
        fast = model.state_dict()
        for name, slow in self.slow.items():
            slow.lerp_(fast[name], 1 - keep)
            fast[name].copy_(slow)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "slow": self.slow}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for name, value in state["slow"].items():
            self.slow[name].copy_(value)


def build_lookahead(model: nn.Module, every: int | None, decay: float, total_steps: int) -> Lookahead | None:
    return None if every is None else Lookahead(model, every, decay, total_steps)
