"""run(recipe): seeding, resume, the epoch loop and the run folder.

Run folder: config.yaml, train.log, metrics.jsonl, tb/, curves.png, checkpoints/last.pt, model.safetensors,
summary.json. The test set is only ever measured; when a checkpoint is chosen, it is chosen on `data.val_split`.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import shlex
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import yaml
from torch import nn

from cifarkit import models
from cifarkit.artifacts import weights
from cifarkit.core import allocator
from cifarkit.core.constants import VERSION
from cifarkit.core.device import (
    Precision,
    configure,
    cpu_features,
    describe,
    isa_caps,
    pick_device,
    pick_precision,
    report,
)
from cifarkit.core.errors import LOG_FORMAT, CifarkitError, first_line
from cifarkit.core.files import portable, write_json, write_text
from cifarkit.data import cifar10
from cifarkit.data.loader import TrainLoader, normalize
from cifarkit.training import checkpoint, distributed, plots
from cifarkit.training.config import Recipe, TrainConfig, recipe_from_dict, steps_in, to_dict
from cifarkit.training.engine import (
    EVAL_BATCH_ACCELERATOR,
    ClassificationLoss,
    DistillationLoss,
    DivergenceError,
    HardestSelector,
    TrainState,
    evaluate,
    train_one_epoch,
    tta_logits,
)
from cifarkit.training.optim import build_ema, build_lookahead, build_optimizer, build_schedule, split_by_train_steps
from cifarkit.training.tracking import git_source, open_tracker, require_mlflow

log = logging.getLogger("cifarkit")


def default_out(recipe: Recipe) -> Path:
    return Path("runs") / f"{recipe.name}-{datetime.now():%Y%m%d-%H%M%S}"


def _attach_log_file(path: Path) -> logging.Handler:
    """train.log gets the same lines as the console, however the caller configured logging."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def _read_metrics(path: Path, up_to_epoch: int) -> list[dict]:
    """Metrics of the epochs the checkpoint covers; lines a killed run wrote after its last checkpoint are dropped."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["epoch"] <= up_to_epoch]


def _versions() -> dict:
    import numpy
    # From its installed metadata: importing torchvision only to read its version would add its import to every run.
    return {"cifarkit": VERSION, "torch": str(torch.__version__),
            "torchvision": importlib.metadata.version("torchvision"), "numpy": numpy.__version__}


@dataclass
class _Setup:
    """Everything a run needs before its first step. Built before the run folder exists, so a bad value, missing
    data or a broken teacher fails without leaving a half-made folder behind."""
    device: torch.device
    precision: Precision
    memory_format: torch.memory_format
    group: distributed.Group
    dataset: cifar10.Cifar10
    loader: TrainLoader
    val: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    state: TrainState
    loss_fn: ClassificationLoss
    run_info: dict


def run(recipe: Recipe | None = None, out: Path | None = None, resume: Path | None = None) -> dict | None:
    """Train a recipe into a run folder (or continue the one at `resume`) and return its summary.

    Under torchrun, every rank calls this and trains its shard of each batch; rank 0 alone writes (and returns the
    summary; the others return None). A group that torchrun restarts after a failure resumes the run in `out`.
    """
    started = time.perf_counter()
    group = distributed.launched()
    if resume is None and out is not None and distributed.restarted() and (Path(out) / "config.yaml").exists():
        resume = out
    if resume is None and out is None and group.distributed and distributed.may_restart():
        raise CifarkitError("a restarted group resumes its run from --out: give --out FOLDER with --max-restarts")
    resumed = None
    if resume is not None:
        out = Path(resume)
        recipe, resumed = _read_run(out)
        # A checkpoint without world_size predates distributed training: one process wrote it.
        trained_by = resumed.get("world_size", 1) if resumed else group.world_size
        if trained_by != group.world_size:
            raise CifarkitError(f"{out} was trained by {trained_by} process(es) and this is {group.world_size}: its "
                                f"batches were cut {trained_by} ways; resume it with {trained_by} (cifarkit train "
                                f"--nproc {trained_by} --resume ...)")
    elif group.writes:
        out = Path(out) if out is not None else default_out(recipe)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise CifarkitError(f"{out} already holds a run; continue it with --resume {out} or pick another --out")
    device = distributed.init(group, pick_device(recipe.train.device), recipe.train.dist_backend)
    try:
        out = distributed.agree(group, out)
        setup = prepare(recipe, group, device)
        if not group.writes:
            return _train(recipe, setup, out, resumed, started)
        try:
            (out / "checkpoints").mkdir(parents=True, exist_ok=True)
            if not (out / "config.yaml").exists():  # first thing in the folder: from here on, --resume continues it
                write_text(out / "config.yaml",
                           yaml.safe_dump({**to_dict(recipe), "run": setup.run_info}, sort_keys=False))
            handler = _attach_log_file(out / "train.log")
            try:
                return _train(recipe, setup, out, resumed, started)
            finally:
                log.removeHandler(handler)
                handler.close()
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_interrupted(out)) from None
    finally:
        distributed.finish(group)


def _interrupted(out: Path) -> str:
    """The line a Ctrl-C leaves: the exact command that continues the run, from any working folder."""
    if not (out / "config.yaml").exists():
        return f"interrupted before the run started; delete {out} and start the run again"
    return f"interrupted; continue this run with `cifarkit train --resume {shlex.quote(str(out.resolve()))}`"


def _read_run(out: Path) -> tuple[Recipe, dict | None]:
    """(the recipe a run folder was started with, its last checkpoint or None if no epoch has finished yet)."""
    config_path = out / "config.yaml"
    if not config_path.is_file():
        raise CifarkitError(f"{out} is not a run folder (no config.yaml); give the folder a run wrote")
    if (out / "summary.json").is_file():
        raise CifarkitError(f"{out} has finished already (it has summary.json); nothing to resume")
    last = out / "checkpoints" / "last.pt"
    return read_recipe(out), (checkpoint.load_training(last) if last.exists() else None)


def read_recipe(out: Path) -> Recipe:
    """The recipe a run folder was started with: its config.yaml, less the facts of the run."""
    return _read_config(out, lambda resolved: recipe_from_dict({k: v for k, v in resolved.items() if k != "run"}))


def read_run_facts(out: Path) -> dict:
    """The facts of the run that config.yaml records beside its recipe (versions, allocator, CPU features)."""
    return _read_config(out, lambda resolved: resolved["run"])


def _read_config(out: Path, part):
    config_path = out / "config.yaml"
    try:
        resolved = yaml.safe_load(config_path.read_text())
        if not isinstance(resolved, dict):
            raise CifarkitError("not a mapping of recipe sections")
        return part(resolved)
    except (yaml.YAMLError, UnicodeDecodeError, CifarkitError, TypeError, ValueError, KeyError) as e:
        raise CifarkitError(f"{config_path} is damaged ({first_line(e)}); restore it, or start a new run with "
                            f"`cifarkit train --out NEW_FOLDER`") from None


def prepare(recipe: Recipe, group: distributed.Group, device: torch.device) -> _Setup:
    cfg = recipe.train
    torch.manual_seed(cfg.seed)
    shards = group.world_size * cfg.accumulate_steps
    if cfg.batch_size % shards:
        raise CifarkitError(f"train.batch_size {cfg.batch_size} does not split into {group.world_size} process(es) x "
                            f"{cfg.accumulate_steps} micro-batch(es); choose a batch size divisible by {shards}")
    if cfg.select_fraction is not None and shards > 1:
        raise CifarkitError("train.select_fraction ranks whole batches in one process; train with one process and "
                            "train.accumulate_steps 1, or remove the setting")
    precision = pick_precision(cfg.precision, device)
    if cfg.track == "mlflow":
        require_mlflow()  # missing, it fails here, before a run folder exists
    configure(device)
    if cfg.compiles(device.type) and device.type != "cuda":
        # torch.compile's toolchain probe warns that CUDA_HOME holds no CUDA runtime: true, and of no concern here.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    dataset = cifar10.load()
    train_idx, val_idx = cifar10.split_train(dataset.train_y, recipe.data.val_split, recipe.data.subset, cfg.seed)
    # Everything lives on the training device from here on: batches are sliced and augmented there, no workers.
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    mine = range(group.rank * cfg.accumulate_steps, (group.rank + 1) * cfg.accumulate_steps)
    loader = TrainLoader(dataset.train_x[train_idx].to(device), dataset.train_y[train_idx].to(device),
                              cfg.batch_size, recipe.data, cfg.seed, memory_format, shards=shards, own=mine)
    val = dataset.train_x[val_idx].to(device), dataset.train_y[val_idx].to(device)
    test = dataset.test_x.to(device), dataset.test_y.to(device)
    state = _build_state(recipe, loader, device, precision, memory_format, group)
    run_info = {"versions": _versions(), "device": str(device), "precision": precision.name,
                "allocator": allocator.in_use(), "cpu_features": cpu_features(), "dataset_sha256": dataset.sha256,
                "train_images": len(loader.images), "val_images": len(val[0]), "threads": torch.get_num_threads()}
    # Which code trained the run, where it runs from a git checkout; asked by the rank that writes the run only.
    if group.writes and (source := git_source()):
        run_info["source"] = source
    if caps := isa_caps():  # imitating an older CPU: cpu_features are the capped ones, and this says why
        run_info["isa_caps"] = caps
    orthogonalize_dtype = getattr(state.optimizer, "orthogonalize_dtype", None)
    if orthogonalize_dtype is not None:  # Muon's Newton-Schulz precision, which need not be the training precision
        run_info["newton_schulz_dtype"] = str(orthogonalize_dtype).removeprefix("torch.")
    if group.distributed:
        run_info["processes"] = {"world_size": group.world_size, "backend": torch.distributed.get_backend(),
                                 "images_per_rank_per_step": cfg.batch_size // group.world_size}
    # After the model: the teacher's init draws random numbers.
    loss_fn = _loss(recipe, loader, device, precision, memory_format, run_info)
    return _Setup(device, precision, memory_format, group, dataset, loader, val, test, state, loss_fn, run_info)


def _train(recipe: Recipe, setup: _Setup, out: Path, resumed: dict | None, started: float) -> dict | None:
    cfg = recipe.train
    device, precision, loader, state = setup.device, setup.precision, setup.loader, setup.state
    warmup_s = warm_up(recipe, setup) if warms_up(cfg, device) else 0.0
    started += warmup_s  # off the clock, and recorded apart
    if not setup.group.writes:
        return _train_shard(recipe, setup, resumed)
    (val_x, _), (test_x, test_y) = setup.val, setup.test
    model, optimizer = state.model, state.optimizer
    mean, std = recipe.data.mean, recipe.data.std
    for line in describe(report(device)):
        log.info(line)
    if "teacher" in setup.run_info:
        teacher = setup.run_info["teacher"]
        log.info("distilling from %s (%s), temperature %g, weight %g, targets %s", teacher["release"],
                 teacher["model"], recipe.distill.temperature, recipe.distill.weight,
                 f"the teacher's TTA logits of each image, computed in {teacher['targets_s']:.1f} s"
                 if "targets_s" in teacher else "live, on each augmented batch")
    start_epoch, elapsed, train_time, best = 0, 0.0, 0.0, {"val_acc": -1.0, "epoch": None}
    if resumed is not None:
        checkpoint.restore_training(state, resumed)
        start_epoch, elapsed, train_time, best = (resumed["epoch"], resumed["elapsed_s"], resumed["train_time_s"],
                                                  resumed["best"])
        log.info("resuming %s after epoch %d of %g", out, start_epoch, cfg.epochs)
    log.info("recipe %s: model %s (%s params), images: %d train / %d val, batch %d, epochs %g, precision %s",
             recipe.name, recipe.model.name, f"{models.count_params(model):,}", len(loader.images), len(val_x),
             cfg.batch_size, cfg.epochs, precision.name)

    from torch.utils.tensorboard import SummaryWriter
    records = _read_metrics(out / "metrics.jsonl", start_epoch)
    writer = SummaryWriter(str(out / "tb"), purge_step=start_epoch + 1)
    tracker = open_tracker(cfg.track, out, to_dict(recipe), setup.run_info)
    for record in records:  # epochs a stopped run finished but did not get to send (the tracker skips the rest)
        tracker.log_epoch(record)
    eval_args = dict(mean=mean, std=std, device=device, precision=precision, channels_last=cfg.channels_last,
                     tta_share=cfg.tta_share)  # the share matters only where an evaluation has TTA
    steps = cfg.steps_by_epoch(loader.steps_per_epoch)
    last_epoch = len(steps)
    try:
        for epoch in range(start_epoch + 1, last_epoch + 1):
            try:
                freeze_for_epoch(state, cfg, epoch)
                stats = train_one_epoch(state, loader.epoch(epoch, steps[epoch - 1]), steps[epoch - 1],
                                        cfg.batch_size, setup.loss_fn, device, precision, cfg.grad_clip,
                                        description=f"epoch {epoch}/{last_epoch}")
            except DivergenceError as e:
                tracker.stop("FAILED")
                kept = (f"the checkpoint of epoch {epoch - 1} is kept in {out / 'checkpoints' / 'last.pt'}"
                        if epoch > 1 else "no epoch had finished, so there is no checkpoint")
                raise DivergenceError(e.step, f"epoch {epoch}", kept) from None
            train_time += stats["epoch_time_s"]
            record = {"epoch": epoch, **stats, "lr": optimizer.param_groups[0]["lr"]}
            eval_model = state.ema.module if state.ema is not None else model
            if epoch % cfg.eval_every == 0 or epoch == last_epoch:
                best = _evaluate_epoch(record, best, eval_model, recipe, setup, epoch, out, eval_args,
                                       final=epoch == last_epoch)
            record["elapsed_s"] = elapsed + time.perf_counter() - started
            records.append(record)
            _log_epoch(record, writer)
            write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
            if cfg.checkpoints:
                checkpoint.save_training(out / "checkpoints" / "last.pt", state, epoch, {
                    "elapsed_s": elapsed + time.perf_counter() - started, "train_time_s": train_time, "best": best,
                    "world_size": setup.group.world_size})
            tracker.log_epoch(record)  # after the checkpoint: a resumed run sends what the kill kept from it
    except KeyboardInterrupt:
        tracker.stop("KILLED")
        raise
    finally:
        writer.close()

    # From here on nothing trains: a run killed after its last checkpoint resumes straight into these lines.
    plots.curves(records, out / "curves.png")
    if best["epoch"] is None:  # no validation split: the final weights, whose test metrics the last epoch has
        final_model = state.ema.module if state.ema is not None else model
        selected_epoch = last_epoch
        test = {"acc": records[-1]["test_acc"], "loss": records[-1]["test_loss"]}
    else:
        final_model, _ = weights.load_weights(out / "checkpoints" / "best.safetensors")
        final_model = final_model.to(device).to(memory_format=setup.memory_format)
        selected_epoch = best["epoch"]
        log.info("measuring the test accuracy of epoch %d's weights, chosen on validation%s", selected_epoch,
                 " (with test-time augmentation)" if cfg.tta else "")
        test = evaluate(final_model, test_x, test_y, tta=cfg.tta, progress="TTA" if cfg.tta else None, **eval_args)
    weights.save_weights(out / "model.safetensors", final_model, recipe.model.name, mean, std,
                            recipe=recipe.name, epoch=selected_epoch)
    summary = {
        "recipe": recipe.name, "model": recipe.model.name, "test_acc": test["acc"], "test_loss": test["loss"],
        "selected_epoch": selected_epoch, "selected_by": "val_acc" if best["epoch"] is not None else "last epoch",
        "epochs": cfg.epochs, "wall_time_s": elapsed + time.perf_counter() - started, "train_time_s": train_time,
        "warmup_s": warmup_s, "params": models.count_params(final_model), "device": str(device),
        "precision": precision.name, "seed": cfg.seed, "torch": str(torch.__version__),
        "dataset_sha256": setup.dataset.sha256,
    }
    write_json(out / "summary.json", summary)
    tracker.finish(summary)
    log.info("done: test accuracy %.2f%% (epoch %d), wall time %.1f s, run folder %s",
             100 * summary["test_acc"], selected_epoch, summary["wall_time_s"], out)
    return summary


def _evaluate_epoch(record: dict, best: dict, model: nn.Module, recipe: Recipe, setup: _Setup, epoch: int, out: Path,
                    eval_args: dict, final: bool) -> dict:
    """Add an evaluated epoch's validation and test metrics to `record`, and return the best epoch so far on
    validation, whose weights are saved. TTA (several passes per image) only for the final measurement: progress
    checks stay cheap."""
    cfg = recipe.train
    (val_x, val_y), (test_x, test_y) = setup.val, setup.test
    tta = cfg.tta and final
    if len(val_x):
        val = evaluate(model, val_x, val_y, **eval_args)
        record.update(val_loss=val["loss"], val_acc=val["acc"])
        if val["acc"] > best["val_acc"]:  # single views at every epoch: like compared with like
            best = {"val_acc": val["acc"], "epoch": epoch}
            weights.save_weights(out / "checkpoints" / "best.safetensors", model, recipe.model.name,
                                    recipe.data.mean, recipe.data.std, epoch=epoch)
        if tta:  # read as the test set will be, so that tuning on validation predicts the test figure
            val = evaluate(model, val_x, val_y, tta=True, **eval_args)
            record.update(val_tta_loss=val["loss"], val_tta_acc=val["acc"])
    if tta:
        log.info("epoch %d trained; measuring the test accuracy with test-time augmentation", epoch)
    test = evaluate(model, test_x, test_y, tta=tta, progress="TTA" if tta else None, **eval_args)
    record.update(test_loss=test["loss"], test_acc=test["acc"])
    return best


def _train_shard(recipe: Recipe, setup: _Setup, resumed: dict | None) -> None:
    """A rank other than 0: the same steps on its shards of the batches, and nothing written, logged or measured."""
    cfg, state = recipe.train, setup.state
    start_epoch = 0
    if resumed is not None:
        checkpoint.restore_training(state, resumed)
        start_epoch = resumed["epoch"]
    steps = cfg.steps_by_epoch(setup.loader.steps_per_epoch)
    for epoch in range(start_epoch + 1, len(steps) + 1):
        freeze_for_epoch(state, cfg, epoch)
        train_one_epoch(state, setup.loader.epoch(epoch, steps[epoch - 1]), steps[epoch - 1], cfg.batch_size,
                        setup.loss_fn, setup.device, setup.precision, cfg.grad_clip, progress=False)


WARMUP_STEPS = 2  # per freeze state: the first compiles and autotunes, the second shows nothing is left to do


def warms_up(cfg: TrainConfig, device: torch.device) -> bool:
    """On CUDA, where cuDNN autotunes each new shape, and wherever the model is compiled."""
    return device.type == "cuda" or cfg.compiles(device.type)


def warm_up(recipe: Recipe, setup: _Setup) -> float:
    """Seconds spent before the clock starts, as airbench times its runs: a few steps at the run's shapes in each
    freeze state its epochs go through (torch.compile specializes on which parameters train, and the early epochs
    may crop), and one evaluation batch. torch.compile compiles and cuDNN autotunes here, on the run's own model,
    whose whole training state is then put back exactly: the run trains as if there had been no warm-up."""
    cfg, state, loader = recipe.train, setup.state, setup.loader
    if cfg.compiles(setup.device.type) and setup.group.writes:
        log.info("compiling the model with torch.compile at the run's shapes, before the clock: often a minute")
    started = time.perf_counter()
    kept = checkpoint.snapshot(state)
    shapes = set()
    for epoch, steps in enumerate(cfg.steps_by_epoch(loader.steps_per_epoch), 1):
        freeze_for_epoch(state, cfg, epoch)
        shape = (tuple(p.requires_grad for p in state.model.parameters()), loader.crop(epoch))
        if shape not in shapes:
            shapes.add(shape)
            count = min(WARMUP_STEPS, steps)
            train_one_epoch(state, loader.epoch(epoch, count), count, cfg.batch_size, setup.loss_fn, setup.device,
                            setup.precision, cfg.grad_clip, progress=False)
    if setup.group.writes:  # the final evaluation's batch shape, on training images: the test set is not touched
        evaluate(state.model, loader.images[:EVAL_BATCH_ACCELERATOR], loader.labels[:EVAL_BATCH_ACCELERATOR],
                 recipe.data.mean, recipe.data.std, setup.device, setup.precision, channels_last=cfg.channels_last,
                 tta=cfg.tta)
    checkpoint.restore_training(state, kept)
    seconds = time.perf_counter() - started
    if setup.group.writes:
        log.info("warmed up at the run's shapes in %.1f s (compilation, autotuning), before the clock starts", seconds)
    return seconds


def freeze_for_epoch(state: TrainState, cfg: TrainConfig, epoch: int) -> None:
    """airbench's whitening-bias freeze and the conv groups' (`train.group_train_epochs`): set from the epoch alone,
    so a resumed run freezes where the unbroken one did. Only what the optimizer trains is switched (a BatchNorm
    scale frozen for good stays so). The optimizer skips a parameter without a gradient, so its momentum stops."""
    model = state.model
    if cfg.whiten_bias_epochs is not None:
        model.whiten.bias.requires_grad_(epoch <= cfg.whiten_bias_epochs)
    if cfg.group_train_epochs:
        trained = optimized_parameters(state.optimizer)
        for conv_group, epochs in zip(model.conv_groups, cfg.group_train_epochs):
            for p in conv_group.parameters():
                if p in trained:
                    p.requires_grad_(epoch <= epochs)


def optimized_parameters(optimizer: torch.optim.Optimizer) -> set[torch.Tensor]:
    """The parameters an optimizer steps, frozen for now or not; those left out at its making stay frozen."""
    return {p for group in optimizer.param_groups for p in group["params"]}


def _build_state(recipe: Recipe, loader: TrainLoader, device: torch.device, precision, memory_format,
                 group: distributed.Group) -> TrainState:
    cfg = recipe.train
    model = models.create(recipe.model.name, recipe.model.norm_momentum).to(device)
    if cfg.whiten_bias_epochs is not None and not isinstance(getattr(model, "whiten", None), nn.Conv2d):
        raise CifarkitError(f"train.whiten_bias_epochs is set, but model {recipe.model.name} has no whitening layer; "
                            "remove the setting (or use fastnet)")
    groups = len(getattr(model, "conv_groups", ()))
    if cfg.group_train_epochs is not None and len(cfg.group_train_epochs) > groups:
        raise CifarkitError(f"train.group_train_epochs={list(cfg.group_train_epochs)} lists more conv groups than "
                            f"model {recipe.model.name} has ({groups}); list at most {groups}, or use a fastnet model")
    sample = _init_sample(recipe, loader)
    _init_from_data(model, sample)
    if cfg.sync_bn:
        model = distributed.sync_batchnorm(model, group, device)
    model = model.to(memory_format=memory_format)
    optimizer, scheduler, scaler = _optimization(model, recipe, loader, device, precision)
    # A parameter that stops training mid-run must be found unused by DDP, or its reducer waits for its gradient.
    freezes = cfg.whiten_bias_epochs is not None or bool(cfg.group_train_epochs)
    parallel = distributed.wrap(model, group, device, find_unused_parameters=freezes)
    return TrainState(
        model=model,
        forward=torch.compile(parallel, mode=cfg.compile_mode) if cfg.compiles(device.type) else parallel,
        no_sync=getattr(parallel, "no_sync", contextlib.nullcontext),
        after_step=lambda trained: distributed.average_buffers(trained, group),
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        ema=build_ema(model, cfg.ema_decay),
        lookahead=build_lookahead(model, cfg.lookahead_every, cfg.lookahead_decay,
                                  total_steps=cfg.total_steps(loader.steps_per_epoch)),
        selector=_build_selector(recipe, loader, device, precision, memory_format, sample),
    )


def _optimization(model: nn.Module, recipe: Recipe, loader: TrainLoader, device: torch.device, precision):
    """(optimizer, lr schedule, grad scaler) for a model, from the recipe."""
    optimizer = build_optimizer(model, recipe.optim)
    cfg = recipe.train
    steps = {}  # parameters whose lr reaches the schedule's end early: id -> their steps
    if cfg.group_lr_anneal:  # the recipe's checks made sure that groups freeze
        steps.update({id(p): epochs * loader.steps_per_epoch for conv_group, epochs
                      in zip(model.conv_groups, cfg.group_train_epochs) for p in conv_group.parameters()})
    # Checked too: the bias freezes no sooner, on a linear schedule. A selection proxy never trains its bias.
    if cfg.whiten_bias_anneal_epochs is not None and hasattr(model, "whiten"):
        steps[id(model.whiten.bias)] = steps_in(cfg.whiten_bias_anneal_epochs, loader.steps_per_epoch)
    if steps:
        split_by_train_steps(optimizer, steps)
    scheduler = build_schedule(optimizer, recipe.schedule, cfg.total_steps(loader.steps_per_epoch),
                               loader.steps_per_epoch)
    return optimizer, scheduler, torch.amp.GradScaler(device.type, enabled=precision.grad_scaler)


def _init_sample(recipe: Recipe, loader: TrainLoader) -> torch.Tensor:
    """5,000 normalized training images for data-dependent initialization. Every rank holds the whole training set
    and draws the same sample: the same filters everywhere."""
    sample = torch.randperm(len(loader.images), generator=torch.Generator().manual_seed(recipe.train.seed))[:5000]
    return normalize(loader.images[sample.to(loader.images.device)], recipe.data.mean, recipe.data.std)


def _init_from_data(model: nn.Module, sample: torch.Tensor) -> None:
    """Data-dependent initialization, e.g. FastNet's whitening filters."""
    if hasattr(model, "init_from_data"):
        model.init_from_data(sample)


def _build_selector(recipe: Recipe, loader: TrainLoader, device: torch.device, precision,
                    memory_format, sample: torch.Tensor) -> HardestSelector | None:
    """The proxy that ranks each batch's images for train.select_fraction: its own model, built from the recipe's
    optimizer and schedule, as airbench96 trains its proxy with its main net's settings."""
    cfg = recipe.train
    if cfg.select_fraction is None:
        return None
    proxy = models.create(cfg.select_proxy).to(device)
    _init_from_data(proxy, sample)
    if isinstance(getattr(proxy, "whiten", None), nn.Conv2d):
        proxy.whiten.bias.requires_grad_(False)  # airbench96's proxy never trains it: ranking needs no more
    proxy = proxy.to(memory_format=memory_format)
    optimizer, scheduler, scaler = _optimization(proxy, recipe, loader, device, precision)
    state = TrainState(model=proxy, forward=proxy, optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=None)
    return HardestSelector(state, cfg.select_fraction, cfg.select_proxy_every, cfg.label_smoothing, device, precision)


def _loss(recipe: Recipe, loader: TrainLoader, device: torch.device, precision, memory_format,
          run_info: dict) -> ClassificationLoss:
    distill = recipe.distill
    if distill.teacher is None:
        return ClassificationLoss(recipe.train.label_smoothing)
    from cifarkit.artifacts.releases import release_dir
    folder = release_dir(distill.teacher)
    teacher, meta = weights.load_weights(folder)
    if tuple(meta["mean"]) != tuple(recipe.data.mean) or tuple(meta["std"]) != tuple(recipe.data.std):
        raise CifarkitError(f"teacher {folder} normalizes with mean {meta['mean']} / std {meta['std']}, the recipe "
                            f"with {recipe.data.mean} / {recipe.data.std}; set data.mean and data.std to the teacher's")
    run_info["teacher"] = {"release": portable(folder), "model": meta["model"]}
    teacher = teacher.to(device).to(memory_format=memory_format)
    if distill.targets == "tta":
        started = time.perf_counter()
        loader.targets = tta_logits(teacher, loader.images, recipe.data.mean, recipe.data.std, device, precision,
                                    recipe.train.channels_last, progress="teacher's TTA targets").to(device)
        run_info["teacher"]["targets_s"] = time.perf_counter() - started
        teacher = None  # its work is done: the loader hands each batch its targets
    return DistillationLoss(teacher, distill.temperature, distill.weight, recipe.train.label_smoothing)


def _log_epoch(record: dict, writer) -> None:
    epoch = record["epoch"]
    parts = [f"epoch {epoch}", f"train loss {record['train_loss']:.4f} acc {100 * record['train_acc']:.2f}%"]
    for split in ("val", "val_tta", "test"):
        if f"{split}_acc" in record:
            parts.append(f"{split.replace('_tta', ' TTA')} loss {record[f'{split}_loss']:.4f} "
                         f"acc {100 * record[f'{split}_acc']:.2f}%")
    parts.append(f"lr {record['lr']:.3g}, {record['epoch_time_s']:.1f} s, {record['images_per_s']:.0f} img/s")
    log.info(" | ".join(parts))
    tags = {"Loss/train": "train_loss", "Accuracy/train": "train_acc", "Loss/val": "val_loss",
            "Accuracy/val": "val_acc", "Loss/val_tta": "val_tta_loss", "Accuracy/val_tta": "val_tta_acc",
            "Loss/test": "test_loss", "Accuracy/test": "test_acc", "lr": "lr"}
    for tag, key in tags.items():
        if key in record:
            writer.add_scalar(tag, record[key], epoch)
