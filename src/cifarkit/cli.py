"""The `cifarkit` command: parses arguments and calls the stages, nothing more."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from cifarkit.errors import LOG_FORMAT, CifarkitError, describe_os_error

DEFAULT_RECIPE = "fast"  # the most accurate recipe per minute on any device; see README measurements


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


def cmd_env(args) -> None:
    from cifarkit.device import describe, pick_device, report
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
    from cifarkit.config import builtin_recipes, load_recipe
    for name in sorted(builtin_recipes()):
        default = " (default)" if name == DEFAULT_RECIPE else ""
        print(f"{name:<16} {load_recipe(name).description}{default}")


def cmd_data_import(args) -> None:
    from cifarkit import data
    dataset = data.import_data(args.path)
    print(f"imported {len(dataset.train_y):,} train and {len(dataset.test_y):,} test images into {data.cache_path()}")
    print(f"content sha256 {dataset.sha256}")


def cmd_data_info(args) -> None:
    import torch
    from cifarkit import data
    dataset = data.load()
    info = {"source": dataset.source, "cache": str(data.cache_path()), "sha256": dataset.sha256, "splits": {}}
    for split, x, y in (("train", dataset.train_x, dataset.train_y), ("test", dataset.test_x, dataset.test_y)):
        counts = torch.bincount(y, minlength=10).tolist()
        info["splits"][split] = {"images": len(y), "per_class": dict(zip(data.CLASSES, counts)),
                                 "images_sha256": data.content_sha256(x), "labels_sha256": data.content_sha256(y)}
    if args.json:
        _print_json(info)
        return
    print(f"source: {info['source']}\ncache: {info['cache']}\ncontent sha256: {info['sha256']}")
    for split, s in info["splits"].items():
        print(f"{split}: {s['images']:,} images; images sha256 {s['images_sha256']}, labels sha256 {s['labels_sha256']}")
        print("  " + ", ".join(f"{name} {count}" for name, count in s["per_class"].items()))


def cmd_data_show(args) -> None:
    import torch
    from cifarkit import data, plots
    dataset = data.load()
    x, y = (dataset.train_x, dataset.train_y) if args.split == "train" else (dataset.test_x, dataset.test_y)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))[:args.count]
    plots.sample_grid(x[idx], y[idx], data.CLASSES, Path(args.out))
    print(f"wrote {args.out} ({len(idx)} {args.split} images)")


SHORTCUTS = {"epochs": "train.epochs", "batch_size": "train.batch_size", "lr": "optim.lr", "seed": "train.seed",
             "subset": "data.subset", "device": "train.device", "precision": "train.precision"}


def cmd_train(args) -> None:
    from cifarkit import train
    from cifarkit.config import load_recipe
    if args.resume:
        changed = [f"--{k.replace('_', '-')}" for k in SHORTCUTS if getattr(args, k) is not None]
        if args.recipe or args.set or args.out or args.compile or changed:
            raise CifarkitError("--resume continues a run exactly as configured; drop the other options")
        train.run(resume=Path(args.resume))
        return
    overrides = list(args.set)
    overrides += [f"{key}={getattr(args, flag)}" for flag, key in SHORTCUTS.items() if getattr(args, flag) is not None]
    if args.compile:
        overrides.append("train.compile=true")
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE, overrides)
    train.run(recipe, out=Path(args.out) if args.out else None)


def cmd_eval(args) -> None:
    from cifarkit.evaluation import evaluate_weights
    result = evaluate_weights(Path(args.target), tta=args.tta, device=args.device,
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
    from cifarkit.benchmark import train_throughput
    from cifarkit.device import describe, pick_device, report
    from cifarkit.files import write_json
    from cifarkit.models import names
    device = pick_device(args.device)
    rows = train_throughput(args.models or names(), args.modes, device, args.batch_size, args.steps, args.rounds)
    env = report(device)
    print("\n".join(describe(env)))
    print(f"\ntraining throughput, batch {args.batch_size}, median of {args.rounds} rounds of {args.steps} steps")
    print(f"| model | mode | img/s | vs {args.modes[0]} |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['images_per_s']:.0f} | {r[f'speedup_vs_{args.modes[0]}']:.2f}x |")
    if args.json:
        write_json(args.json, {"environment": env, "batch_size": args.batch_size, "steps": args.steps,
                               "rounds": args.rounds, "results": rows})
        print(f"wrote {args.json}")


def cmd_speedrun(args) -> None:
    from cifarkit import speedrun
    from cifarkit.files import write_json
    if args.runs < 1:
        raise CifarkitError(f"--runs must be at least 1, got {args.runs}")
    report = speedrun.run(args.recipe, args.runs, args.target, Path(args.out) if args.out else None,
                          args.first_seed, curve=not args.no_curve, overrides=tuple(args.set))
    print(speedrun.table(report))
    print(f"timer: {report['timer_covers']}")
    print(f"wrote {report['out_dir']}/speedrun.json and speedrun.png")
    if args.json:
        write_json(args.json, {k: v for k, v in report.items() if k != "out_dir"})
        print(f"wrote {args.json}")


def cmd_release(args) -> None:
    if args.check:
        from cifarkit.inference import release_dir
        from cifarkit.release import check
        if args.run_dir or args.name:
            raise CifarkitError("--check RELEASE verifies an existing release; drop RUN_DIR and --name")
        folder = release_dir(args.check)
        findings = check(folder)
        for name, verdict, problem in findings:
            print(f"{verdict:<8}{name}" + (f": {problem}" if problem else ""))
        failed = sum(verdict == "error" for _, verdict, _ in findings)
        if failed:
            raise CifarkitError(f"{folder}: {failed} file(s) failed the check; restore them, or write the release "
                                f"again with `cifarkit release --force`")
        return
    if not (args.run_dir and args.name):
        raise CifarkitError("give the run folder and --name to write a release, or --check RELEASE to verify one")
    from cifarkit.release import make_release
    target = make_release(Path(args.run_dir), args.name, Path(args.out), force=args.force,
                          weights_dtype=args.weights_dtype, speedrun=Path(args.speedrun) if args.speedrun else None,
                          keep_onnx=args.keep_onnx)
    metrics = json.loads((target / "metrics.json").read_text())
    inference = metrics["inference"]
    print(f"released {target}: test accuracy {100 * metrics['test_acc']:.2f}% ({100 * metrics['test_acc_tta']:.2f}% "
          f"with TTA), {metrics['weights_bytes'] / 1e6:.1f} MB of {metrics['weights_dtype']} weights, "
          f"{inference['images_per_s_batch1']:,.0f} img/s at batch 1 and {inference['images_per_s_batch256']:,.0f} "
          f"at batch 256 ({inference['default_backend']})")


def cmd_compare(args) -> None:
    from cifarkit.inference import SHIPPED
    from cifarkit.release import compare
    root = Path(args.root) if args.root else SHIPPED
    # Beside the user's releases; for the shipped ones (inside the package), in the current folder.
    figure = Path(args.figure) if args.figure else (root if args.root else Path()) / "comparison.png"
    print(compare(root, figure))
    print(f"\nchart: {figure}")


def cmd_predict(args) -> None:
    from cifarkit.inference import Classifier, release_dir
    classifier = Classifier.load(release_dir(args.model), backend=args.backend, verify=not args.no_verify)
    results, failed = [], 0
    for path in args.images:
        try:
            proba = classifier.predict_proba(path)
        except (ValueError, CifarkitError) as e:  # one image's problem: report it, classify the others
            failed += 1
            print(f"cifarkit: error: {e}", file=sys.stderr)
            results.append({"path": path, "error": str(e)})
            continue
        order = proba.argsort()[::-1][:args.topk]
        results.append({"path": path, "index": int(order[0]), "label": classifier.classes[order[0]],
                        "confidence": float(proba[order[0]]),
                        "topk": [{"index": int(i), "label": classifier.classes[i], "confidence": float(proba[i])}
                                 for i in order]})
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
    from cifarkit.export import export
    from cifarkit.inference import release_dir
    report = export(release_dir(args.release), args.format)
    print(f"wrote {report['file']} ({report['size_bytes'] / 1e6:.1f} MB); parity on {report['images']} real test "
          f"images: max abs logit difference {report['max_abs_logit_diff']:.2e}, top-1 agreement "
          f"{100 * report['top1_agreement']:.2f}%")


def build_parser() -> argparse.ArgumentParser:
    # Nothing here imports torch: `cifarkit --help` and argument errors answer at once. Choices that live in the
    # registries (models, benchmark modes) are checked by the stage, whose error lists them.
    from cifarkit import __version__
    parser = argparse.ArgumentParser(prog="cifarkit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cifarkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="report the device, CUDA/cuDNN, bf16 support and threads")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("models", help="list the registered models with parameters and MACs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    sub.add_parser("recipes", help="list the built-in recipes").set_defaults(func=cmd_recipes)

    data_parser = sub.add_parser("data", help="import, inspect and show CIFAR-10")
    data_sub = data_parser.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("import", help="verify an archive or folder in the python layout and cache it")
    p.add_argument("path")
    p.set_defaults(func=cmd_data_import)
    p = data_sub.add_parser("info", help="counts per split and class, content sha256")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_data_info)
    p = data_sub.add_parser("show", help="write a labelled grid of sample images")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--split", choices=("train", "test"), default="train")
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_data_show)

    p = sub.add_parser("train", help=f"train a recipe (default: {DEFAULT_RECIPE})")
    p.add_argument("--recipe", help="built-in recipe name or YAML path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.weight_decay=5e-4 (repeatable)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--subset", type=int, help="class-balanced subset of N training images")
    p.add_argument("--device", choices=("auto", "cuda", "mps", "cpu"))
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"))
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--out", help="run folder (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="test accuracy, per-class accuracy and confusion matrix of trained weights")
    p.add_argument("target", help="run folder or .safetensors file")
    p.add_argument("--tta", action="store_true", help="test-time augmentation: mirror + 1-pixel shifts, weighted logits")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "mps", "cpu"))
    p.add_argument("--figure", help="confusion-matrix PNG (default: confusion.png beside the weights)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("speedrun", help="train a recipe over N seeds; report mean, std, CI, t-test and wall time")
    p.add_argument("--recipe", default="fast")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--target", type=float, default=0.94, help="accuracy to test the mean against (default 0.94)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--no-curve", action="store_true", help="skip the per-epoch test passes (they count as time)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--out", help="folder for the runs (default: runs/speedrun-<recipe>-<time>)")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(func=cmd_speedrun)

    p = sub.add_parser("bench", help="training img/s per model and precision (prints a table, writes JSON)")
    p.add_argument("--models", nargs="+", help="registered model names (default: all; `cifarkit models` lists them)")
    p.add_argument("--modes", nargs="+", default=["fp32", "bf16+cl"],
                   help="precision and memory layout: fp32, fp32+cl, bf16+cl, fp16+cl (cl = channels-last)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "mps", "cpu"))
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("release", help="package a finished run as a versioned release folder, or check one")
    p.add_argument("run_dir", nargs="?", help="folder of a finished `cifarkit train` run")
    p.add_argument("--name", help="version name: writes <out>/version_<name>")
    p.add_argument("--check", metavar="RELEASE",
                   help="verify every file of a release (shipped version A, B or a folder) against its metrics.json")
    p.add_argument("--out", default="cifar10_models", help="folder holding the releases (default: cifar10_models)")
    p.add_argument("--force", action="store_true", help="replace an existing release of that name")
    p.add_argument("--weights-dtype", choices=("fp32", "fp16"), default="fp32",
                   help="fp16 halves the file; the metrics are measured on the stored weights either way")
    p.add_argument("--speedrun", help="speedrun JSON of the same recipe, for n, mean and std across seeds")
    p.add_argument("--keep-onnx", action="store_true", help="keep the model.onnx the speed measurement used")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("compare", help="markdown table and PNG chart of the releases in a folder")
    p.add_argument("root", nargs="?", help="folder of version_* releases (default: the shipped releases)")
    p.add_argument("--figure", help="PNG to write (default: comparison.png in ROOT, or here for the shipped ones)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("predict", help="classify image files with a release")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--model", default="A", help="shipped version (A, B) or a release folder / .safetensors path")
    p.add_argument("--topk", type=int, default=1, choices=range(1, 11), metavar="K")
    p.add_argument("--json", action="store_true", help="one JSON list with an object per image")
    p.add_argument("--backend", default="auto", choices=("auto", "torch-fp32", "torch-bf16", "onnxruntime"))
    p.add_argument("--no-verify", action="store_true",
                   help="use the release's weights (and model.onnx) even if they differ from what metrics.json records")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("export", help="write ONNX / torch.export / TorchScript into a release, checked for parity")
    p.add_argument("release", help="shipped version (A, B) or a release folder")
    p.add_argument("--format", required=True, choices=("onnx", "exported", "torchscript"))
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except CifarkitError as e:
        return _fail(str(e))
    except OSError as e:  # disk full, read-only or missing folders, permissions: the system's words and a way out
        return _fail(describe_os_error(e))
    except KeyboardInterrupt:
        return _fail("interrupted; an interrupted training run continues with `cifarkit train --resume RUN_DIR`", 130)
    return 0


def _fail(message: str, code: int = 2) -> int:
    print(f"cifarkit: error: {message}", file=sys.stderr)
    return code
