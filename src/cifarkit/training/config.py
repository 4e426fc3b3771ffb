"""Recipes: typed dataclasses loaded from YAML, with `--set key=value` overrides.

Every key is checked against the schema, so a typo is an error that names the key instead of a silently ignored
setting (the failure mode of configs that are plain dicts).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from cifarkit.core.errors import CifarkitError
from cifarkit.data.config import DataConfig


@dataclass
class ModelConfig:
    name: str = "cifar10net"
    # The BatchNorm layers' running-statistics momentum (PyTorch's: the weight of the new batch); None keeps each
    # model's own (fastnet 0.4, the others PyTorch's 0.1). Training only: inference reads the saved statistics.
    norm_momentum: float | None = None


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adamw | muon (conv filters orthogonalized, the rest Nesterov SGD)
    lr: float = 0.1
    momentum: float = 0.9  # sgd, and muon's SGD groups
    nesterov: bool = False  # sgd and muon
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # adam and adamw only
    vector_lr_scale: float = 1.0  # lr multiplier for BatchNorm shifts and biases
    vector_weight_decay: float = 0.0  # weight decay for BatchNorm shifts and biases
    filter_lr: float = 0.02  # muon only: the conv filters' orthogonalized step, relative to their normalized size
    filter_momentum: float = 0.6  # muon only: the conv filters' Nesterov momentum
    # muon only: the (a, b, c) of the quintic Newton-Schulz iteration. Jordan's maximize the slope at zero, so 3
    # iterations bring every singular value of the update near 1; the 2025 record tuned its own.
    newton_schulz: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


@dataclass
class ScheduleConfig:
    name: str = "constant"  # constant | cosine | linear | onecycle | step
    warmup_epochs: float = 0.0  # linear warmup from lr * warmup_start_factor
    warmup_start_factor: float = 0.1
    step_epochs: int = 30  # step: decay every this many epochs
    gamma: float = 0.1  # step: decay factor
    pct_start: float = 0.3  # onecycle: fraction of steps spent rising to the peak lr (= optim.lr)
    final_factor: float = 0.0  # linear: the lr at the end, as a fraction of optim.lr


def steps_in(epochs: float, steps_per_epoch: int) -> int:
    """The optimizer steps of `epochs` epochs, a fraction of a step rounded up."""
    return math.ceil(round(epochs * steps_per_epoch, 6))  # 8 x 25 is 200, not 200.00000000000003


@dataclass
class TrainConfig:
    # Passes over the training images; a fraction cuts the last one short (the 2025 A100 record trains 7.59).
    epochs: int | float = 10
    batch_size: int = 128
    seed: int = 0
    label_smoothing: float = 0.0
    grad_clip: float | None = None  # max global grad norm; None = off
    ema_decay: float | None = None  # per-step EMA of the weights used for evaluation; None = off
    lookahead_every: int | None = None  # steps between lookahead syncs; None = off
    lookahead_decay: float = 0.95  # per-step decay of the lookahead's slow weights at the end of training
    tta: bool = False  # evaluate with mirror + 1-pixel-shift test-time augmentation
    # With TTA: the share of the images, least confident first, that get the extra views (1.0: all of them). The
    # confident rest keep their single view, which TTA seldom overturns, and the final evaluation costs less.
    tta_share: float = 1.0
    device: str = "auto"  # auto | cuda | mps | cpu
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    channels_last: bool = True
    # torch.compile the model: auto compiles on CUDA only. There a small net's steps are bound by kernel launches,
    # which the compiler fuses away; on the CPU the compiled graph loses FastNet's own convolution paths
    # (models/layers.py, Conv3x3) and the first step waits for the C++ compiler.
    compile: bool | str = "auto"
    # torch.compile's mode: reduce-overhead also replays each step's kernels as one CUDA graph, max-autotune also
    # times candidate kernels at the first step (minutes). lab/device_check.sh times them against the default.
    compile_mode: str = "default"
    # Epochs the whitening layer's bias trains before it freezes (FastNet); None: it trains throughout. Frozen, the
    # first convolution's input gradient is not needed, and steps get cheaper (docs/recipes-and-speed.md).
    whiten_bias_epochs: int | None = None
    # With whiten_bias_epochs and the linear schedule: the bias's lr runs the schedule's whole course in this many
    # epochs (whole steps, rounded up), as the 2025 record trains it for 0.19 of an epoch, its lr falling to zero.
    # With final_factor 0 the bias stops moving then; its gradient is computed until whiten_bias_epochs ends.
    whiten_bias_anneal_epochs: float | None = None
    # FreezeOut (Brock et al. 2017): epochs each conv group trains, first group first, before it freezes with its
    # BatchNorm shifts; a group not listed trains throughout. A frozen group, and every group before it, needs no
    # backward pass, and late in a decaying schedule an early group's steps are small.
    group_train_epochs: tuple[int, ...] | None = None
    # With group_train_epochs and the linear schedule: each group's lr follows the schedule over its own epochs, so it
    # reaches the schedule's end as it freezes (FreezeOut's annealing) instead of stopping mid-schedule.
    group_lr_anneal: bool = False
    # Train on the hardest fraction of each batch, as a small proxy model's loss ranks its images (airbench96's data
    # filtering; engine.HardestSelector); None: on every image. The proxy learns on one step in select_proxy_every.
    select_fraction: float | None = None
    select_proxy: str = "fastnet_proxy"
    select_proxy_every: int = 4
    track: str | None = None  # mlflow: params, per-epoch metrics, tags and files to MLflow (training/tracking.py)
    eval_every: int = 1  # evaluate on val/test every N epochs (the last epoch is always evaluated)
    # checkpoints/last.pt after every epoch, for exact resume. A speed run turns it off: its time cannot be resumed,
    # and on a GPU writing the state each epoch is a real share of a run of seconds.
    checkpoints: bool = True
    # Micro-batches per step: batch_size / (processes x accumulate_steps) images each, their gradients summed into
    # one step; the same step as the whole batch at once (up to BatchNorm), in less memory.
    accumulate_steps: int = 1
    dist_backend: str | None = None  # torch.distributed backend under torchrun; None: nccl on CUDA, gloo otherwise
    sync_bn: bool = False  # SyncBatchNorm across the ranks (CUDA only); off: each rank normalizes its own shard

    def compiles(self, device_type: str) -> bool:
        """Whether a run on a device of `device_type` (cuda, mps, cpu) goes through torch.compile."""
        return self.compile is True or (self.compile == "auto" and device_type == "cuda")

    def total_steps(self, steps_per_epoch: int) -> int:
        """The optimizer steps of the whole run, a fraction of an epoch rounded up."""
        return steps_in(self.epochs, steps_per_epoch)

    def steps_by_epoch(self, steps_per_epoch: int) -> list[int]:
        """The optimizer steps of each epoch the run trains: whole epochs, then the cut-short last one where
        `epochs` has a fraction."""
        total = self.total_steps(steps_per_epoch)
        return [min(steps_per_epoch, total - done) for done in range(0, total, steps_per_epoch)]


@dataclass
class DistillConfig:
    teacher: str | None = None  # a version name (./cifar10_models, then shipped) or a release folder; None = off
    temperature: float = 4.0  # softens both distributions so the teacher's ranking of the wrong classes teaches
    weight: float = 0.3  # loss = (1 - weight) * CE + weight * T^2 * KL(teacher || student)
    # live: the teacher sees every augmented batch the student sees, one forward pass per image per epoch.
    # tta: before training, once, the teacher's TTA logits of each training image (as its evaluation's TTA: the
    # image, its mirror and their 1-pixel shifts) are the target of every augmented copy of that image: six
    # forward passes per image in all, and the teacher's more accurate prediction to learn from in a single view.
    targets: str = "live"


@dataclass
class Recipe:
    name: str = "custom"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# Seeds fit numpy's range; an epoch's generator is seeded with seed * 100_003 + epoch, which must fit torch's 64 bits.
MAX_SEED = 2**32 - 1

CHOICES = {
    "optim.name": ("sgd", "adam", "adamw", "muon"),
    "schedule.name": ("constant", "cosine", "linear", "onecycle", "step"),
    "train.device": ("auto", "cuda", "mps", "cpu"),
    "train.precision": ("auto", "fp32", "bf16", "fp16"),
    "train.compile": ("auto", True, False),
    "train.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "train.dist_backend": (None, "gloo", "nccl"),
    "train.track": (None, "mlflow"),
    "data.augment.autoaugment": (None, "cifar10", "imagenet", "svhn"),
    "distill.targets": ("live", "tta"),
}


def _coerce(value, annotation, key: str):
    """Check `value` against a field annotation; return it converted (lists to tuples, ints to floats)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except CifarkitError:
                pass
        raise CifarkitError(f"bad value for {key}: {value!r} (expected {_type_name(annotation)})")
    if origin is tuple:
        item_types = typing.get_args(annotation)
        if item_types[-1] is Ellipsis and isinstance(value, (list, tuple)):  # tuple[int, ...]: any length
            item_types = (item_types[0],) * len(value)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_types):
            raise CifarkitError(f"bad value for {key}: {value!r} (expected a list of {len(item_types)} numbers)")
        return tuple(_coerce(v, t, key) for v, t in zip(value, item_types))
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        # YAML 1.1 reads "5e-4" (no dot) as a string; it is still the number everyone means.
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation in (bool, str) and isinstance(value, annotation):
        return value
    raise CifarkitError(f"bad value for {key}: {value!r} (expected {_type_name(annotation)})")


def _type_name(annotation) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _apply(obj, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise CifarkitError(f"unknown key {key!r}; valid keys here: {', '.join(prefix + n for n in names)}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise CifarkitError(f"bad value for {key}: expected a mapping of its fields, got {value!r}")
            _apply(current, value, f"{key}.")
            continue
        value = _coerce(value, hints[name], key)
        if key in CHOICES and value not in CHOICES[key]:
            valid = ", ".join(str(c) for c in CHOICES[key])
            raise CifarkitError(f"bad value for {key}: {value!r} (choose from {valid})")
        setattr(obj, name, value)


def _check_ranges(recipe: Recipe) -> None:
    positive = {"train.epochs": recipe.train.epochs, "train.batch_size": recipe.train.batch_size,
                "optim.lr": recipe.optim.lr, "train.eval_every": recipe.train.eval_every,
                "train.accumulate_steps": recipe.train.accumulate_steps,
                "train.select_proxy_every": recipe.train.select_proxy_every,
                "distill.temperature": recipe.distill.temperature}
    for key, value in positive.items():
        if not 0 < value < math.inf:  # NaN too
            raise CifarkitError(f"bad value for {key}: {value!r} (must be > 0 and finite)")
    check_seed(recipe.train.seed, "train.seed")
    if recipe.data.subset is not None and recipe.data.subset < 10:
        raise CifarkitError(f"bad value for data.subset: {recipe.data.subset} (need at least 10, one per class)")
    _check_freezing(recipe.train, recipe.schedule)
    augment = recipe.data.augment
    if augment.early_crop_epochs < 0:
        raise CifarkitError(f"bad value for data.augment.early_crop_epochs: {augment.early_crop_epochs} (must be >= 0)")
    if augment.early_crop_epochs and not 0 < augment.early_crop < 32:
        raise CifarkitError(f"bad value for data.augment.early_crop: {augment.early_crop} (a window of 1 to 31 pixels, "
                            f"smaller than the 32-pixel images, for its {augment.early_crop_epochs} early epochs)")
    for name in ("brightness", "contrast"):
        if not 0.0 <= getattr(augment, name) < 1.0:
            raise CifarkitError(f"bad value for data.augment.{name}: {getattr(augment, name)} (a jitter range from 0 "
                                "to below 1)")
    if recipe.train.select_fraction is not None and not 0.0 < recipe.train.select_fraction <= 1.0:
        raise CifarkitError(f"bad value for train.select_fraction: {recipe.train.select_fraction} (must be in (0, 1])")
    if not 0.0 <= recipe.train.tta_share <= 1.0:
        raise CifarkitError(f"bad value for train.tta_share: {recipe.train.tta_share} (a share of the test images, "
                            "from 0 to 1)")
    momentum = recipe.model.norm_momentum
    if momentum is not None and not 0.0 < momentum <= 1.0:
        raise CifarkitError(f"bad value for model.norm_momentum: {momentum} (in (0, 1], or null for the model's own)")
    if recipe.train.ema_decay is not None and not 0.0 < recipe.train.ema_decay < 1.0:
        raise CifarkitError(f"bad value for train.ema_decay: {recipe.train.ema_decay} (must be in (0, 1))")
    if not 0.0 <= recipe.distill.weight <= 1.0:
        raise CifarkitError(f"bad value for distill.weight: {recipe.distill.weight} (must be in [0, 1])")


def _check_freezing(train: TrainConfig, schedule: ScheduleConfig) -> None:
    """The settings that freeze parts of FastNet early, and anneal their lr on the way."""
    if train.whiten_bias_epochs is not None and train.whiten_bias_epochs < 0:
        raise CifarkitError(f"bad value for train.whiten_bias_epochs: {train.whiten_bias_epochs} (must be >= 0)")
    # Each lr that ends early follows the linear schedule over its own steps (optim._linear), to zero without warmup.
    own_schedule = schedule.name == "linear" and schedule.warmup_epochs == 0
    if any(epochs < 0 for epochs in train.group_train_epochs or ()):
        raise CifarkitError(f"bad value for train.group_train_epochs: {list(train.group_train_epochs)} "
                            "(epochs per conv group, each >= 0)")
    if train.group_lr_anneal and not (train.group_train_epochs and own_schedule):
        raise CifarkitError("train.group_lr_anneal needs train.group_train_epochs and the linear schedule without "
                            "warmup (schedule.name=linear, schedule.warmup_epochs=0); set them or drop it")
    anneal = train.whiten_bias_anneal_epochs
    if anneal is not None and not (0 < anneal <= (train.whiten_bias_epochs or 0) and own_schedule):
        raise CifarkitError(f"bad value for train.whiten_bias_anneal_epochs: {anneal} (needs train.whiten_bias_epochs "
                            "at least as long and the linear schedule without warmup; set them, or "
                            "train.whiten_bias_anneal_epochs=null)")


def check_seed(seed: int, name: str) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise CifarkitError(f"bad value for {name}: {seed} (a seed is a whole number from 0 to {MAX_SEED:,})")


def builtin_recipes() -> dict[str, Path]:
    folder = resources.files("cifarkit.training") / "recipes"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise CifarkitError(f"cannot read recipe {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise CifarkitError(f"recipe {path} is not a text file (byte {e.start} is not UTF-8); give a recipe name "
                            f"({', '.join(sorted(builtin_recipes()))}) or a YAML file") from None
    except yaml.YAMLError as e:
        raise CifarkitError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from e
    if not isinstance(data, dict):
        raise CifarkitError(f"recipe {path} must be a YAML mapping of sections (model, data, optim, ...)")
    return data


def parse_override(text: str) -> tuple[str, object]:
    """'train.epochs=5' -> ('train.epochs', 5); the value is parsed as YAML so lists and null work."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise CifarkitError(f"bad override {text!r}; write it as key=value, e.g. train.epochs=5")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise CifarkitError(f"bad value for {key}: {raw!r} is not valid YAML") from e


def nest(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def recipe_path(name_or_path: str) -> Path:
    known = builtin_recipes()
    if name_or_path in known:
        return known[name_or_path]
    if name_or_path.endswith((".yaml", ".yml")) or Path(name_or_path).exists():
        return Path(name_or_path)
    raise CifarkitError(f"unknown recipe {name_or_path!r}; choose from {', '.join(sorted(known))} or give a YAML path")


def recipe_chain(name_or_path: str) -> list[tuple[Path, dict]]:
    """(file, its values without `base`) of the recipe and of the files its `base:` names, base first: a recipe that
    says `base: fast` is `fast` with the values it sets on top. A base is a built-in name or a path relative to the
    file that names it."""
    path = recipe_path(name_or_path)
    chain = [(path, _read_yaml(path))]
    while (base := chain[0][1].pop("base", None)) is not None:
        base = str(base)
        path = builtin_recipes().get(base) or chain[0][0].parent / base
        if not path.exists():
            raise CifarkitError(f"recipe {chain[0][0]} names base {base!r}, which is neither a built-in recipe "
                                f"({', '.join(sorted(builtin_recipes()))}) nor a file beside it")
        if path.resolve() in {p.resolve() for p, _ in chain}:
            raise CifarkitError(f"recipe {chain[0][0]} names base {base!r}, which leads back to itself; break the "
                                "loop")
        chain.insert(0, (path, _read_yaml(path)))
    return chain


def load_recipe(name_or_path: str, overrides: list[str] | tuple = ()) -> Recipe:
    """Load a built-in recipe by name, or a YAML file by path (after its base, if it names one), then apply
    `key=value` overrides in order."""
    return _resolved(recipe_chain(name_or_path), overrides)


def _resolved(chain: list[tuple[Path, dict]], overrides: list[str] | tuple = ()) -> Recipe:
    recipe = Recipe()
    for path, data in chain:
        _apply(recipe, {"name": path.stem, **data})
    for text in overrides:
        _apply(recipe, nest(*parse_override(text)))
    _check_ranges(recipe)
    return recipe


def recipe_from_dict(data: dict) -> Recipe:
    recipe = Recipe()
    _apply(recipe, data)
    _check_ranges(recipe)
    return recipe


def to_dict(recipe: Recipe) -> dict:
    """Plain nested dict (tuples as lists) for YAML/JSON."""
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(recipe))


INHERITED = "from"


def explain(name_or_path: str) -> tuple[Recipe, list[str], list[tuple[str, object, str | None]]]:
    """(the recipe, its file's opening comment lines, (dotted key, resolved value, reason) for every field).

    A reason is the comment on the line where the file sets the key's value, "" for a key the file sets without one,
    None for a field the file leaves at its default. A recipe gives each value one line of reason, on that line:
    comment lines elsewhere below the opening ones are not read. A value a recipe takes from its base keeps the
    base's reason, after INHERITED and the base's name.
    """
    chain = recipe_chain(name_or_path)
    recipe = _resolved(chain)
    reasons = {}
    for path, _ in chain:
        text = path.read_text()
        own = _reasons(yaml.compose(text, Loader=yaml.SafeLoader), text)
        if path != chain[-1][0]:
            own = {key: f"{INHERITED} {path.stem}: {reason}" if reason else reason for key, reason in own.items()}
        reasons.update(own)
    header = [line[1:].strip() for line in itertools.takewhile(lambda line: line.startswith("#"), text.splitlines())]
    rows = [(key, value, reasons.get(key))
            for key, value in flatten(dataclasses.asdict(recipe)).items() if key not in ("name", "description")]
    return recipe, header, rows


def flatten(mapping: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested mapping's non-mapping values: {'train': {'seed': 0}} -> {'train.seed': 0}."""
    out = {}
    for name, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


# YAML wants whitespace before a comment's `#`: in `a#b` it is part of the value.
_TRAILING_COMMENT = re.compile(r"[ \t]+#(.*)")


def _reasons(node: yaml.MappingNode, text: str, prefix: str = "") -> dict[str, str]:
    """{dotted key: the comment after its value on the value's last line, or ""} for every non-mapping value of a
    composed YAML mapping; PyYAML drops comments, but each node keeps where it ends in `text`."""
    reasons = {}
    for key, value in node.value:
        if isinstance(value, yaml.MappingNode):
            reasons.update(_reasons(value, text, f"{prefix}{key.value}."))
        else:
            comment = _TRAILING_COMMENT.match(text, value.end_mark.index)
            reasons[f"{prefix}{key.value}"] = comment.group(1).strip() if comment else ""
    return reasons
