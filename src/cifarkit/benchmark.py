"""Throughput: `cifarkit bench` (training img/s per model and precision, through the real training step) and the
inference img/s per backend that `cifarkit release` records.

Synthetic uint8 images go through the same augmentation, autocast, backward and optimizer step as a real run.
Configurations are measured in interleaved rounds and the median is kept, so a noisy neighbour on a shared machine
slows every configuration alike instead of one of them; compare the ratios, which come from one run.
"""
from __future__ import annotations

import itertools
import json
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cifarkit import distributed, models
from cifarkit.config import AugmentConfig, DataConfig, OptimConfig, ScheduleConfig
from cifarkit.data import TrainLoader
from cifarkit.device import configure, pick_precision, precision_problem
from cifarkit.errors import CifarkitError
from cifarkit.engine import ClassificationLoss, TrainState, evaluate, train_one_epoch
from cifarkit.optim import build_optimizer, build_schedule

MODES = {"fp32": ("fp32", False), "fp32+cl": ("fp32", True), "bf16+cl": ("bf16", True), "fp16+cl": ("fp16", True)}
# Random images the steps cycle through, so that more --steps cost time, not memory.
SYNTHETIC_IMAGES = 4096
EVAL_IMAGES = 10_000  # the test set's size: what rank 0 evaluates alone while the other ranks wait

log = logging.getLogger("cifarkit")


def _measure(model_name: str, mode: str, device: torch.device, batch_size: int, steps: int,
             group: distributed.Group = distributed.Group()) -> float:
    """img/s of training steps over all ranks of `group` (each rank takes its shard of every batch)."""
    precision_name, channels_last = MODES[mode]
    precision = pick_precision(precision_name, device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = models.create(model_name).to(device).to(memory_format=memory_format)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.01))
    parallel = distributed.wrap(model, group, device)
    state = TrainState(model, parallel, optimizer, build_schedule(optimizer, ScheduleConfig(), 1, steps + 1),
                       torch.amp.GradScaler(device.type, enabled=precision.grad_scaler), None,
                       after_step=lambda trained: distributed.average_buffers(trained, group))
    images = torch.randint(0, 256, (max(SYNTHETIC_IMAGES, batch_size), 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (len(images),), device=device)
    loader = TrainLoader(images, labels, batch_size, DataConfig(augment=AugmentConfig(crop_pad=4, flip=True)),
                         seed=0, memory_format=memory_format, shards=group.world_size,
                         own=range(group.rank, group.rank + 1))
    batches = loader.endless()
    loss_fn = ClassificationLoss()
    # The first step pays one-off costs (allocator, oneDNN/cuDNN kernel choice); it is run but not timed.
    train_one_epoch(state, [next(batches)], 1, batch_size, loss_fn, device, precision, None, progress=group.writes)
    stats = train_one_epoch(state, itertools.islice(batches, steps), steps, batch_size, loss_fn, device, precision,
                            None, progress=group.writes)
    return stats["images_per_s"]


def eval_throughput(model_name: str, mode: str, device: torch.device) -> float:
    """img/s of one evaluation pass (no TTA) over EVAL_IMAGES synthetic test images."""
    precision_name, channels_last = MODES[mode]
    model = models.create(model_name).to(device)
    images = torch.randint(0, 256, (EVAL_IMAGES, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (EVAL_IMAGES,))
    arguments = dict(mean=(0.5,) * 3, std=(0.25,) * 3, device=device,
                     precision=pick_precision(precision_name, device), channels_last=channels_last)
    evaluate(model, images[:1000], labels[:1000], **arguments)  # warm-up: kernel choice, allocator
    started = time.perf_counter()
    evaluate(model, images, labels, **arguments)
    return EVAL_IMAGES / (time.perf_counter() - started)


def scaling(nprocs: list[int], model_name: str, mode: str, device: torch.device, batch_size: int, steps: int,
            rounds: int) -> dict:
    """Training img/s on 1, 2, 4... processes of this machine, each count launched by torchrun as a user would
    (`cifarkit bench` under `torchrun --standalone --nproc-per-node N`), the counts interleaved round by round."""
    unequal = [n for n in nprocs if batch_size % n]
    if unequal:
        raise CifarkitError(f"--batch-size {batch_size} does not split into {unequal[0]} processes; choose one "
                            f"divisible by each of --nproc {' '.join(map(str, nprocs))}")
    samples: dict[int, list[float]] = {n: [] for n in nprocs}
    for round_ in range(1, rounds + 1):
        for n in nprocs:
            log.info("scaling: round %d of %d, %d process(es)", round_, rounds, n)
            with tempfile.TemporaryDirectory() as scratch:
                result = Path(scratch) / "bench.json"
                done = subprocess.run(distributed.torchrun(
                    n, "bench", "--models", model_name, "--modes", mode, "--batch-size", str(batch_size), "--steps",
                    str(steps), "--rounds", "1", "--device", device.type, "--json", str(result)),
                    capture_output=True, text=True)
                if done.returncode:
                    raise CifarkitError(f"the {n}-process measurement failed: "
                                        f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
                samples[n].append(json.loads(result.read_text())["results"][0]["images_per_s"])
    base_n, base = nprocs[0], statistics.median(samples[nprocs[0]])
    rows = [{"processes": n, "images_per_s": statistics.median(values), "samples": values,
             "speedup": statistics.median(values) / base,
             "efficiency": statistics.median(values) / base / (n / base_n)} for n, values in samples.items()]
    return {"model": model_name, "mode": mode, "batch_size": batch_size, "steps": steps, "rounds": rounds,
            "rows": rows, "eval_images": EVAL_IMAGES, "eval_images_per_s": eval_throughput(model_name, mode, device)}


def train_throughput(model_names, modes, device: torch.device, batch_size: int = 128, steps: int = 10,
                     rounds: int = 3, group: distributed.Group = distributed.Group()) -> list[dict]:
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise CifarkitError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    for mode in modes:
        problem = precision_problem(MODES[mode][0], device)
        if problem:
            usable = [m for m in MODES if not precision_problem(MODES[m][0], device)]
            raise CifarkitError(f"mode {mode}: {problem}; on {device.type} choose --modes from {', '.join(usable)}")
    for name in model_names:
        models.create(name)  # an unknown name fails here, listing the registered ones, before anything is timed
    configure(device)
    samples = {(m, mode): [] for m in model_names for mode in modes}
    for round_ in range(1, rounds + 1):
        log.info("measuring, round %d of %d", round_, rounds)
        for key in samples:
            samples[key].append(_measure(*key, device, batch_size, steps, group))
    rows = []
    for (model_name, mode), values in samples.items():
        baseline = statistics.median(samples[(model_name, modes[0])])
        median = statistics.median(values)
        rows.append({"model": model_name, "mode": mode, "images_per_s": median, "samples": values,
                     f"speedup_vs_{modes[0]}": median / baseline})
    return rows


def inference_throughput(classifiers: dict, pixels: np.ndarray, batch_sizes=(1, 256), rounds: int = 5,
                         seconds_per_sample: float = 0.5) -> list[dict]:
    """img/s of `Classifier.logits` (normalization + forward, from 32 x 32 uint8 pixels) per backend and batch size.

    Each sample runs batches for about `seconds_per_sample`; backends are interleaved within each round and the
    median sample is kept, so the ratios between backends survive a noisy machine.
    """
    samples = {(name, bs): [] for name in classifiers for bs in batch_sizes}
    for name, classifier in classifiers.items():  # warm-up: first calls pick kernels and fill allocator caches
        for bs in batch_sizes:
            classifier.logits(pixels[:bs])
    for _ in range(rounds):
        for (name, bs), values in samples.items():
            batch, count, start = pixels[:bs], 0, time.perf_counter()
            while time.perf_counter() - start < seconds_per_sample:
                classifiers[name].logits(batch)
                count += 1
            values.append(count * bs / (time.perf_counter() - start))
    return [{"backend": name, "batch_size": bs, "images_per_s": statistics.median(values),
             "ms_per_batch": 1000 * bs / statistics.median(values), "samples": values}
            for (name, bs), values in samples.items()]
