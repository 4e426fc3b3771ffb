"""`cifarkit release`, `compare` and `export`: versioned releases, side by side, and their artifacts."""
from __future__ import annotations

import json
from pathlib import Path

from cifarkit.cli.common import command
from cifarkit.core.errors import CifarkitError


def cmd_release(args) -> None:
    if args.alias and not args.register:
        raise CifarkitError("--alias names an alias of the registered model: give --register MODEL too")
    if args.check:
        from cifarkit.artifacts.releases import release_dir
        from cifarkit.release.check import check
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
    from cifarkit.release.compare import compare, holds_releases
    # Beside the releases of the one folder of releases named; otherwise (the shipped ones lie inside the package)
    # in the current folder.
    only = Path(args.releases[0]) if len(args.releases) == 1 else None
    beside = only if only and holds_releases(only) else Path()
    figure = Path(args.figure) if args.figure else beside / "comparison.png"
    print(compare(args.releases, figure))
    print(f"\nchart of the measured releases: {figure}")


def cmd_export(args) -> None:
    from cifarkit.release.export import export
    report = export(args.release, args.format, args.out)
    print(f"wrote {report['path']} ({report['size_bytes'] / 1e6:.1f} MB); parity on {report['images']} real test "
          f"images: max abs logit difference {report['max_abs_logit_diff']:.2e}, top-1 agreement "
          f"{100 * report['top1_agreement']:.2f}%"
          + (f"; an {report['precision']} engine for the {report['gpu']}, TensorRT {report['tensorrt']}"
             if "gpu" in report else ""))


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    p = command(sub, "release", "package a finished run as a versioned release folder, or check one")
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
    p = command(sub, "compare", "releases side by side with the seed's A and B: a markdown table and a PNG chart")
    p.add_argument("releases", nargs="*", metavar="RELEASE",
                   help="version names (A B), release folders, or folders of version_* releases (default: every "
                        "release a name reaches: ./cifar10_models and the shipped ones)")
    p.add_argument("--figure", help="chart to write, .png/.jpg/.pdf/.svg (default: comparison.png in ROOT, or here)")
    p.set_defaults(func=cmd_compare)
    p = command(sub, "export", "write ONNX / torch.export / TorchScript / TensorRT of a release, checked for parity")
    p.add_argument("release", help="version name or release folder")
    p.add_argument("--out", type=Path, help="write the artifact and its record (ARTIFACT.json) into this folder and "
                                            "leave the release as it is (default: into the release, recorded in its "
                                            "metrics.json; a shipped release's into the current folder)")
    p.add_argument("--format", required=True, choices=("onnx", "exported", "torchscript", "tensorrt"),
                   help="onnx: model.onnx; exported: torch.export's model.pt2; torchscript: model.torchscript.pt; "
                        "tensorrt: model.plan, an fp16 TensorRT engine of batch 256 for this machine's kind of GPU "
                        "(needs a CUDA GPU and `pip install tensorrt`)")
    p.set_defaults(func=cmd_export)
