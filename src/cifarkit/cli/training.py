"""`cifarkit train`, `eval` and `tune`: a recipe trained into a run folder, weights measured, and recipe values
searched on a validation split."""
from __future__ import annotations

import argparse
from pathlib import Path

from cifarkit.cli.common import (
    DEFAULT_RECIPE,
    DEVICES,
    PRECISION_CHOICES,
    add_recipe_options,
    bounded,
    command,
    command_line,
    overrides,
    print_json,
)
from cifarkit.core.errors import CifarkitError


def cmd_train(args) -> None:
    from cifarkit.training import train
    from cifarkit.training.config import load_recipe
    if args.nproc > 1:
        _launch_train(args)
        return
    if args.resume:
        if args.recipe or args.out or overrides(args):
            raise CifarkitError("--resume continues a run exactly as configured; drop the other options")
        train.run(resume=Path(args.resume))
        return
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE, overrides(args))
    train.run(recipe, out=Path(args.out) if args.out else None)


def _launch_train(args) -> None:
    """`train --nproc N`: this same command on N processes under torchrun, with --out fixed first so that every rank
    names the same run folder."""
    from cifarkit.training import distributed, train
    from cifarkit.training.config import load_recipe
    given = args.argv[args.argv.index("train") + 1:]
    argv = [t for i, t in enumerate(given) if t != "--nproc" and not t.startswith("--nproc=")
            and (i == 0 or given[i - 1] != "--nproc")]
    if not args.resume and not args.out:
        argv += ["--out", str(train.default_out(load_recipe(args.recipe or DEFAULT_RECIPE, overrides(args))))]
    distributed.launch(args.nproc, argv)


def cmd_eval(args) -> None:
    from cifarkit.release.evaluation import evaluate_weights
    result = evaluate_weights(args.target, tta=args.tta, device=args.device, precision=args.precision,
                              figure=Path(args.figure) if args.figure else None)
    if args.json:
        print_json(result)
        return
    print(f"{result['model']} on {result['test_images']:,} test images ({result['device']}, {result['precision']}"
          f"{', TTA' if args.tta else ''}): accuracy {100 * result['test_acc']:.2f}%, loss {result['test_loss']:.4f}")
    for name, acc in result["per_class_acc"].items():
        print(f"  {name:<11} {100 * acc:6.2f}%")
    print(f"confusion matrix: {result['confusion_png']}")


def cmd_tune(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import tune
    plan = tune.plan_study(args.recipe or DEFAULT_RECIPE, overrides(args), args.space,
                           [seed for listed in args.seeds for seed in listed], args.val_split, args.sampler,
                           args.pruner, args.prune_after, args.trials)
    out = Path(args.out) if args.out else tune.default_out(plan)
    report = tune.run(plan, out, args.storage, args.study)
    print("\n".join(report["table"]))
    if report["best"]:
        best = report["best"]
        print(f"best: trial {best['number']}, {100 * best['mean']:.2f}% "
              f"({' '.join(tune.override(k, v) for k, v in best['params'].items())})")
    print(f"chart: {report['chart']}")
    if args.json:
        # A results file may be committed: a database URL's password stays out of it.
        argv = [word.replace(args.storage, tune.without_password(args.storage)) for word in args.argv] \
            if args.storage else args.argv
        write_json(args.json, {"command": command_line(argparse.Namespace(argv=argv)), **report})
        print(f"wrote {args.json}")
    print(f"the study in a browser (pip install optuna-dashboard): {tune.dashboard_command(args.storage, out)}")


def seed_list(text: str) -> list[int]:
    """An argparse type: a seed, or an inclusive range of them (0..15)."""
    first, dots, last = text.partition("..")
    try:
        seeds = list(range(int(first), int(last) + 1)) if dots else [int(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a seed or a range of seeds such as 0..15: {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text} is an empty range; give the smaller seed first")
    return seeds


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    p = command(sub, "train", f"train a recipe (default: {DEFAULT_RECIPE}) into a run folder")
    add_recipe_options(p)
    p.add_argument("--out", help="run folder (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--nproc", type=bounded(1), default=1, metavar="N",
                   help="train on N processes of this machine, through torchrun: data-parallel, one GPU each on CUDA "
                        "(default: 1)")
    p.set_defaults(func=cmd_train)
    p = command(sub, "eval", "test accuracy, per-class accuracy and confusion matrix of trained weights")
    p.add_argument("target", help="version name (A, or C for ./cifar10_models/version_C), release or run folder, or "
                                  ".safetensors file")
    p.add_argument("--tta", action="store_true",
                   help="test-time augmentation: mirror + 1-pixel shifts, weighted logits")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA, then MPS, then the CPU")
    p.add_argument("--precision", default="fp32", choices=PRECISION_CHOICES,
                   help="fp32 (default) gives the accuracy releases record and Classifier.predict computes")
    p.add_argument("--figure", help="confusion-matrix figure, .png/.jpg/.pdf/.svg (default: confusion.png beside a "
                                    "run's weights; confusion_version_NAME.png here for a release)")
    p.set_defaults(func=cmd_eval)
    p = command(sub, "tune", "search recipe values with Optuna on a validation split, seeds as repeats (never reads "
                             "the test set)")
    add_recipe_options(p, skip=("seed",))  # --seeds sets the seeds
    p.add_argument("--space", action="append", default=[], metavar="KEY=KIND:...",
                   help="a recipe key and its values to search (repeatable): KEY=float:LOW:HIGH, KEY=log:LOW:HIGH, "
                        "KEY=int:LOW:HIGH[:STEP] or KEY=choice:A,B,...")
    p.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe",
                   help="how trials choose values: Optuna's TPE, uniformly at random, or every point of a grid of "
                        "choices once, each compared with the first seed by seed (default: tpe)")
    p.add_argument("--trials", type=bounded(1), metavar="N",
                   help="trials the study runs, counted over all its workers (a grid's are its points)")
    p.add_argument("--seeds", type=seed_list, nargs="+", default=[[0], [1]], metavar="SEED",
                   help="seeds each trial trains, one run each, its value their mean; a seed or a range, 0..15 "
                        "(default: 0 1)")
    p.add_argument("--val-split", type=bounded(1, why="images held out to validate on"), default=5000, metavar="N",
                   help="training images held out to score the trials on (data.val_split; default: 5000)")
    p.add_argument("--pruner", choices=("median", "none"),
                   help="median: stop a trial whose validation accuracy after an epoch is below the median of the "
                        "finished trials' at the same seed and epoch (default: median; none with --sampler grid)")
    p.add_argument("--prune-after", type=bounded(0), default=5, metavar="N",
                   help="trials that finish before the pruner stops any (default: 5)")
    p.add_argument("--out", metavar="FOLDER",
                   help="run folder: the study (study.log), its chart, and one run folder per trial and seed, "
                        "trial-NNNN-sSEED; the same command again resumes it (default: runs/tune-<recipe>-<time>)")
    p.add_argument("--storage", metavar="URL",
                   help="a study shared by several workers, on this machine or others: journal:PATH (a file, on a "
                        "shared folder for several machines) or a database URL (sqlite:///PATH, postgresql://...) "
                        "(default: the run folder's study.log)")
    p.add_argument("--study", metavar="NAME", help="the study's name in the storage (default: the run folder's name)")
    p.add_argument("--json", help="also write the table, every trial's values and the command to this file")
    p.set_defaults(func=cmd_tune)
