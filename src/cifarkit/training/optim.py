"""Optimizers, learning-rate schedules and the weight EMA, built from the recipe through tables, not if/elif ladders.

Every schedule is stepped once per optimizer step, so warmup and decay are smooth whatever the epoch length.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from cifarkit.core.device import cpu_has_bf16, cuda_has_bf16
from cifarkit.training.config import OptimConfig, ScheduleConfig, steps_in


def _param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Weights, and BatchNorm/bias vectors, whose lr and weight decay are set apart (by default no decay: it
    would only shrink them toward zero without regularizing anything). Frozen parameters are left out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = [p for p in trainable if p.ndim > 1]
    vectors = [p for p in trainable if p.ndim <= 1]
    return [{"params": weights, "weight_decay": cfg.weight_decay, "lr": cfg.lr},
            {"params": vectors, "weight_decay": cfg.vector_weight_decay, "lr": cfg.lr * cfg.vector_lr_scale}]


def _muon_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The conv filters (4-d weights) as one orthogonalized group, without weight decay: Muon renormalizes them at
    every step, which bounds them as decay would. The head and the vectors keep their SGD groups."""
    filters = [p for p in model.parameters() if p.requires_grad and p.ndim == 4]
    groups = [{**group, "params": [p for p in group["params"] if p.ndim != 4]} for group in _param_groups(model, cfg)]
    orthogonalized_group = {"params": filters, "lr": cfg.filter_lr, "momentum": cfg.filter_momentum,
                            "weight_decay": 0.0, "orthogonalize": True, "newton_schulz": cfg.newton_schulz}
    return [orthogonalized_group] + [group for group in groups if group["params"]]


OPTIMIZERS = {
    "sgd": lambda model, c: torch.optim.SGD(_param_groups(model, c), lr=c.lr, momentum=c.momentum,
                                            nesterov=c.nesterov),
    "adam": lambda model, c: torch.optim.Adam(_param_groups(model, c), lr=c.lr, betas=c.betas),
    "adamw": lambda model, c: torch.optim.AdamW(_param_groups(model, c), lr=c.lr, betas=c.betas),
    "muon": lambda model, c: Muon(_muon_groups(model, c), lr=c.lr, momentum=c.momentum, nesterov=c.nesterov),
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.name](model, cfg)


# Muon's quintic Newton-Schulz iteration (Jordan et al. 2024, "Muon: an optimizer for hidden layers") runs 3 steps;
# its coefficients are the recipe's (optim.newton_schulz).
NEWTON_SCHULZ_STEPS = 3


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device computes it natively, like the original: the iteration tolerates its rounding, and bf16
    matmuls are the fast ones there. fp32 elsewhere: a CPU without AVX512-BF16 or AMX emulates bf16 matmuls at a
    small fraction of its fp32 speed."""
    if device.type == "cuda":
        return torch.bfloat16 if cuda_has_bf16(device.index) else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32


def orthogonalized(update: torch.Tensor, coefficients: tuple[float, float, float],
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The update (rows: output channels) with its singular values pushed to about 1 by the Newton-Schulz iteration
    x <- a x + (b G + c G^2) x, G = x x^T, with `coefficients` (a, b, c), computed in `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype)
    x = x / (x.norm() + 1e-7)  # the largest singular value at most 1, where the iteration converges
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T  # iterate on the smaller Gram matrix
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `orthogonalize` (conv filters), SGD with momentum (Nesterov's if `nesterov`) and
    coupled weight decay, as torch.optim.SGD, for the rest: one optimizer, so one schedule, one checkpoint and one
    GradScaler cover both.

    An orthogonalized step moves every direction of a filter bank alike instead of following the few directions
    that dominate the gradient. Each filter bank is renormalized to a fixed size before its step: BatchNorm follows
    every convolution, so the size carries no meaning, and fixing it keeps the step's relative size fixed.
    """

    def __init__(self, groups: list[dict], lr: float, momentum: float, nesterov: bool = True):
        super().__init__(groups, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": 0.0,
                                  "orthogonalize": False, "newton_schulz": OptimConfig.newton_schulz})
        first = next(p for group in self.param_groups for p in group["params"])
        self.orthogonalize_dtype = newton_schulz_dtype(first.device)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a checkpoint from before the coefficients were a setting ran Jordan's
            group.setdefault("newton_schulz", OptimConfig.newton_schulz)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if not group["weight_decay"] else p.grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = grad.clone()
                else:
                    state["momentum_buffer"].mul_(momentum).add_(grad)
                buffer = state["momentum_buffer"]
                update = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
                if group["orthogonalize"]:
                    p.mul_(len(p) ** 0.5 / p.norm())
                    update = orthogonalized(update.reshape(len(update), -1), group["newton_schulz"],
                                            self.orthogonalize_dtype).view_as(p)
                p.add_(update, alpha=-group["lr"])


SCHEDULES = {
    "constant": lambda opt, c, steps, per_epoch: lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0),
    "cosine": lambda opt, c, steps, per_epoch: lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
    # With a linear warmup this is the triangular schedule of the fast CIFAR-10 runs.
    "linear": lambda opt, c, steps, per_epoch: _linear(opt, c.final_factor, steps),
    "step": lambda opt, c, steps, per_epoch: lr_scheduler.StepLR(opt, step_size=c.step_epochs * per_epoch,
                                                                 gamma=c.gamma),
    # OneCycle peaks at the optimizer's lr: the recipe's lr *is* max_lr.
    "onecycle": lambda opt, c, steps, per_epoch: lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=steps, pct_start=c.pct_start),
}


def _linear(optimizer: torch.optim.Optimizer, final_factor: float, steps: int) -> lr_scheduler.LRScheduler:
    """Straight from the lr to final_factor x it over the run, or, for a param group that trains fewer steps
    (`train_steps`, set by `split_by_train_steps`), over its own steps: it reaches the end as it freezes."""
    if all(group.get("train_steps") is None for group in optimizer.param_groups):
        return lr_scheduler.LinearLR(optimizer, 1.0, final_factor, total_iters=steps)
    lengths = [max(1, min(steps, group.get("train_steps") or steps)) for group in optimizer.param_groups]
    return lr_scheduler.LambdaLR(optimizer, [lambda t, n=n: 1 + (final_factor - 1) * min(t, n) / n for n in lengths])


def split_by_train_steps(optimizer: torch.optim.Optimizer, train_steps: dict[int, int]) -> None:
    """Split each param group by how many steps its parameters train (`train_steps`: id(parameter) -> steps; absent:
    the whole run), each part keeping its group's options. Before the first step only."""
    groups = list(optimizer.param_groups)
    optimizer.param_groups.clear()
    for group in groups:
        parts: dict[int | None, list] = {}
        for p in group["params"]:
            parts.setdefault(train_steps.get(id(p)), []).append(p)
        for steps, params in parts.items():
            optimizer.add_param_group({**group, "params": params, "train_steps": steps})


def build_schedule(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total: int,
                   steps_per_epoch: int) -> lr_scheduler.LRScheduler:
    """The lr schedule of a run of `total` optimizer steps."""
    warmup = steps_in(cfg.warmup_epochs, steps_per_epoch)
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
