"""`cifarkit train`, `eval` and `validate`: a recipe trained into a run folder, weights measured, and recipe variants
compared on a validation split."""
from __future__ import annotations

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


def cmd_validate(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import validation
    from cifarkit.training.config import check_seed
    for seed in args.seeds:
        check_seed(seed, "--seeds")
    report = validation.run(args.recipe, args.variant, args.seeds, args.val_split, Path(args.runs_dir))
    print("\n".join(report["table"]))
    write_json(args.json, {"command": command_line(args), **report})
    print(f"wrote {args.json}")


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
    p = command(sub, "validate", "train recipe variants on a validation split, seed by seed, and compare each with the "
                                 "first (never reads the test set)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE,
                   help=f"built-in recipe name or YAML path that every variant starts from (default: {DEFAULT_RECIPE})")
    p.add_argument("--val-split", type=bounded(1, why="images held out to validate on"), default=5000, metavar="N",
                   help="training images held out (data.val_split; default: 5000)")
    p.add_argument("--seeds", type=bounded(0), nargs="+", default=[0, 1], metavar="SEED",
                   help="seeds to train every variant on; each variant is compared with the first on the same seed "
                        "(default: 0 1)")
    p.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE"),
                   help="a name and its recipe overrides (repeatable); the first variant is the one the others are "
                        "read against")
    p.add_argument("--runs-dir", default="runs/validation",
                   help="folder of the runs, one NAME-sSEED folder each; finished runs there are read, not trained "
                        "again (default: runs/validation)")
    p.add_argument("--json", required=True, help="where to write the table, the runs' figures and the command")
    p.set_defaults(func=cmd_validate)
