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
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cifarkit import models
from cifarkit.core.device import configure, pick_precision, precision_problem
from cifarkit.core.errors import CifarkitError
from cifarkit.data.config import AugmentConfig, DataConfig
from cifarkit.data.loader import TrainLoader
from cifarkit.training import distributed
from cifarkit.training.config import OptimConfig, ScheduleConfig
from cifarkit.training.engine import ClassificationLoss, TrainState, evaluate, train_one_epoch
from cifarkit.training.optim import build_optimizer, build_schedule

MODES = {"fp32": ("fp32", False), "fp32+cl": ("fp32", True), "bf16+cl": ("bf16", True), "fp16+cl": ("fp16", True)}
# Random images the steps cycle through, so that more --steps cost time, not memory.
SYNTHETIC_IMAGES = 4096
# What a CUDA configuration's steps hold. The count starts after the first step, where cuDNN's autotuning tries its
# algorithms, each in a workspace of its own: training keeps only the chosen ones'.
CUDA_PEAK = "torch.cuda.max_memory_allocated over the timed steps"
EVAL_IMAGES = 10_000  # the test set's size: what rank 0 evaluates alone while the other ranks wait

log = logging.getLogger("cifarkit")


def _measure(model_name: str, mode: str, device: torch.device, batch_size: int, steps: int,
             group: distributed.Group = distributed.Group(), progress: bool = True) -> dict:
    """img/s of training steps over all ranks of `group` (each rank takes its shard of every batch), and on CUDA the
    most memory the timed steps held (CUDA_PEAK; None elsewhere)."""
    precision_name, channels_last = MODES[mode]
    precision = pick_precision(precision_name, device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = models.create(model_name).to(device).to(memory_format=memory_format)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.01))
    parallel = distributed.wrap(model, group, device)
    state = TrainState(model, parallel, optimizer, build_schedule(optimizer, ScheduleConfig(), steps + 1, steps + 1),
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
    progress = progress and group.writes
    train_one_epoch(state, [next(batches)], 1, batch_size, loss_fn, device, precision, None, progress=progress)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = train_one_epoch(state, itertools.islice(batches, steps), steps, batch_size, loss_fn, device, precision,
                            None, progress=progress)
    return {"images_per_s": stats["images_per_s"],
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


# A fixed small workload, timed by a speed run before and after each run: this shared machine's speed swings 2x
# between hours, and a run's time means little without how fast the machine was then. fastnet's steps use the fast
# recipes' kernels; 4 steps of 256 take about a second on 2 cores, little beside any run.
PROBE = {"model": "fastnet", "batch_size": 256, "steps": 4}


def machine_speed(device: torch.device, precision_name: str) -> dict:
    """The probe's training img/s in `precision_name` with channels-last, as a run on `device` trains."""
    mode = f"{precision_name}+cl"
    return {**PROBE, "mode": mode,
            "images_per_s": _measure(PROBE["model"], mode, device, PROBE["batch_size"], PROBE["steps"],
                                     progress=False)["images_per_s"]}


def eval_throughput(model_name: str, mode: str, device: torch.device, cudnn_benchmark: bool = True) -> float:
    """img/s of one evaluation pass (no TTA) over EVAL_IMAGES synthetic test images, with cuDNN's autotuning as a
    run has it unless `cudnn_benchmark` is False."""
    precision_name, channels_last = MODES[mode]
    configure(device, cudnn_benchmark)
    model = models.create(model_name).to(device)
    images = torch.randint(0, 256, (EVAL_IMAGES, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (EVAL_IMAGES,))
    arguments = dict(mean=(0.5,) * 3, std=(0.25,) * 3, device=device,
                     precision=pick_precision(precision_name, device), channels_last=channels_last)
    evaluate(model, images[:1000], labels[:1000], **arguments)  # warm-up: kernel choice, allocator
    started = time.perf_counter()
    evaluate(model, images, labels, **arguments)
    return EVAL_IMAGES / (time.perf_counter() - started)


def _bench_process(command: list[str], what: str) -> dict:
    """The JSON that a `cifarkit bench` command, run as a process of its own, writes."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "bench.json"
        done = subprocess.run(command + ["--json", str(result)], capture_output=True, text=True)
        if done.returncode:
            raise CifarkitError(f"{what} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        return json.loads(result.read_text())


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
            measured = _bench_process(distributed.torchrun(
                n, "bench", "--models", model_name, "--modes", mode, "--batch-size", str(batch_size), "--steps",
                str(steps), "--rounds", "1", "--device", device.type), f"the {n}-process measurement")
            samples[n].append(measured["results"][0]["images_per_s"])
    base_n, base = nprocs[0], statistics.median(samples[nprocs[0]])
    rows = [{"processes": n, "images_per_s": statistics.median(values), "samples": values,
             "speedup": statistics.median(values) / base,
             "efficiency": statistics.median(values) / base / (n / base_n)} for n, values in samples.items()]
    return {"model": model_name, "mode": mode, "batch_size": batch_size, "steps": steps, "rounds": rounds,
            "rows": rows, "eval_images": EVAL_IMAGES, "eval_images_per_s": eval_throughput(model_name, mode, device)}


def train_throughput(model_names, modes, device: torch.device, batch_size: int = 128, steps: int = 10,
                     rounds: int = 3, group: distributed.Group = distributed.Group(),
                     cudnn_benchmark: bool = True) -> list[dict]:
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
    configure(device, cudnn_benchmark)
    samples = {(m, mode): [] for m in model_names for mode in modes}
    for round_ in range(1, rounds + 1):
        log.info("measuring, round %d of %d", round_, rounds)
        for key in samples:
            samples[key].append(_measure(*key, device, batch_size, steps, group))
    rates = {key: [s["images_per_s"] for s in values] for key, values in samples.items()}
    rows = []
    for (model_name, mode), values in samples.items():
        baseline = statistics.median(rates[(model_name, modes[0])])
        median = statistics.median(rates[(model_name, mode)])
        peaks = [s["peak_memory_bytes"] for s in values if s["peak_memory_bytes"] is not None]
        rows.append({"model": model_name, "mode": mode, "images_per_s": median, "samples": rates[(model_name, mode)],
                     f"speedup_vs_{modes[0]}": median / baseline, "peak_memory_bytes": max(peaks) if peaks else None})
    return rows


AMP = "amp"  # in a device report: the mixed precision a run picks on that device (fp16 on CUDA, bf16 on the CPU)
TRAIN_IMAGES = 50_000  # an epoch of CIFAR-10, for the epoch time a rate implies


def amp_mode(device: torch.device) -> str | None:
    """The MODES entry of the precision `train` picks on `device` by default (channels-last), or None if that is
    fp32."""
    precision = pick_precision("auto", device).name
    return None if precision == "fp32" else f"{precision}+cl"


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, what they count): the most this process has held for `device`'s work so far. Not on CUDA, where
    _measure restarts the count for each configuration: each result's peak_memory_bytes holds it there."""
    if device.type == "cuda":
        return None, f"per configuration, in each result's peak_memory_bytes: {CUDA_PEAK}"
    if device.type == "cpu":
        import resource  # Unix only, as this measure is
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak * (1 if sys.platform == "darwin" else 1024), "peak RSS of the process"
    return None, "not measured on this device"


def device_report(devices: list[str], model_names: list[str], modes: list[str], batch_size: int, steps: int,
                  rounds: int) -> dict:
    """Training img/s, epoch time, peak memory and inference img/s of each model on each available device, in fp32
    and `amp`, and each one's speed-up over the CPU in fp32; devices not available here are listed as skipped. On
    CUDA the last mode is measured once more with cuDNN's autotuning off, which no `cifarkit train` does, to show
    what the autotuning gains. `comparisons` reads the rows as the GPU tables (gpu_comparisons).

    Each training measurement is a process of its own (`cifarkit bench` for one model, mode and device), so that its
    peak memory is its own: a process's peak RSS never comes down, its allocator keeps what it freed, and cuDNN keeps
    the algorithms it chose. The processes are interleaved round by round, and each configuration keeps its median
    rate and its largest peak.
    """
    if "cpu" not in devices or "fp32" not in modes:
        raise CifarkitError("the device report measures speed-ups against the CPU in fp32: include cpu in --devices "
                            "and fp32 in --modes")
    for name in model_names:
        models.create(name)  # an unknown name fails here, listing the registered ones, before anything is timed
    configs, skipped = _device_configs(devices, model_names, modes)
    samples: dict[tuple, list[dict]] = {c: [] for c in configs}
    for round_ in range(1, rounds + 1):
        for config in configs:
            device, model, _, key, tuned = config
            what = f"{model} {key} on {device.type}" + (", cuDNN autotuning off" if tuned is False else "")
            log.info("round %d of %d: %s", round_, rounds, what)
            off = ["--no-cudnn-benchmark"] if tuned is False else []
            measured = _bench_process([sys.executable, "-m", "cifarkit", "bench", "--models", model, "--modes", key,
                                       "--device", device.type, "--batch-size", str(batch_size), "--steps",
                                       str(steps), "--rounds", "1", *off], f"measuring {what}")
            result = measured["results"][0]
            peak = measured["peak_memory"] if result["peak_memory_bytes"] is None else {
                "bytes": result["peak_memory_bytes"], "kind": CUDA_PEAK}
            samples[config].append({"images_per_s": result["images_per_s"], **peak})
    rates = {c: statistics.median(s["images_per_s"] for s in values) for c, values in samples.items()}
    baseline = {c[1]: rate for c, rate in rates.items() if c[0].type == "cpu" and c[2] == "fp32"}
    rows = []
    for config, values in samples.items():
        device, model, mode, key, tuned = config
        peaks = [s["bytes"] for s in values if s["bytes"] is not None]
        rows.append({"device": device.type, "model": model, "mode": mode, "measured_as": key,
                     "cudnn_benchmark": tuned, "images_per_s": rates[config],
                     "samples": [s["images_per_s"] for s in values], "epoch_s": TRAIN_IMAGES / rates[config],
                     "speedup_vs_cpu_fp32": rates[config] / baseline[model],
                     "peak_memory_bytes": max(peaks) if peaks else None, "peak_memory_kind": values[0]["kind"],
                     "inference_images_per_s": eval_throughput(model, key, device, tuned is not False)})
    return {"batch_size": batch_size, "steps": steps, "rounds": rounds, "eval_images": EVAL_IMAGES, "rows": rows,
            "comparisons": gpu_comparisons(rows), "skipped": skipped}


def _device_configs(devices: list[str], model_names: list[str], modes: list[str]) -> tuple[list[tuple], dict]:
    """(device, model, mode, the MODES entry it runs as, cuDNN autotuning: None where there is no cuDNN) of each
    measurement of the device report, and {what: why} of each one that cannot run here."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    configs, skipped = [], {}
    for name in devices:
        if not available[name]:
            skipped[name] = "not available here"
            continue
        device = torch.device(name)
        for mode in modes:
            key = amp_mode(device) if mode == AMP else mode
            problem = "no mixed precision on this device" if key is None else precision_problem(MODES[key][0], device)
            if problem:
                skipped[f"{name} {mode}"] = problem
            elif name != "cuda":
                configs.extend((device, model, mode, key, None) for model in model_names)
            else:
                tunings = (True, False) if mode == modes[-1] else (True,)
                configs.extend((device, model, mode, key, tuned) for tuned in tunings for model in model_names)
    return configs, skipped


def gpu_comparisons(rows: list[dict]) -> dict:
    """A device report's rows read as the GPU tables of the write-ups cifarkit started from, for every device but the
    CPU: `against_cpu`, each configuration's training rate against the CPU's in the same mode (the GPU's speed-up);
    `against_fp32`, each mode's rate and peak memory against fp32's on that device (fp32 against AMP);
    `autotuning`, cuDNN's autotuning on against off. All empty where only the CPU was measured. Each model's rows
    stand together, in the order of the report's."""
    order = list(dict.fromkeys(r["model"] for r in rows))
    tuned = {(r["device"], r["model"], r["mode"]): r for r in rows if r.get("cudnn_benchmark") is not False}
    found = {"against_cpu": [], "against_fp32": [], "autotuning": []}
    for r in sorted(rows, key=lambda r: order.index(r["model"])):
        if r["device"] == "cpu":
            continue
        same = {"device": r["device"], "model": r["model"], "mode": r["mode"], "measured_as": r["measured_as"]}
        if r.get("cudnn_benchmark") is False:
            on = tuned[(r["device"], r["model"], r["mode"])]
            found["autotuning"].append({**same, "epoch_s_on": on["epoch_s"], "epoch_s_off": r["epoch_s"],
                                        "speedup": on["images_per_s"] / r["images_per_s"]})
            continue
        cpu = tuned.get(("cpu", r["model"], r["mode"]))
        if cpu:
            found["against_cpu"].append({**same, "cpu_measured_as": cpu["measured_as"],
                                         "cpu_epoch_s": cpu["epoch_s"], "epoch_s": r["epoch_s"],
                                         "speedup": r["images_per_s"] / cpu["images_per_s"]})
        fp32 = tuned[(r["device"], r["model"], "fp32")]
        memory = (r["peak_memory_bytes"], fp32["peak_memory_bytes"])
        found["against_fp32"].append({**same, "epoch_s": r["epoch_s"],
                                      "speedup": r["images_per_s"] / fp32["images_per_s"],
                                      "peak_memory_bytes": r["peak_memory_bytes"],
                                      "memory_vs_fp32": None if None in memory else memory[0] / memory[1]})
    return found


# A throughput ratio says nothing of accuracy, so it is never printed or recorded without this.
SPEED_ONLY = ("speed only: these steps measure no accuracy, which a change of precision, device or processes may move; "
              "`cifarkit speedrun` measures it")


def _mode(row: dict) -> str:
    return row["mode"] if row["mode"] == row["measured_as"] else f"{row['mode']} ({row['measured_as']})"


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 10 else f"{seconds:.2f} s"  # a GPU's epoch may take under a second


def _memory(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.0f} MiB"


def device_table(result: dict) -> str:
    """The device report as a markdown table (also what lab/render_readme.py puts in the README)."""
    lines = ["| device | model | mode | train img/s | epoch | vs CPU fp32 | peak memory | inference img/s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        mode = _mode(r) + (", cuDNN autotuning off" if r.get("cudnn_benchmark") is False else "")
        lines.append(f"| {r['device']} | {r['model']} | {mode} | {r['images_per_s']:,.0f} | {_seconds(r['epoch_s'])} | "
                     f"{r['speedup_vs_cpu_fp32']:.2f}x | {_memory(r['peak_memory_bytes'])} | "
                     f"{r['inference_images_per_s']:,.0f} |")
    return "\n".join(lines)


# gpu_comparisons' tables: the line above each, the columns after device, model and mode, and their cells.
COMPARISON_TABLES = {
    "against_cpu": (
        "Each device against the CPU in the same mode (an epoch: 50,000 images at the training rate measured)",
        ("epoch on the CPU", "epoch", "speed-up over the CPU"),
        lambda c: (_seconds(c["cpu_epoch_s"]) + ("" if c["cpu_measured_as"] == c["measured_as"]
                                                  else f" ({c['cpu_measured_as']})"),
                   _seconds(c["epoch_s"]), f"{c['speedup']:.2f}x")),
    "against_fp32": (
        "Each mode against fp32 on the same device: time and peak memory (on CUDA `torch.cuda.max_memory_allocated` "
        "over the timed steps, in a process that measured this configuration alone)",
        ("epoch", "speed-up over fp32", "peak memory", "memory over fp32"),
        lambda c: (_seconds(c["epoch_s"]), f"{c['speedup']:.2f}x", _memory(c["peak_memory_bytes"]),
                   "-" if c["memory_vs_fp32"] is None else f"{c['memory_vs_fp32']:.2f}x")),
    "autotuning": (
        "cuDNN's autotuning (`torch.backends.cudnn.benchmark`, on in every `cifarkit train` on CUDA) on against off",
        ("epoch, autotuning on", "epoch, off", "speed-up from autotuning"),
        lambda c: (_seconds(c["epoch_s_on"]), _seconds(c["epoch_s_off"]), f"{c['speedup']:.2f}x")),
}


def comparison_tables(comparisons: dict) -> str:
    """gpu_comparisons as markdown tables, each under a line that says what it compares; "" where there are none."""
    blocks = []
    for key, (title, columns, cells) in COMPARISON_TABLES.items():
        if comparisons[key]:
            blocks.append("\n".join([f"{title}:", "", "| device | model | mode | " + " | ".join(columns) + " |",
                                     "|---|---|---|" + "---:|" * len(columns),
                                     *(f"| {c['device']} | {c['model']} | {_mode(c)} | " + " | ".join(cells(c)) + " |"
                                       for c in comparisons[key])]))
    return "\n\n".join(blocks)


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
