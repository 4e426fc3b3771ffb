"""The `cifarkit` command: parses arguments and calls the stages, nothing more."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from cifarkit.core.errors import LOG_FORMAT, CifarkitError, describe_os_error

DEFAULT_RECIPE = "fast"  # the most accurate recipe per minute on any device; see docs/measurements.md
GRID_MAX = 256  # images in a `data show` grid: 32 rows of 8 still make a page; 100,000 once took 13 GB
DEVICES = ("auto", "cuda", "mps", "cpu")
BENCH_MODES = ["fp32", "bf16+cl"]  # bench's default: a CPU's plain and fast training
PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
# `cifarkit serve` options that set a ServeSettings field; tests/test_serve.py checks the defaults their help states.
SERVE_SETTINGS = ("max_batch", "max_wait_ms", "max_queue", "timeout_s", "read_timeout_s", "max_body_mb", "threads",
                  "backend")


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def cmd_env(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    info = report(pick_device("auto"))
    if args.json:
        _print_json(info)
    else:
        print("\n".join(describe(info)))


def cmd_models(args) -> None:
    from cifarkit import models
    rows = []
    for name in models.names():
        model = models.create(name)
        rows.append({"name": name, "params": models.count_params(model), "macs": models.count_macs(model)})
    if args.json:
        _print_json(rows)
        return
    print(f"{'model':<12} {'params':>12} {'MACs/image':>14}")
    for r in rows:
        print(f"{r['name']:<12} {r['params']:>12,} {r['macs']:>14,}")


def cmd_recipes(args) -> None:
    import yaml

    from cifarkit.training.config import builtin_recipes, explain, load_recipe
    if args.recipe is None:
        for name in sorted(builtin_recipes()):
            default = " (default)" if name == DEFAULT_RECIPE else ""
            print(f"{name:<16} {load_recipe(name).description}{default}")
        return
    recipe, header, rows = explain(args.recipe)
    print(f"{recipe.name}{' (default)' if recipe.name == DEFAULT_RECIPE else ''}: {recipe.description}")
    for line in header:
        print(f"# {line}")
    for key, value, reason in rows:
        # YAML's spelling (null, true, [0.5, 0.5, 0.5]): what --set and a recipe file take.
        shown = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True,
                               width=1_000).strip().removesuffix("\n...")
        note = "default" if reason is None else reason
        print(f"{key} = {shown}" + (f"  # {note}" if note else ""))


def cmd_data_import(args) -> None:
    from cifarkit.data import cifar10
    dataset = cifar10.import_data(args.path)
    print(f"imported {len(dataset.train_y):,} train and {len(dataset.test_y):,} test images into "
          f"{cifar10.cache_path()}")
    print(f"content sha256 {dataset.sha256}")


def cmd_data_info(args) -> None:
    import torch

    from cifarkit.data import cifar10
    dataset = cifar10.load()
    info = {"source": dataset.source, "cache": str(cifar10.cache_path()), "sha256": dataset.sha256, "splits": {}}
    for split, x, y in (("train", dataset.train_x, dataset.train_y), ("test", dataset.test_x, dataset.test_y)):
        counts = torch.bincount(y, minlength=10).tolist()
        info["splits"][split] = {"images": len(y), "per_class": dict(zip(cifar10.CLASSES, counts)),
                                 "images_sha256": cifar10.content_sha256(x), "labels_sha256": cifar10.content_sha256(y)}
    if args.json:
        _print_json(info)
        return
    print(f"source: {info['source']}\ncache: {info['cache']}\ncontent sha256: {info['sha256']}")
    for split, s in info["splits"].items():
        print(f"{split}: {s['images']:,} images; images sha256 {s['images_sha256']}, "
              f"labels sha256 {s['labels_sha256']}")
        print("  " + ", ".join(f"{name} {count}" for name, count in s["per_class"].items()))


def cmd_data_show(args) -> None:
    import torch

    from cifarkit.data import cifar10
    from cifarkit.training import plots
    from cifarkit.training.config import check_seed
    check_seed(args.seed, "--seed")
    plots.figure_format(Path(args.out))  # a suffix it cannot write fails before the data is loaded
    dataset = cifar10.load()
    x, y = (dataset.train_x, dataset.train_y) if args.split == "train" else (dataset.test_x, dataset.test_y)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))[:args.count]
    plots.sample_grid(x[idx], y[idx], cifar10.CLASSES, Path(args.out))
    print(f"wrote {args.out} ({_plural(len(idx), args.split + ' image')})")


# Recipe fields with an option of their own in `train` and `speedrun`: option -> (recipe key, type or choices, help).
# The recipe checks their values, as it checks any --set.
SHORTCUTS = {
    "epochs": ("train.epochs", int, "passes over the training images"),
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


def _add_recipe_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
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
    p.add_argument("--compile", action="store_true", help="torch.compile the model (sets train.compile)")


def _overrides(args) -> list[str]:
    """The --set values (applied in order, like the recipe's own lines) and the shortcuts, as KEY=VALUE overrides.
    A shortcut and a --set of the same field is an error: neither comes "after" the other, and a silent pick would
    train something the user did not ask for."""
    shortcuts = {key: (f"--{flag.replace('_', '-')} {getattr(args, flag)}", f"{key}={getattr(args, flag)}")
                 for flag, (key, _, _) in SHORTCUTS.items() if getattr(args, flag, None) is not None}
    if args.compile:
        shortcuts["train.compile"] = ("--compile", "train.compile=true")
    for text in args.set:
        key = text.partition("=")[0].strip()
        if key in shortcuts:
            raise CifarkitError(f"--set {text} and {shortcuts[key][0]} both set {key}; give it once")
    return list(args.set) + [override for _, override in shortcuts.values()]


def cmd_train(args) -> None:
    from cifarkit.training import train
    from cifarkit.training.config import load_recipe
    if args.nproc > 1:
        _launch_train(args)
        return
    if args.resume:
        if args.recipe or args.out or _overrides(args):
            raise CifarkitError("--resume continues a run exactly as configured; drop the other options")
        train.run(resume=Path(args.resume))
        return
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE, _overrides(args))
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
        argv += ["--out", str(train.default_out(load_recipe(args.recipe or DEFAULT_RECIPE, _overrides(args))))]
    distributed.launch(args.nproc, argv)


def cmd_eval(args) -> None:
    from cifarkit.release.evaluation import evaluate_weights
    result = evaluate_weights(args.target, tta=args.tta, device=args.device, precision=args.precision,
                              figure=Path(args.figure) if args.figure else None)
    if args.json:
        _print_json(result)
        return
    print(f"{result['model']} on {result['test_images']:,} test images ({result['device']}, {result['precision']}"
          f"{', TTA' if args.tta else ''}): accuracy {100 * result['test_acc']:.2f}%, loss {result['test_loss']:.4f}")
    for name, acc in result["per_class_acc"].items():
        print(f"  {name:<11} {100 * acc:6.2f}%")
    print(f"confusion matrix: {result['confusion_png']}")


def cmd_bench(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    from cifarkit.core.files import write_json
    from cifarkit.models import names
    from cifarkit.tools.benchmark import peak_memory, train_throughput
    from cifarkit.training import distributed
    if args.nproc:
        _bench_scaling(args)
        return
    if args.devices:
        _bench_devices(args)
        return
    modes = args.modes or BENCH_MODES
    group = distributed.launched()  # under torchrun: one of the processes `--nproc` measures
    device = distributed.init(group, pick_device(args.device), None)
    try:
        rows = train_throughput(args.models or names(), modes, device, args.batch_size, args.steps, args.rounds,
                                group)
    finally:
        distributed.finish(group)
    if not group.writes:
        return
    env = report(device)
    print("\n".join(describe(env)))
    print(f"\ntraining throughput, batch {args.batch_size}, median of {_plural(args.rounds, 'round')} of "
          f"{_plural(args.steps, 'step')}")
    print(f"| model | mode | img/s | vs {modes[0]} |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['images_per_s']:.0f} | {r[f'speedup_vs_{modes[0]}']:.2f}x |")
    if args.json:
        import resource
        usage = resource.getrusage(resource.RUSAGE_SELF)  # the allocator's share shows in page faults and system time
        peak, kind = peak_memory(device)
        write_json(args.json, {"environment": env, "batch_size": args.batch_size, "steps": args.steps,
                               "rounds": args.rounds, "results": rows,
                               "process": {"minor_page_faults": usage.ru_minflt, "system_s": usage.ru_stime,
                                           "user_s": usage.ru_utime},
                               "peak_memory": {"bytes": peak, "kind": kind}})
        print(f"wrote {args.json}")


def _bench_devices(args) -> None:
    from cifarkit.core.device import describe, report
    from cifarkit.core.files import write_json
    from cifarkit.models import names
    from cifarkit.tools.benchmark import AMP, device_report, device_table
    from cifarkit.training.plots import device_speedups
    result = device_report(args.devices, args.models or names(), args.modes or ["fp32", AMP], args.batch_size,
                           args.steps, args.rounds)
    env = report()
    print("\n".join(describe(env)))
    print(f"\ntraining and inference per device, batch {args.batch_size}, median of {_plural(args.rounds, 'round')} "
          f"of {_plural(args.steps, 'step')}, each measured in a process of its own")
    print(device_table(result))
    for what, why in result["skipped"].items():
        print(f"skipped {what}: {why}")
    if args.json:
        chart = Path(args.json).with_suffix(".png")
        device_speedups(result, chart)
        write_json(args.json, {"environment": env, "command": "cifarkit " + " ".join(args.argv), **result})
        print(f"wrote {args.json} and {chart}")


def _bench_scaling(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    from cifarkit.core.files import write_json
    from cifarkit.tools.benchmark import scaling
    device = pick_device(args.device)
    model, mode = (args.models or ["fastnet"])[0], (args.modes or BENCH_MODES)[-1]
    result = scaling(args.nproc, model, mode, device, args.batch_size, args.steps, args.rounds)
    env = report(device)
    print("\n".join(describe(env)))
    print(f"\ndata-parallel scaling of {model} ({mode}), global batch {args.batch_size}, median of "
          f"{_plural(args.rounds, 'round')} of {_plural(args.steps, 'step')}, each count launched by torchrun")
    print("| processes | img/s | speed-up | efficiency |\n|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['processes']} | {r['images_per_s']:.0f} | {r['speedup']:.2f}x | {100 * r['efficiency']:.0f}% |")
    print(f"evaluation on rank 0 alone: {result['eval_images_per_s']:.0f} img/s, "
          f"{result['eval_images'] / result['eval_images_per_s']:.1f} s per pass over {result['eval_images']:,} images")
    if args.json:
        write_json(args.json, {"environment": env, "command": "cifarkit " + " ".join(args.argv), "scaling": result})
        print(f"wrote {args.json}")


def cmd_profile(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import profiling
    from cifarkit.training.config import load_recipe
    result = profiling.run(load_recipe(args.recipe or DEFAULT_RECIPE, _overrides(args)), args.steps)
    print(profiling.table(result))
    if args.json:
        write_json(args.json, {"command": "cifarkit " + " ".join(args.argv), **result})
        print(f"wrote {args.json}")


def cmd_speedrun(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import speedrun
    from cifarkit.training.config import check_seed
    check_seed(args.first_seed, "--first-seed")
    check_seed(args.first_seed + args.runs - 1, "the last seed, --first-seed + --runs - 1")
    report = speedrun.run(args.recipe or DEFAULT_RECIPE, args.runs, args.target, Path(args.out) if args.out else None,
                          args.first_seed, curve=not args.no_curve, overrides=tuple(_overrides(args)))
    print(speedrun.table(report))
    print(f"timer: {report['timer_covers']}")
    print(f"wrote {report['out_dir']}/speedrun.json and speedrun.png")
    if args.json:
        write_json(args.json, {k: v for k, v in report.items() if k != "out_dir"})
        print(f"wrote {args.json}")


def cmd_release(args) -> None:
    if args.alias and not args.register:
        raise CifarkitError("--alias names an alias of the registered model: give --register MODEL too")
    if args.check:
        from cifarkit.artifacts.releases import release_dir
        from cifarkit.release.build import check
        if args.run_dir or args.name:
            raise CifarkitError("--check RELEASE verifies an existing release; drop RUN_DIR and --name")
        folder = release_dir(args.check, accepts="a release folder")
        findings = check(folder)
        for name, verdict, problem in findings:
            print(f"{verdict:<8}{name}" + (f": {problem}" if problem else ""))
        failed = sum(verdict == "error" for _, verdict, _ in findings)
        if failed:
            raise CifarkitError(f"{folder}: {failed} file(s) failed the check; restore them, or write the release "
                                f"again with `cifarkit release --force`")
        _register(folder, args)
        return
    if not (args.run_dir and args.name):
        raise CifarkitError("give the run folder and --name to write a release, or --check RELEASE to verify one")
    from cifarkit.artifacts.releases import known_releases
    from cifarkit.release.build import make_release
    target = make_release(Path(args.run_dir), args.name, Path(args.out), force=args.force,
                          weights_dtype=args.weights_dtype, speedrun=Path(args.speedrun) if args.speedrun else None,
                          keep_onnx=args.keep_onnx)
    metrics = json.loads((target / "metrics.json").read_text())
    inference = metrics["inference"]
    print(f"released {target}: test accuracy {100 * metrics['test_acc']:.2f}% ({100 * metrics['test_acc_tta']:.2f}% "
          f"with TTA), {metrics['weights_bytes'] / 1e6:.1f} MB of {metrics['weights_dtype']} weights, "
          f"{inference['images_per_s_batch1']:,.0f} img/s at batch 1 and {inference['images_per_s_batch256']:,.0f} "
          f"at batch 256 ({inference['default_backend']})")
    # Its name reaches it only where names are looked up (./cifar10_models); elsewhere the folder does.
    reached = known_releases().get(args.name)
    handle = args.name if reached and reached.resolve() == target.resolve() else str(target)
    print(f"use it as `cifarkit predict --model {handle} IMAGE`, `cifarkit export {handle} --format onnx` or "
          f"`Classifier.load({handle!r})`")
    _register(target, args)


def _register(folder: Path, args) -> None:
    if not args.register:
        return
    from cifarkit.training.tracking import register_release
    done = register_release(folder, args.register, args.alias)
    alias = f", alias {done['alias']!r}" if done["alias"] else ""
    print(f"registered {folder} as version {done['version']} of MLflow model {done['model']!r}{alias} "
          f"({done['tracking_uri']}, run {done['run_id']})")


def cmd_compare(args) -> None:
    from cifarkit.release.build import compare
    root = Path(args.root) if args.root else None
    # Beside the releases of ROOT; with none given (the shipped ones lie inside the package), in the current folder.
    figure = Path(args.figure) if args.figure else (root or Path()) / "comparison.png"
    print(compare(root, figure))
    print(f"\nchart: {figure}")


def cmd_predict(args) -> None:
    from cifarkit.inference.classifier import Classifier
    classifier = Classifier.load(args.model, backend=args.backend, verify=not args.no_verify)
    results, failed = [], 0
    for path in args.images:
        try:
            results.append({"path": path, **classifier.prediction(path, k=args.topk)})
        except (ValueError, CifarkitError) as e:  # one image's problem: report it, classify the others
            failed += 1
            print(f"cifarkit: error: {e}", file=sys.stderr)
            results.append({"path": path, "error": str(e)})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if "error" in r:
                continue
            others = ", ".join(f"{t['label']} {100 * t['confidence']:.1f}%" for t in r["topk"][1:])
            print(f"{r['path']}: {r['label']} ({100 * r['confidence']:.1f}%)" + (f"; then {others}" if others else ""))
    if failed:
        raise CifarkitError(f"{failed} of {len(args.images)} images could not be classified")


def cmd_export(args) -> None:
    from cifarkit.release.export import export
    report = export(args.release, args.format, args.out)
    print(f"wrote {report['path']} ({report['size_bytes'] / 1e6:.1f} MB); parity on {report['images']} real test "
          f"images: max abs logit difference {report['max_abs_logit_diff']:.2e}, top-1 agreement "
          f"{100 * report['top1_agreement']:.2f}%")


def cmd_serve(args) -> None:
    from cifarkit.serving.serve import ServeSettings, serve
    # The options left out keep ServeSettings' defaults, the one place they are set (and explained).
    given = {name: getattr(args, name) for name in SERVE_SETTINGS if getattr(args, name) is not None}
    settings = ServeSettings(**given, verify=not args.no_verify)
    serve(args.model, host=args.host, port=args.port, settings=settings, access_log=args.access_log)


def _bounded(low, high=None, kind=int, why: str = ""):
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


def _command(group, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with the line that lists it."""
    return group.add_parser(name, help=summary, description=summary)


EPILOG = ("Start with `cifarkit train` (the fast recipe; `cifarkit recipes` lists the others), then "
          "`cifarkit eval RUN_DIR`. `cifarkit COMMAND --help` shows a command's options.")


def options(parser: argparse.ArgumentParser | None = None, command: str = "cifarkit"):
    """(command, option strings or the argument's name, dest, help) of every argument of every command, subcommands
    included: what `--help` shows, as data."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from options(subparser, f"{command} {name}")
        else:
            yield command, "/".join(action.option_strings) or action.dest, action.dest, action.help


def build_parser() -> argparse.ArgumentParser:
    # Nothing here imports torch: `cifarkit --help` and argument errors answer at once. Choices that live in the
    # registries (models, benchmark modes) are checked by the stage, whose error lists them.
    import cifarkit
    parser = argparse.ArgumentParser(prog="cifarkit", description=cifarkit.__doc__.strip(), epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"cifarkit {cifarkit.__version__}")
    # No dest: a missing command is then named by its choices, e.g. "required: {import,info,show}".
    sub = parser.add_subparsers(required=True, title="commands")

    p = _command(sub, "env", "report the device, CUDA/cuDNN, bf16 support and threads")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_env)

    p = _command(sub, "models", "list the registered models with parameters and MACs")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)

    p = _command(sub, "recipes", "list the built-in recipes, or show one recipe's values and the reason for each")
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="a built-in recipe name or a YAML path")
    p.set_defaults(func=cmd_recipes)

    data_sub = _command(sub, "data", "import, inspect and show CIFAR-10").add_subparsers(required=True,
                                                                                         title="commands")
    p = _command(data_sub, "import", "verify an archive or folder in the python layout and cache it")
    p.add_argument("path", help="cifar-10-python.tar.gz or the folder it unpacks to (a local path, not a URL)")
    p.set_defaults(func=cmd_data_import)
    p = _command(data_sub, "info", "counts per split and class, content sha256")
    p.add_argument("--json", action="store_true", help="print the counts and checksums as JSON")
    p.set_defaults(func=cmd_data_info)
    p = _command(data_sub, "show", "write a labelled grid of sample images")
    p.add_argument("--out", required=True, help="figure file to write: .png, .jpg/.jpeg, .pdf or .svg")
    p.add_argument("--split", choices=("train", "test"), default="train", help="images to draw from (default: train)")
    p.add_argument("--count", type=_bounded(1, GRID_MAX, why="a bigger grid is no longer a picture"), default=64,
                   help=f"images in the grid, 1 to {GRID_MAX} (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pick (default: 0)")
    p.set_defaults(func=cmd_data_show)

    p = _command(sub, "train", f"train a recipe (default: {DEFAULT_RECIPE}) into a run folder")
    _add_recipe_options(p)
    p.add_argument("--out", help="run folder (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--nproc", type=_bounded(1), default=1, metavar="N",
                   help="train on N processes of this machine, through torchrun: data-parallel, one GPU each on CUDA "
                        "(default: 1)")
    p.set_defaults(func=cmd_train)

    p = _command(sub, "eval", "test accuracy, per-class accuracy and confusion matrix of trained weights")
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

    p = _command(sub, "speedrun", "train a recipe over N seeds; report mean, std, CI, t-test and wall time")
    _add_recipe_options(p, skip=("seed",))  # --first-seed sets the seeds
    p.add_argument("--runs", type=_bounded(1), default=5, help="runs, one per seed (default: 5)")
    p.add_argument("--first-seed", type=int, default=0, help="seed of the first run; the others count up (default: 0)")
    p.add_argument("--target", type=_bounded(0.0, 1.0, float, why="an accuracy: 0.94 is 94%"), default=0.94,
                   help="accuracy to test the mean against (default: 0.94)")
    p.add_argument("--no-curve", action="store_true", help="skip the per-epoch test passes (they count as time)")
    p.add_argument("--out", help="folder for the runs (default: runs/speedrun-<recipe>-<time>)")
    p.add_argument("--json", help="also write the report to this file")
    p.set_defaults(func=cmd_speedrun)

    p = _command(sub, "bench", "training img/s per model and precision (prints a table, writes JSON)")
    p.add_argument("--models", nargs="+", help="registered model names (default: all; `cifarkit models` lists them)")
    p.add_argument("--modes", nargs="+",
                   help="precision and memory layout: fp32, fp32+cl, bf16+cl, fp16+cl (cl = channels-last; "
                        "default: fp32 bf16+cl); the first is the baseline of the speed-up column. With --devices "
                        "also amp, each device's default mixed precision (default there: fp32 amp)")
    p.add_argument("--batch-size", type=_bounded(1, 50_000, why="CIFAR-10 has 50,000 training images"), default=128,
                   help="images per step (default: 128)")
    p.add_argument("--steps", type=_bounded(1), default=10, help="timed steps per measurement (default: 10)")
    p.add_argument("--rounds", type=_bounded(1), default=3,
                   help="interleaved rounds; the table shows each configuration's median (default: 3)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA, then MPS, then the CPU")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--nproc", type=_bounded(1), nargs="+", metavar="N",
                   help="measure data-parallel scaling instead: the first model (default fastnet) in the last mode, "
                        "on N processes each, launched by torchrun")
    p.add_argument("--devices", nargs="+", choices=("cpu", "cuda", "mps"),
                   help="the CPU-vs-GPU report instead: every model on each of these devices that is available "
                        "(cpu included), against the CPU in fp32, with peak memory and inference img/s; --json "
                        "also writes a bar chart beside it (.png)")
    p.set_defaults(func=cmd_bench)

    p = _command(sub, "profile", "where a recipe's training step spends its time (torch.profiler table, page faults)")
    _add_recipe_options(p)
    p.add_argument("--steps", type=_bounded(1), default=10, help="steps timed, then as many profiled (default: 10)")
    p.add_argument("--json", help="also write the results to this file")
    p.set_defaults(func=cmd_profile)

    p = _command(sub, "release", "package a finished run as a versioned release folder, or check one")
    p.add_argument("run_dir", nargs="?", help="folder of a finished `cifarkit train` run")
    p.add_argument("--name", help="version name: writes <out>/version_<name>")
    p.add_argument("--check", metavar="RELEASE",
                   help="verify every file of a release (a version name or a release folder) against its metrics.json")
    p.add_argument("--out", default="cifar10_models", help="folder holding the releases (default: cifar10_models)")
    p.add_argument("--force", action="store_true", help="replace an existing release of that name")
    p.add_argument("--weights-dtype", choices=("fp32", "fp16", "int8"), default="fp32",
                   help="fp16 halves the file, int8 (per-channel filters and head) quarters it; the metrics are "
                        "measured on the stored weights either way")
    p.add_argument("--speedrun", help="speedrun JSON of the same recipe, for n, mean and std across seeds")
    p.add_argument("--keep-onnx", action="store_true", help="keep the model.onnx the speed measurement used")
    p.add_argument("--register", metavar="MODEL",
                   help="also register the release (after --check, the checked one) as a new version of this MLflow "
                        "registered model (MLFLOW_TRACKING_URI; needs the mlflow extra)")
    p.add_argument("--alias", help="with --register: point this alias of the model (e.g. champion) at the new version")
    p.set_defaults(func=cmd_release)

    p = _command(sub, "compare", "markdown table and PNG chart of the releases in a folder")
    p.add_argument("root", nargs="?", help="folder of version_* releases (default: ./cifar10_models and the shipped "
                                          "releases, as names resolve)")
    p.add_argument("--figure", help="chart to write, .png/.jpg/.pdf/.svg (default: comparison.png in ROOT, or here)")
    p.set_defaults(func=cmd_compare)

    p = _command(sub, "predict", "classify image files with a release")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...; any size)")
    p.add_argument("--model", default="A", help="version name (./cifar10_models/version_NAME, then the shipped A, "
                                                "B), or a release folder, run folder or .safetensors path")
    p.add_argument("--topk", type=_bounded(1, 10, why="CIFAR-10 has 10 classes"), default=1, metavar="K",
                   help="show the K most likely classes per image (default: 1)")
    p.add_argument("--json", action="store_true", help="one JSON list with an object per image")
    p.add_argument("--backend", default="auto", choices=("auto", "torch-fp32", "torch-bf16", "onnxruntime"),
                   help="auto: the one the release's metrics.json recommends (default: auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="use the release's weights (and model.onnx) even if they differ from what metrics.json records")
    p.set_defaults(func=cmd_predict)

    p = _command(sub, "serve", "an HTTP API with dynamic batching, Prometheus metrics and a web page")
    p.add_argument("--model", nargs="+", default=["A", "B"], metavar="MODEL",
                   help="releases to serve: version names or paths, as `predict --model` takes them; the first is "
                        "the default of /v1/predict (default: A B)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every network)")
    p.add_argument("--port", type=_bounded(0, 65535), default=8000, help="TCP port; 0 picks a free one (default: 8000)")
    p.add_argument("--max-batch", type=_bounded(1, 4096),
                   help="most images per forward pass; 1 turns batching off (default: 64)")
    p.add_argument("--max-wait-ms", type=_bounded(0.0, 10_000.0, float),
                   help="most a batch waits for more images after its first arrived (default: 5)")
    p.add_argument("--max-queue", type=_bounded(1), help="images queued per model before requests get 503 "
                                                         "(default: 512)")
    p.add_argument("--timeout-s", type=_bounded(0.001, kind=float),
                   help="a request not answered in this time gets 504 (default: 10)")
    p.add_argument("--read-timeout-s", type=_bounded(0.001, kind=float),
                   help="a connection that has not sent a whole request this long after it opened or after its last "
                        "answer is closed: idle and slow clients (default: 10)")
    p.add_argument("--max-body-mb", type=_bounded(0.001, kind=float),
                   help="larger request bodies get 413 before they are read (default: 10)")
    p.add_argument("--threads", type=_bounded(1),
                   help="torch intra-op threads of the model thread (default: one per core but one, which the event "
                        "loop and the image decoding take)")
    p.add_argument("--backend", choices=("auto", "torch-fp32", "torch-bf16", "onnxruntime"),
                   help="auto: the one each release's metrics.json recommends (default: auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="serve weights even if they differ from what their metrics.json records")
    p.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    p.set_defaults(func=cmd_serve)

    p = _command(sub, "export", "write ONNX / torch.export / TorchScript of a release, checked for parity")
    p.add_argument("release", help="version name or release folder")
    p.add_argument("--out", type=Path, help="write the artifact and its record (ARTIFACT.json) into this folder and "
                                            "leave the release as it is (default: into the release, recorded in its "
                                            "metrics.json; a shipped release's into the current folder)")
    p.add_argument("--format", required=True, choices=("onnx", "exported", "torchscript"),
                   help="onnx: model.onnx; exported: torch.export's model.pt2; torchscript: model.torchscript.pt")
    p.set_defaults(func=cmd_export)
    return parser


# Commands that train: they run on tcmalloc when it is installed (allocator.py).
TRAINING_COMMANDS = ("train", "speedrun", "bench", "profile")


def entry() -> int:
    """The `cifarkit` command as installed: a training command first restarts itself on tcmalloc, then runs."""
    if sys.argv[1:2] and sys.argv[1] in TRAINING_COMMANDS:
        from cifarkit.core import allocator
        allocator.restart_on_tcmalloc(sys.argv[1:])
    return main()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args.func(args)
        sys.stdout.flush()  # a reader that has gone away shows here, not in the flush at exit that prints a traceback
    except BrokenPipeError:
        # `cifarkit data info | head -1`: the reader has what it wanted. As Python's docs advise (signal module,
        # "Note on SIGPIPE"): stdout goes to devnull so that the flush at exit stays quiet, and the exit code is 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except CifarkitError as e:
        return _fail(str(e))
    except OSError as e:  # disk full, read-only or missing folders, permissions: the system's words and a way out
        return _fail(describe_os_error(e))
    except KeyboardInterrupt as e:  # a training run says how to continue it; other commands simply stop
        return _fail(str(e) or "interrupted", 130)
    return 0


def _fail(message: str, code: int = 2) -> int:
    rank = os.environ.get("RANK", "0")
    line = f"cifarkit: error: {'' if rank == '0' else f'[rank {rank}] '}{message}"
    if sys.stderr.isatty():
        # A progress bar that Ctrl-C cut short as it was being drawn or cleared may still hold the terminal's line:
        # write over all of it, as tqdm itself does.
        try:
            width = os.get_terminal_size(sys.stderr.fileno()).columns
        except OSError:
            width = 0
        line = "\r" + line.ljust(width - 1)
    print(line, file=sys.stderr)
    return code
