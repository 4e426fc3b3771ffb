"""One training epoch and one evaluation pass. They return metric dicts and touch no files."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from tqdm import tqdm

from cifarkit.core.device import Precision, autocast
from cifarkit.core.errors import CifarkitError
from cifarkit.data.loader import normalize
from cifarkit.training.distributed import sum_over_ranks
from cifarkit.training.optim import Lookahead

DIVERGENCE_CHECK_EVERY = 20  # steps; each check syncs with the device, so not every step


class DivergenceError(CifarkitError):
    """The loss became NaN/inf; `where` says when, `kept` what survives of the run."""

    def __init__(self, step: int, where: str = "this epoch", kept: str = ""):
        super().__init__(f"training diverged: the loss became NaN/inf by step {step} of {where}; lower the learning "
                         f"rate (--lr) or set train.grad_clip" + (f"; {kept}" if kept else ""))
        self.step = step


@dataclass
class TrainState:
    model: nn.Module  # the plain module: its state_dict is what gets saved
    forward: Callable  # the module or its torch.compile wrapper, used for the steps
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: nn.Module | None
    lookahead: Lookahead | None = None
    # The module's gradients are not averaged over the ranks inside this context (DDP's no_sync): the micro-batches
    # of an accumulated step but the last. after_step: what follows every optimizer step (ranks' BatchNorm stats).
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    after_step: Callable[[nn.Module], None] = lambda model: None
    selector: HardestSelector | None = None  # picks the images of each batch that the model trains on


class HardestSelector:
    """Keeps the hardest `fraction` of each batch, as ranked by the loss of a small proxy model (airbench96's data
    filtering): the model's steps then cost `fraction` of a full batch's, and the proxy's ranking a few percent more.

    The proxy learns as the run goes, one step in `train_every`, on the images it picked; on the other steps it only
    ranks. It depends on the batches alone, never on the model it selects for. `proxy` is its own TrainState
    (optimizer, schedule, scaler), saved and restored with the run's checkpoint.
    """

    def __init__(self, proxy: TrainState, fraction: float, train_every: int, label_smoothing: float,
                 device: torch.device, precision: Precision):
        self.proxy, self.fraction, self.train_every = proxy, fraction, train_every
        self.label_smoothing, self.device, self.precision = label_smoothing, device, precision
        self.steps = 0

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, *per_image: torch.Tensor) -> tuple:
        """The kept share of (inputs, labels, *per_image): the images the proxy finds hardest, in batch order."""
        proxy = self.proxy
        learns = self.steps % self.train_every == 0
        proxy.model.train()
        with torch.set_grad_enabled(learns), autocast(self.device, self.precision):
            losses = F.cross_entropy(proxy.forward(inputs).float(), labels, reduction="none",
                                     label_smoothing=self.label_smoothing)
        # Sorted back into batch order: the same images in the same order whatever their losses' order.
        hardest = losses.detach().topk(max(1, round(self.fraction * len(labels)))).indices.sort().values
        if learns:
            proxy.optimizer.zero_grad(set_to_none=True)
            proxy.scaler.scale(losses[hardest].mean()).backward()
            proxy.scaler.step(proxy.optimizer)
            proxy.scaler.update()
        proxy.scheduler.step()
        self.steps += 1
        return tuple(tensor[hardest] for tensor in (inputs, labels, *per_image))

    def state_dict(self) -> dict:
        return {"model": self.proxy.model.state_dict(), "optimizer": self.proxy.optimizer.state_dict(),
                "scheduler": self.proxy.scheduler.state_dict(), "scaler": self.proxy.scaler.state_dict(),
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.proxy.model.load_state_dict(state["model"])
        self.proxy.optimizer.load_state_dict(state["optimizer"])
        self.proxy.scheduler.load_state_dict(state["scheduler"])
        self.proxy.scaler.load_state_dict(state["scaler"])
        self.steps = state["steps"]


class ClassificationLoss:
    """Cross-entropy (with label smoothing) on the labels; called as loss(logits, labels, inputs[, targets]), with
    the batch's per-image targets where the loader has them (TrainLoader.targets)."""

    def __init__(self, label_smoothing: float = 0.0):
        self.cross_entropy = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor,
                 targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.cross_entropy(logits, labels)


class DistillationLoss(ClassificationLoss):
    """(1 - weight) * CE + weight * T^2 * KL(teacher || student) at temperature T (Hinton et al. 2015).

    With a teacher, it sees the same augmented batch as the student; without one (None), the batch's `targets` are
    the teacher's logits, computed before training (distill.targets: tta). T^2 keeps the soft term's gradients on
    the scale of the hard term's, whatever T is.
    """

    def __init__(self, teacher: nn.Module | None, temperature: float, weight: float, label_smoothing: float = 0.0):
        super().__init__(label_smoothing)
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.temperature, self.weight = temperature, weight

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor,
                 targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(inputs).float()
        elif targets is not None:
            teacher_logits = targets
        else:
            raise ValueError("distillation without a teacher needs the batch's targets (TrainLoader.targets)")
        t = self.temperature
        soft = F.kl_div(F.log_softmax(logits / t, 1), F.log_softmax(teacher_logits / t, 1), log_target=True,
                        reduction="batchmean")
        return (1 - self.weight) * super().__call__(logits, labels, inputs) + self.weight * t * t * soft


def train_one_epoch(state: TrainState, batches: Iterable, steps: int, batch_size: int, loss_fn: Callable,
                    device: torch.device, precision: Precision, grad_clip: float | None,
                    description: str = "", progress: bool = True) -> dict:
    """`batches` yields each step's micro-batches (see train_step). `batch_size`: images per step over all ranks. The
    figures returned cover every rank's images; with a selector, the loss and accuracy are those of the images the
    model trained on, and the speed counts every image drawn."""
    state.model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = drawn = 0
    start = time.perf_counter()
    # disable=None hides the bar when stderr is not a terminal (CI logs, pipes). Closed on the way out of an error or
    # a Ctrl-C too, so the one-line message that follows starts on a line of its own.
    with tqdm(total=steps * batch_size, desc=description, unit="img", unit_scale=True,
              disable=None if progress else True, leave=False) as bar:
        for step, micro_batches in enumerate(batches, 1):
            trained, taken = train_step(state, micro_batches, loss_fn, device, precision, grad_clip, loss_sum, correct)
            seen, drawn = seen + trained, drawn + taken
            bar.update(batch_size)
            if step % DIVERGENCE_CHECK_EVERY == 0 or step == steps:
                _check_finite(loss_sum, step)
    seconds = time.perf_counter() - start
    loss_total, correct_total, seen_total, drawn_total = sum_over_ranks(
        loss_sum, correct, torch.tensor(seen, device=device), torch.tensor(drawn, device=device))
    return {"train_loss": loss_total.item() / seen_total.item(), "train_acc": correct_total.item() / seen_total.item(),
            "epoch_time_s": seconds, "images_per_s": drawn_total.item() / seconds}


def train_step(state: TrainState, micro_batches: list, loss_fn: Callable, device: torch.device, precision: Precision,
               grad_clip: float | None, loss_sum: torch.Tensor, correct: torch.Tensor) -> tuple[int, int]:
    """One optimizer step. `micro_batches`: a list of (normalized, augmented inputs, labels[, per-image targets]) on
    the device, whose gradients add up to the step, as if they were one batch. The summed loss and the correct
    predictions of the images trained on are added to `loss_sum` and `correct`, device tensors that are not read
    here (reading them would wait for the device). Returns the count of images trained on and of images drawn (more
    with a selector). Nothing here waits for a CUDA device, except fp16's GradScaler, which reads its overflow check
    before stepping, and an EMA (torch's AveragedModel reads its count)."""
    state.optimizer.zero_grad(set_to_none=True)
    seen = drawn = 0
    # Each micro-batch updates the BatchNorm statistics from where the step found them, and the step keeps their
    # mean: what the ranks of a distributed run end a step with (distributed.average_buffers).
    found = [b.clone() for b in state.model.buffers()] if len(micro_batches) > 1 else None
    updated = []
    for i, (inputs, labels, *targets) in enumerate(micro_batches, 1):
        if found is not None:
            _set_buffers(state.model, found)
        drawn += len(labels)
        if state.selector is not None:
            with record_function("selection"):
                inputs, labels, *targets = state.selector(inputs, labels, *targets)
        # The ranks average their gradients once a step, in the last micro-batch's backward pass.
        with state.no_sync() if i < len(micro_batches) else contextlib.nullcontext():
            with record_function("forward"), autocast(device, precision):
                logits = state.forward(inputs)
                loss = loss_fn(logits.float(), labels, inputs, *targets)
            with record_function("backward"):
                state.scaler.scale(loss / len(micro_batches)).backward()
        loss_sum += loss.detach() * len(labels)
        correct += (logits.argmax(1) == labels).sum()
        seen += len(labels)
        if found is not None:
            updated.append([b.clone() for b in state.model.buffers()])
    if found is not None:
        _set_buffers(state.model, [torch.stack(values).sum(0) / len(values) if values[0].is_floating_point()
                                   else values[-1] for values in zip(*updated)])
    with record_function("optimizer"):
        if grad_clip is not None:
            state.scaler.unscale_(state.optimizer)
            nn.utils.clip_grad_norm_(state.model.parameters(), grad_clip)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        state.after_step(state.model)
    with record_function("weight averaging"):
        if state.ema is not None:
            state.ema.update_parameters(state.model)
        if state.lookahead is not None:
            state.lookahead.step(state.model)
    return seen, drawn


def _set_buffers(model: nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), values):
            buffer.copy_(value)


def _check_finite(loss_sum: torch.Tensor, step: int) -> None:
    if not torch.isfinite(loss_sum):
        raise DivergenceError(step)


# Images per evaluation batch. A CPU evaluates faster in batches that stay in its caches: 256 was as fast as 1000 or
# faster for every model and thread count measured (results/eval-batch-*.json). A GPU keeps large batches, which
# launch fewer kernels.
EVAL_BATCH_CPU = 256
EVAL_BATCH_ACCELERATOR = 1000
TTA_PLAIN_WEIGHT = 0.25  # the image itself; its mirror the same, each of the four shifted views half that


def tta_views(x: torch.Tensor, tta: bool, plain: bool = True) -> list[tuple[float, torch.Tensor]]:
    """(weight, view) pairs whose weighted logits are summed. With TTA: the image and its mirror carry half the
    weight, and the same pair shifted one pixel up-left and down-right (reflect padding) a quarter each, the
    small translations that training also shows (the weighting of Jordan 2024). `plain=False` leaves out the
    image itself, whose logits the caller has."""
    if not tta:
        return [(1.0, x)]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    h, w = x.shape[-2:]
    shifted = TTA_PLAIN_WEIGHT / 2
    pairs = [(TTA_PLAIN_WEIGHT, x), (shifted, padded[..., :h, :w]), (shifted, padded[..., 2:, 2:])]
    views = pairs + [(weight, view.flip(3)) for weight, view in pairs]
    return views if plain else views[1:]


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, device: torch.device,
             precision: Precision, batch_size: int | None = None, channels_last: bool = True, tta: bool = False,
             tta_share: float = 1.0, progress: str | None = None) -> dict:
    """Loss, accuracy and the predicted class of every image, on uint8 images held anywhere. With `tta_share` < 1,
    only that share of the images, the least confident under the single view, gets the other TTA views; the rest
    keep their single view's logits. `progress` names a progress bar, shown on a terminal only. `batch_size`:
    EVAL_BATCH_CPU or EVAL_BATCH_ACCELERATOR by default."""
    model.eval()
    batch_size = batch_size or _eval_batch(device)
    view_args = dict(model=model, mean=mean, std=std, device=device, precision=precision, batch_size=batch_size,
                     channels_last=channels_last, progress=progress)
    if not tta or tta_share >= 1.0:
        logits = _view_logits(images, tta=tta, **view_args)
    else:
        logits = _view_logits(images, tta=False, **view_args)
        confidence = logits.softmax(1).amax(1)
        uncertain = confidence.topk(round(tta_share * len(labels)), largest=False).indices.sort().values
        if len(uncertain):
            others = _view_logits(images[uncertain], tta=True, plain=False, **view_args)
            logits[uncertain] = TTA_PLAIN_WEIGHT * logits[uncertain] + others
    predictions = logits.argmax(1)
    labels = labels.cpu()
    return {"loss": F.cross_entropy(logits, labels).item(), "acc": (predictions == labels).float().mean().item(),
            "predictions": predictions}


@torch.no_grad()
def tta_logits(model: nn.Module, images: torch.Tensor, mean, std, device: torch.device, precision: Precision,
               channels_last: bool = True, progress: str | None = None) -> torch.Tensor:
    """The fp32 TTA logits (tta_views' weighted sum) of every uint8 image, on the CPU: what `evaluate` with TTA
    predicts from."""
    model.eval()
    return _view_logits(images, tta=True, model=model, mean=mean, std=std, device=device, precision=precision,
                        batch_size=_eval_batch(device), channels_last=channels_last, progress=progress)


def _eval_batch(device: torch.device) -> int:
    return EVAL_BATCH_CPU if device.type == "cpu" else EVAL_BATCH_ACCELERATOR


def _view_logits(images: torch.Tensor, tta: bool, model: nn.Module, mean, std, device: torch.device,
                 precision: Precision, batch_size: int, channels_last: bool, progress: str | None,
                 plain: bool = True) -> torch.Tensor:
    """The weighted sum of the fp32 logits of `tta_views(x, tta, plain)` for every image, on the CPU."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    chunks = []
    with tqdm(total=len(images), desc=progress, unit="img", unit_scale=True, leave=False,
              disable=None if progress else True) as bar:
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size]
            x = normalize(x.to(device, non_blocking=True), mean, std).contiguous(memory_format=memory_format)
            with autocast(device, precision):
                chunks.append(sum(weight * model(view).float() for weight, view in tta_views(x, tta, plain)).cpu())
            bar.update(len(x))
    return torch.cat(chunks)


def per_class_accuracy(predictions: torch.Tensor, labels: torch.Tensor, classes: int = 10) -> list[float]:
    return [(predictions[labels == c] == c).float().mean().item() for c in range(classes)]


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, classes: int = 10) -> torch.Tensor:
    """Rows are true classes, columns predicted classes."""
    return torch.bincount(labels * classes + predictions, minlength=classes * classes).view(classes, classes)
