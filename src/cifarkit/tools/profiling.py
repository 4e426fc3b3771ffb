"""`cifarkit profile`: where a recipe's training step spends its time, to choose what to speed up.

The recipe's own setup (data, model, optimizer, loss) runs a few warm-up steps, then the same number of steps twice:
first plainly, timed, with the process's page faults and system time from getrusage (the allocator's share); then
under torch.profiler, whose operator times are sorted into the parts of a step. The step's parts are the
record_function labels that the loader and the engine set ("augmentation", "forward", "backward", "optimizer",
"weight averaging"); inside the forward and backward passes each operator is sorted by its kind. The final test
evaluation, with the recipe's TTA, is timed on a slice of the test set and projected to all of it.

The convolutions' time over the recipe's epochs is the run's floor on this machine: what training would take if
everything else were free. Where it is most of a run's time, only fewer FLOPs (not faster other parts) make the run
shorter.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import resource
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cifarkit.core.device import describe, pick_device, report
from cifarkit.models.layers import Conv3x3, Conv3x3MatmulWeightGrad
from cifarkit.models.winograd import WinogradConv3x3
from cifarkit.training import distributed, train
from cifarkit.training.config import Recipe
from cifarkit.training.engine import evaluate, train_one_epoch

PHASES = ("augmentation", "forward", "backward", "optimizer", "weight averaging")
# Operator kinds inside the forward and backward passes, matched in order against aten's operator names.
KINDS = (
    ("convolution backward", r"convolution_backward"),
    ("convolution", r"convolution|conv2d"),
    ("BatchNorm", r"batch_norm"),
    ("activation", r"gelu|relu|silu|sigmoid|tanh"),
    ("pooling", r"pool"),
    ("dtype casts and copies", r"::to$|_to_copy|::copy_|contiguous|clone"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|kl_div"),
)
# Conv3x3's own autograd functions compute the weight gradient as matmuls over shifted copies of its padded input,
# or the whole convolution by Winograd's transforms and matmuls: their operators (pad, cat, add, bmm) are the
# convolution's, whatever aten calls them. Their backward nodes add "Backward".
CONVOLUTION_FUNCTIONS = (Conv3x3MatmulWeightGrad.__name__, WinogradConv3x3.__name__)
WARMUP_STEPS = 2  # the first steps choose oneDNN kernels and fill the allocator's caches


def run(recipe: Recipe, steps: int, eval_images: int = 2000) -> dict:
    device = pick_device(recipe.train.device)
    group = distributed.Group()
    setup = train.prepare(recipe, group, device)
    cfg, state = recipe.train, setup.state
    batches = setup.loader.endless()
    # The early epochs may train on smaller crops (data.augment.early_crop): the table names the size it timed.
    first = next(batches)
    image_size = list(first[0][0].shape[-2:])
    batches = itertools.chain([first], batches)

    def train_steps(count: int) -> dict:
        return train_one_epoch(state, itertools.islice(batches, count), count, cfg.batch_size, setup.loss_fn, device,
                               setup.precision, cfg.grad_clip, progress=False)

    train_steps(WARMUP_STEPS)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    train_steps(steps)
    _synchronize(device)
    step_s = (time.perf_counter() - started) / steps
    after = resource.getrusage(resource.RUSAGE_SELF)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiled = profile(activities=activities)
    with _native_stderr_silenced():
        profiled.start()
    train_steps(steps)
    _synchronize(device)
    with _native_stderr_silenced():
        profiled.stop()
    parts, profiled_step_s = _step_parts(profiled.events(), steps)
    stretches = _steps_by_what_trains(state, cfg, setup.loader.steps_per_epoch, step_s, train_steps, steps, device)

    test_x, test_y = setup.test
    count = min(eval_images, len(test_y))
    eval_args = dict(mean=recipe.data.mean, std=recipe.data.std, device=device, precision=setup.precision,
                     channels_last=cfg.channels_last, tta=cfg.tta, tta_share=cfg.tta_share)
    evaluate(state.model, test_x[:200], test_y[:200], **eval_args)  # warm-up for the evaluation's batch shapes
    started = time.perf_counter()
    with record_function("evaluation"):
        evaluate(state.model, test_x[:count], test_y[:count], **eval_args)
    _synchronize(device)
    eval_s_per_image = (time.perf_counter() - started) / count
    convolutions_s = parts.get("convolution", 0.0) + parts.get("convolution backward", 0.0)
    # forward, input gradient and weight gradient: three times the forward's multiply-adds, two FLOPs each
    convolution_flop = 3 * 2 * convolution_macs(state.model, image_size) * cfg.batch_size
    computed_flop = 2 * computed_convolution_macs(state.model, image_size, setup.precision.autocast_dtype,
                                                  compiled=cfg.compiles(device.type)) * cfg.batch_size
    peak = matmul_peak(setup.precision.autocast_dtype or torch.float32, device)
    return {
        "recipe": recipe.name, "model": recipe.model.name, "batch_size": cfg.batch_size, "steps": steps,
        "image_size": image_size,
        "precision": setup.precision.name, "steps_per_epoch": setup.loader.steps_per_epoch,
        "step_s": step_s, "images_per_s": cfg.batch_size / step_s,
        "epoch_s": step_s * setup.loader.steps_per_epoch,
        "process_per_step": {
            "minor_page_faults": (after.ru_minflt - before.ru_minflt) / steps,
            "system_s": (after.ru_stime - before.ru_stime) / steps,
            "user_s": (after.ru_utime - before.ru_utime) / steps,
        },
        "profiled_step_s": profiled_step_s,
        "parts_s": parts,
        "epochs": cfg.epochs,
        "convolutions_s_per_run": convolutions_s * sum(stretch["run_steps"] for stretch in stretches),
        "step_s_by_epochs": stretches,
        "training_steps_s_per_run": sum(stretch["step_s"] * stretch["run_steps"] for stretch in stretches),
        "convolution_flop_per_s": convolution_flop / convolutions_s if convolutions_s else None,
        "convolution_computed_flop_per_s": computed_flop / convolutions_s if convolutions_s else None,
        "matmul_peak": peak,
        "evaluation": {"tta": cfg.tta, "images": count, "s_per_image": eval_s_per_image,
                       "test_pass_s": eval_s_per_image * len(test_y), "test_images": len(test_y)},
        "environment": report(device),
    }


def _steps_by_what_trains(state, cfg, steps_per_epoch: int, first_step_s: float, train_steps, steps: int,
                          device) -> list[dict]:
    """The step's time in each stretch of epochs that trains the same parameters, and the run's steps there
    (`run_steps`): a frozen whitening bias or conv group (`train.freeze_for_epoch`) makes later steps cheaper. Epoch
    1's step is the one timed before; each later stretch is timed as plainly, after a warm-up step, on the same
    batches."""
    trained = train.optimized_parameters(state.optimizer)
    stretches = []
    for epoch, run_steps in enumerate(cfg.steps_by_epoch(steps_per_epoch), 1):
        train.freeze_for_epoch(state, cfg, epoch)
        frozen = sorted({".".join(name.split(".")[:2]) for name, p in state.model.named_parameters()
                         if p in trained and not p.requires_grad})
        if stretches and stretches[-1]["frozen"] == frozen:
            stretches[-1]["epochs"][1] = epoch
            stretches[-1]["run_steps"] += run_steps
        else:
            stretches.append({"epochs": [epoch, epoch], "frozen": frozen, "run_steps": run_steps})
    stretches[0]["step_s"] = first_step_s
    for stretch in stretches[1:]:
        train.freeze_for_epoch(state, cfg, stretch["epochs"][0])
        train_steps(1)
        started = time.perf_counter()
        train_steps(steps)
        _synchronize(device)
        stretch["step_s"] = (time.perf_counter() - started) / steps
    train.freeze_for_epoch(state, cfg, 1)
    return stretches


def _direct_macs(conv: torch.nn.Conv2d, image_output: torch.Tensor) -> int:
    """Multiply-adds of a direct convolution that made `image_output`, one image's output."""
    return image_output.numel() * conv.in_channels // conv.groups * conv.kernel_size[0] * conv.kernel_size[1]


def convolution_macs(model: torch.nn.Module, image_size: list[int]) -> int:
    """Multiply-adds of the model's convolutions for one image of `image_size`, counted by hooks on a forward pass."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        total += _direct_macs(module, output[0])

    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    hooks = [m.register_forward_hook(count) for m in convolutions]
    parameter = next(model.parameters())
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, *image_size, device=parameter.device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return total


def computed_convolution_macs(model: torch.nn.Module, image_size: list[int], autocast_dtype: torch.dtype | None,
                              compiled: bool = False) -> int:
    """Multiply-adds per image that a training step's convolutions compute, as the model stands (which parameters
    train): each forward on its training path (`Conv3x3.multiply_adds`: the outputs a pooled layer keeps,
    Winograd's fewer products; `compiled`, under torch.compile, every output directly, as `Conv3x3.path` has it
    there), again for the input's gradient where the input has one, and for the weight's where the weight trains.
    Counted on a copy, so the model's BatchNorm statistics are untouched."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        x = inputs[0]
        own_path = isinstance(module, Conv3x3) and not compiled
        forward = module.multiply_adds(x) if own_path else _direct_macs(module, output[0])
        total += forward * (1 + int(x.requires_grad) + int(module.weight.requires_grad))

    twin = copy.deepcopy(model).train()
    for module in twin.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_hook(count)
    parameter = next(twin.parameters())
    with torch.enable_grad(), torch.autocast(parameter.device.type, dtype=autocast_dtype or torch.float32,
                                             enabled=autocast_dtype is not None):
        twin(torch.zeros(2, 3, *image_size, device=parameter.device))  # 2 images: BatchNorm trains on a batch
    return total


def matmul_peak(dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5) -> dict:
    """FLOP/s of a size^3 matmul in the training precision, the best of `repeats`: what this CPU's cores reach on
    the most regular work there is, with the threads training has, so the convolutions' rate has a yardstick."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return {"dtype": str(dtype).removeprefix("torch."), "size": size, "flop_per_s": 2 * size**3 / best}


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's C++ side (Kineto) writes start/stop trace lines to the process's stderr, and on a CUDA build
    without a GPU an ERROR that no GPU answered: noise here, where the CPU alone is profiled on purpose."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_parts(events, steps: int) -> tuple[dict, float]:
    """(seconds per step of each part, seconds per profiled step). The parts: the phases, with forward and backward
    split into operator kinds. An operator's self time counts once, in the innermost phase that encloses it; "other"
    is the step's time outside the phases."""
    parts: dict[str, float] = {}
    labelled = 0.0
    for event in events:
        if event.name in PHASES:
            labelled += event.cpu_time_total
            continue
        part = part_of(event)
        if part is not None:
            parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total
    total = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    parts["other"] = max(total - labelled, 0.0)
    parts = {name: us / 1e6 / steps for name, us in sorted(parts.items(), key=lambda item: -item[1])}
    return parts, total / 1e6 / steps


def part_of(event) -> str | None:
    """The part of a step that a profiled operator's self time counts in: the innermost phase that encloses it, and
    within the forward and backward passes its operator kind; None outside the phases."""
    phase = _enclosing_phase(event)
    if phase in ("forward", "backward"):
        return _kind(event, phase)
    return phase


def _kind(event, phase: str) -> str:
    """The operator kind of a forward or backward operator, by its name or by the convolution function it runs in."""
    if any(name.startswith(CONVOLUTION_FUNCTIONS) for name in _ancestors(event)):
        return "convolution" if phase == "forward" else "convolution backward"
    return next((name for name, pattern in KINDS if re.search(pattern, event.name)), f"other {phase}")


def _enclosing_phase(event) -> str | None:
    return next((name for name in _ancestors(event) if name in PHASES), None)


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent.name
        parent = parent.cpu_parent


def _epochs_text(epochs: list[int]) -> str:
    return f"epoch {epochs[0]}" if epochs[0] == epochs[1] else f"epochs {epochs[0]}-{epochs[1]}"


def table(result: dict) -> str:
    lines = describe(result["environment"]) + [
        "",
        f"recipe {result['recipe']} ({result['model']}, {result['precision']}, batch {result['batch_size']} of "
        f"{'x'.join(map(str, result['image_size']))} images): "
        f"{1000 * result['step_s']:.1f} ms per step, {result['images_per_s']:.0f} img/s, "
        f"{result['epoch_s']:.1f} s per epoch of {result['steps_per_epoch']} steps (mean of {result['steps']} steps, "
        f"not profiled)",
        "",
        f"where a step's time goes (under torch.profiler: {1000 * result['profiled_step_s']:.1f} ms per step)",
        "| part | ms per step | share |", "|---|---:|---:|",
    ]
    for name, seconds in result["parts_s"].items():
        lines.append(f"| {name} | {1000 * seconds:.1f} | {100 * seconds / result['profiled_step_s']:.1f}% |")
    process, step = result["process_per_step"], result["step_s"]
    lines += [
        "",
        f"process, per step: {process['minor_page_faults']:,.0f} minor page faults, system time "
        f"{1000 * process['system_s']:.1f} ms, user time {1000 * process['user_s']:.1f} ms "
        f"(system: {100 * process['system_s'] / max(process['system_s'] + process['user_s'], 1e-9):.1f}% of the "
        f"CPU time; wall {1000 * step:.1f} ms)",
    ]
    evaluation = result["evaluation"]
    lines.append(f"final evaluation{' with TTA' if evaluation['tta'] else ''}: {evaluation['test_pass_s']:.1f} s per "
                 f"pass over {evaluation['test_images']:,} test images (timed on {evaluation['images']:,}), "
                 f"{100 * evaluation['test_pass_s'] / result['epoch_s']:.0f}% of an epoch")
    peak = result["matmul_peak"]
    if result["convolution_flop_per_s"]:
        computed = result["convolution_computed_flop_per_s"]
        lines.append(f"the convolutions ran at {computed / 1e12:.3f} TFLOP/s of the products they compute (cropped "
                     f"outputs, Winograd's fewer products, no gradient that nothing needs), "
                     f"{100 * computed / peak['flop_per_s']:.0f}% of a {peak['size']}^3 {peak['dtype']} matmul's "
                     f"{peak['flop_per_s'] / 1e12:.3f} TFLOP/s measured in the same run; counted as direct "
                     f"convolutions, forward and both gradients, {result['convolution_flop_per_s'] / 1e12:.3f}")
    if len(result["step_s_by_epochs"]) > 1:
        stretches = "; ".join(f"{_epochs_text(s['epochs'])} {1000 * s['step_s']:.1f} ms"
                              f"{' (frozen: ' + ', '.join(s['frozen']) + ')' if s['frozen'] else ''}"
                              for s in result["step_s_by_epochs"])
        lines.append(f"a step as each stretch of epochs trains: {stretches}; the run's training steps "
                     f"{result['training_steps_s_per_run']:.0f} s")
    lines.append(f"the convolutions alone, forward and backward: {result['convolutions_s_per_run']:.0f} s over the "
                 f"recipe's {result['epochs']} epochs at epoch 1's step cost, the least a run takes here if everything "
                 f"else took no time and nothing froze")
    return "\n".join(lines)
