"""What the command groups share: output helpers, argument types, and the options of every command that trains."""
from __future__ import annotations

import argparse
import json
import os
import shlex

from cifarkit.core.errors import CifarkitError

DEFAULT_RECIPE = "fast"  # the most accurate recipe per minute on any device; see docs/measurements.md

DEVICES = ("auto", "cuda", "mps", "cpu")

PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, for a results file that may be committed: an absolute path (alone or after `--opt=`)
    becomes relative to the working folder, or just its name, as every path such a file records; a word that a shell
    would split or expand (`train.group_train_epochs=[4]`) is quoted, so that the line can be pasted back."""
    from cifarkit.core.files import portable

    def shareable(word: str) -> str:
        option, equals, value = word.rpartition("=") if word.startswith("--") else ("", "", word)
        return shlex.quote(option + equals + (portable(value) if os.path.isabs(value) else value))
    return " ".join(["cifarkit", *map(shareable, args.argv)])


def number(text: str) -> int | float:
    """An int where the text is one ('8'), else a float ('7.59'): a whole count stays whole in the files."""
    value = float(text)
    return int(value) if value.is_integer() else value


# Recipe fields with an option of their own in `train` and `speedrun`: option -> (recipe key, type or choices, help).
# The recipe checks their values, as it checks any --set.
SHORTCUTS = {
    "epochs": ("train.epochs", number, "passes over the training images (a fraction cuts the last one short)"),
    "batch_size": ("train.batch_size", int, "images per training step"),
    "lr": ("optim.lr", float, "peak learning rate of the schedule"),
    "seed": ("train.seed", int, "seed of the initialization, the data order and the augmentation"),
    "subset": ("data.subset", int, "train on a class-balanced subset of this many training images"),
    "device": ("train.device", DEVICES, "auto: CUDA, then MPS, then the CPU"),
    "precision": ("train.precision", PRECISION_CHOICES,
                  "auto: fp16 on CUDA, bf16 on CPUs with native bf16, fp32 otherwise"),
    "track": ("train.track", ("mlflow",), "log params, per-epoch metrics and files to MLflow (MLFLOW_TRACKING_URI, "
                                          "else sqlite:///mlflow.db here; needs the mlflow extra)"),
}


def add_recipe_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """--recipe, --set, the SHORTCUTS and --compile, the same in every command that trains."""
    p.add_argument("--recipe", help=f"built-in recipe name (`cifarkit recipes` lists them) or YAML path "
                                    f"(default: {DEFAULT_RECIPE})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.weight_decay=5e-4 (repeatable; "
                        "`cifarkit recipes NAME` lists the fields)")
    for flag, (key, kind, text) in SHORTCUTS.items():
        if flag in skip:
            continue
        typed = {"choices": kind} if isinstance(kind, tuple) else {"type": kind, "metavar": kind.__name__.upper()}
        p.add_argument(f"--{flag.replace('_', '-')}", **typed, help=f"{text} (default: the recipe's {key})")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model, or not (sets train.compile; default: the recipe's, whose auto "
                        "compiles on CUDA only)")


def overrides(args) -> list[str]:
    """The --set values (applied in order, like the recipe's own lines) and the shortcuts, as KEY=VALUE overrides.
    A shortcut and a --set of the same field is an error: neither comes "after" the other, and a silent pick would
    train something the user did not ask for."""
    shortcuts = {key: (f"--{flag.replace('_', '-')} {getattr(args, flag)}", f"{key}={getattr(args, flag)}")
                 for flag, (key, _, _) in SHORTCUTS.items() if getattr(args, flag, None) is not None}
    if args.compile is not None:
        shortcuts["train.compile"] = ("--compile" if args.compile else "--no-compile",
                                      f"train.compile={str(args.compile).lower()}")
    for text in args.set:
        key = text.partition("=")[0].strip()
        if key in shortcuts:
            raise CifarkitError(f"--set {text} and {shortcuts[key][0]} both set {key}; give it once")
    return list(args.set) + [override for _, override in shortcuts.values()]


def bounded(low, high=None, kind=int, why: str = ""):
    """An argparse type: a `kind` from `low` to `high`; anything else is an argument error that gives the range."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not (low <= value and (high is None or value <= high)):  # written so that NaN fails too
            span = f"at least {low}" if high is None else f"from {low} to {high:,}"
            raise argparse.ArgumentTypeError(f"must be {span}{f' ({why})' if why else ''}, got {text}")
        return value
    return parse


def command(group, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with the line that lists it."""
    return group.add_parser(name, help=summary, description=summary)

