"""`cifarkit bench`, `profile`, `speedrun` and `reference`: training speed, where a step spends it, timed runs, and
the published airbench speedruns side by side."""
from __future__ import annotations

import shlex
from pathlib import Path

from cifarkit.cli.common import (
    DEFAULT_RECIPE,
    DEVICES,
    add_recipe_options,
    bounded,
    command,
    command_line,
    overrides,
    plural,
)

BENCH_MODES = ["fp32", "bf16+cl"]  # bench's default: a CPU's plain and fast training


def cmd_bench(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    from cifarkit.core.errors import CifarkitError
    from cifarkit.core.files import write_json
    from cifarkit.models import names
    from cifarkit.tools.benchmark import SPEED_ONLY, peak_memory, train_throughput
    from cifarkit.training import distributed
    from cifarkit.training.tracking import stamp
    if args.no_cudnn_benchmark and (args.nproc or args.devices):
        raise CifarkitError("--no-cudnn-benchmark is for one measurement on CUDA: --devices measures cuDNN's "
                            "autotuning on and off by itself, and --nproc measures with it on, as training runs")
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
                                group, cudnn_benchmark=not args.no_cudnn_benchmark)
    finally:
        distributed.finish(group)
    if not group.writes:
        return
    env = report(device)
    print("\n".join(describe(env)))
    print(f"\ntraining throughput, batch {args.batch_size}, median of {plural(args.rounds, 'round')} of "
          f"{plural(args.steps, 'step')}")
    print(f"| model | mode | img/s | vs {modes[0]} |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['images_per_s']:.0f} | {r[f'speedup_vs_{modes[0]}']:.2f}x |")
    print(SPEED_ONLY)
    if args.json:
        import resource
        usage = resource.getrusage(resource.RUSAGE_SELF)  # the allocator's share shows in page faults and system time
        peak, kind = peak_memory(device)
        write_json(args.json, {**stamp(), "environment": env, "accuracy": SPEED_ONLY, "batch_size": args.batch_size,
                               "steps": args.steps, "rounds": args.rounds, "results": rows,
                               "process": {"minor_page_faults": usage.ru_minflt, "system_s": usage.ru_stime,
                                           "user_s": usage.ru_utime},
                               "peak_memory": {"bytes": peak, "kind": kind},
                               "cudnn_benchmark": not args.no_cudnn_benchmark if device.type == "cuda" else None})
        print(f"wrote {args.json}")


def _bench_devices(args) -> None:
    from cifarkit.core.device import describe, report
    from cifarkit.core.files import write_json
    from cifarkit.models import names
    from cifarkit.tools.benchmark import AMP, SPEED_ONLY, comparison_tables, device_report, device_table
    from cifarkit.training.plots import device_speedups
    from cifarkit.training.tracking import stamp
    result = device_report(args.devices, args.models or names(), args.modes or ["fp32", AMP], args.batch_size,
                           args.steps, args.rounds)
    env = report()
    print("\n".join(describe(env)))
    print(f"\ntraining and inference per device, batch {args.batch_size}, median of {plural(args.rounds, 'round')} "
          f"of {plural(args.steps, 'step')}, each measured in a process of its own")
    print(device_table(result))
    tables = comparison_tables(result["comparisons"])
    if tables:
        print(f"\n{tables}")
    print(SPEED_ONLY)
    for what, why in result["skipped"].items():
        print(f"skipped {what}: {why}")
    if args.json:
        chart = Path(args.json).with_suffix(".png")
        device_speedups(result, chart)
        write_json(args.json, {**stamp(), "environment": env, "command": command_line(args), "accuracy": SPEED_ONLY,
                               **result})
        print(f"wrote {args.json} and {chart}")


def _bench_scaling(args) -> None:
    from cifarkit.core.device import describe, pick_device, report
    from cifarkit.core.files import write_json
    from cifarkit.tools.benchmark import SPEED_ONLY, scaling
    from cifarkit.training.tracking import stamp
    device = pick_device(args.device)
    model, mode = (args.models or ["fastnet"])[0], (args.modes or BENCH_MODES)[-1]
    result = scaling(args.nproc, model, mode, device, args.batch_size, args.steps, args.rounds)
    env = report(device)
    print("\n".join(describe(env)))
    print(f"\ndata-parallel scaling of {model} ({mode}), global batch {args.batch_size}, median of "
          f"{plural(args.rounds, 'round')} of {plural(args.steps, 'step')}, each count launched by torchrun")
    print("| processes | img/s | speed-up | efficiency |\n|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['processes']} | {r['images_per_s']:.0f} | {r['speedup']:.2f}x | {100 * r['efficiency']:.0f}% |")
    print(f"evaluation on rank 0 alone: {result['eval_images_per_s']:.0f} img/s, "
          f"{result['eval_images'] / result['eval_images_per_s']:.1f} s per pass over {result['eval_images']:,} images")
    print(SPEED_ONLY)
    if args.json:
        write_json(args.json, {**stamp(), "environment": env, "command": command_line(args),
                               "accuracy": SPEED_ONLY, "scaling": result})
        print(f"wrote {args.json}")


def cmd_profile(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import profiling
    from cifarkit.training.config import load_recipe
    from cifarkit.training.tracking import stamp
    if args.before:
        _profile_against(args)
        return
    result = profiling.run(load_recipe(args.recipe or DEFAULT_RECIPE, overrides(args)), args.steps)
    print(profiling.table(result))
    if args.json:
        write_json(args.json, {**stamp(), "command": command_line(args), **result})
        print(f"wrote {args.json}")


def _profile_against(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import step_ab
    from cifarkit.training.config import load_recipe
    from cifarkit.training.tracking import stamp
    recipe = args.recipe or DEFAULT_RECIPE
    load_recipe(recipe, overrides(args))  # a bad value fails here, before the worktree and the minutes of profiling
    result = step_ab.compare(args.before, recipe, overrides(args), args.steps, args.pairs)
    print(step_ab.summary(result))
    out = args.json or f"results/profile-ab-{Path(recipe).stem}-{result['cpu_kind']}.json"
    write_json(out, {**stamp(), "command": command_line(args), **result})
    print(f"wrote {out}")


def cmd_speedrun(args) -> None:
    from cifarkit.core.files import write_json
    from cifarkit.tools import speedrun
    from cifarkit.training.config import check_seed
    check_seed(args.first_seed, "--first-seed")
    check_seed(args.first_seed + args.runs - 1, "the last seed, --first-seed + --runs - 1")
    report = speedrun.run(args.recipe or DEFAULT_RECIPE, args.runs, args.target, Path(args.out) if args.out else None,
                          args.first_seed, curve=not args.no_curve, overrides=tuple(overrides(args)),
                          command=command_line(args))
    print(speedrun.table(report))
    print(f"timer: {report['timer_covers']}")
    print(f"wrote {report['out_dir']}/speedrun.json and speedrun.png")
    if args.json:
        write_json(args.json, {k: v for k, v in report.items() if k != "out_dir"})
        print(f"wrote {args.json}")


def cmd_reference(args) -> None:
    from cifarkit.tools import reference
    from cifarkit.training.config import check_seed
    references = args.references or list(reference.GOALS)
    reference.check_references(references)
    given = {reference.MUON: args.muon, reference.RECORD: args.record}
    files = {name: copy.check(given[name]) for name, copy in reference.USER_COPIES.items() if name in references}
    check_seed(args.first_seed, "--first-seed")
    check_seed(args.first_seed + args.runs - 1, "the last seed, --first-seed + --runs - 1")
    reference.check_variant(args.recipe, args.set)
    result = reference.compare(files=files, references=references, runs=args.runs, first_seed=args.first_seed,
                               recipe=args.recipe, overrides=args.set, brackets=args.bracket_epochs,
                               subset=args.subset, json_path=args.json,
                               command=_reference_command(args, references, files))
    print(reference.table(result))
    if args.json:
        print(f"wrote {args.json}")


def _reference_command(args, references: list[str], files: dict[str, Path]) -> str:
    """The command in full, for the results: every option spelled out (a later default may differ, and the README
    reads the rounds asked for from --runs), and the user's copies of the references by their names alone."""
    from cifarkit.core.files import portable
    from cifarkit.tools.reference import USER_COPIES
    words = ["cifarkit", "reference"]
    for name, file in files.items():
        words += [USER_COPIES[name].option, file.name]
    words += ["--references", *references, "--runs", str(args.runs), "--first-seed", str(args.first_seed),
              "--recipe", args.recipe]
    for override in args.set:
        words += ["--set", override]
    if args.bracket_epochs:
        words += ["--bracket-epochs", *(f"{epochs:g}" for epochs in args.bracket_epochs)]
    words += (["--subset", str(args.subset)] if args.subset else []) + (["--json", portable(args.json)]
                                                                         if args.json else [])
    return " ".join(map(shlex.quote, words))


def cmd_results(args) -> None:
    from cifarkit.core.errors import CifarkitError
    from cifarkit.tools import results
    folder = Path(args.folder)
    if not folder.is_dir():
        raise CifarkitError(f"{folder} is not a folder; give the folder your commands' --json files went to "
                            f"(default: results)")
    print(f"## What to expect, from the current files of {folder}\n\n{results.expect_table(folder)}\n")
    print(f"## Every file of {folder}, by the question it answers\n\n{results.index_table(folder)}")


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    p = command(sub, "speedrun", "train a recipe over N seeds; report mean, std, CI, t-test and wall time")
    add_recipe_options(p, skip=("seed",))  # --first-seed sets the seeds
    p.add_argument("--runs", type=bounded(1), default=5, help="runs, one per seed (default: 5)")
    p.add_argument("--first-seed", type=int, default=0, help="seed of the first run; the others count up (default: 0)")
    p.add_argument("--target", type=bounded(0.0, 1.0, float, why="an accuracy: 0.94 is 94%"), default=0.94,
                   help="accuracy to test the mean against (default: 0.94)")
    p.add_argument("--no-curve", action="store_true", help="skip the per-epoch test passes (they count as time)")
    p.add_argument("--out", help="folder for the runs (default: runs/speedrun-<recipe>-<time>)")
    p.add_argument("--json", help="also write the report to this file")
    p.set_defaults(func=cmd_speedrun)
    p = command(sub, "results", "what a folder of results says: per device, what to expect from its current files; "
                                "then every file, current or superseded, with where, when and at which commit")
    p.add_argument("folder", nargs="?", default="results",
                   help="the folder the --json files of speedrun, reference, bench-serve and the others went to, "
                        "superseded ones in its archive/ (default: results)")
    p.set_defaults(func=cmd_results)
    p = command(sub, "bench", "training img/s per model and precision (prints a table, writes JSON)")
    p.add_argument("--models", nargs="+", help="registered model names (default: all; `cifarkit models` lists them)")
    p.add_argument("--modes", nargs="+",
                   help="precision and memory layout: fp32, fp32+cl, bf16+cl, fp16+cl (cl = channels-last; "
                        "default: fp32 bf16+cl); the first is the baseline of the speed-up column. With --devices "
                        "also amp, each device's default mixed precision (default there: fp32 amp)")
    p.add_argument("--batch-size", type=bounded(1, 50_000, why="CIFAR-10 has 50,000 training images"), default=128,
                   help="images per step (default: 128)")
    p.add_argument("--steps", type=bounded(1), default=10, help="timed steps per measurement (default: 10)")
    p.add_argument("--rounds", type=bounded(1), default=3,
                   help="interleaved rounds; the table shows each configuration's median (default: 3)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA, then MPS, then the CPU")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--no-cudnn-benchmark", action="store_true",
                   help="on CUDA, measure with cuDNN's autotuning (torch.backends.cudnn.benchmark) off, which training "
                        "always turns on: what it gains")
    p.add_argument("--nproc", type=bounded(1), nargs="+", metavar="N",
                   help="measure data-parallel scaling instead: the first model (default fastnet) in the last mode, "
                        "on N processes each, launched by torchrun")
    p.add_argument("--devices", nargs="+", choices=("cpu", "cuda", "mps"),
                   help="the CPU-vs-GPU report instead: every model on each of these devices that is available "
                        "(cpu included), against the CPU in fp32, with peak memory and inference img/s, each "
                        "configuration in a process of its own; on CUDA the last mode also with cuDNN's autotuning "
                        "off; then each device against the CPU, each mode against fp32, and autotuning on against "
                        "off; --json also writes a bar chart beside it (.png)")
    p.set_defaults(func=cmd_bench)
    p = command(sub, "profile", "where a recipe's training step spends its time (torch.profiler table, page faults)")
    add_recipe_options(p)
    p.add_argument("--steps", type=bounded(1), default=10, help="steps timed, then as many profiled (default: 10)")
    p.add_argument("--before", metavar="COMMIT",
                   help="compare the step with a commit's instead: whole profiles of each, taking turns, from a "
                        "git checkout; writes results/profile-ab-RECIPE-KIND.json unless --json")
    p.add_argument("--pairs", type=bounded(1), default=3,
                   help="with --before: before/after pairs, in ABBA order (default: 3)")
    p.add_argument("--json", help="also write the results to this file")
    p.set_defaults(func=cmd_profile)
    p = command(sub, "reference", "time a recipe against the published CIFAR-10 speedruns in alternating rounds; "
                                  "the speed-up at equal accuracy, each ratio beside the accuracy difference")
    p.add_argument("--muon", help="your copy of airbench94_muon.py, one file of "
                                  "github.com/KellerJordan/cifar10-airbench (not a package, and not in cifarkit: "
                                  "without it, the error gives the command that downloads it)")
    p.add_argument("--record", help="your copy of cifar10_speedrun.py, the 2025 record, one file of "
                                    "github.com/hiverge/cifar10-speedrun (likewise)")
    p.add_argument("--references", nargs="+", metavar="NAME",
                   help="the references to run: airbench94_muon, cifar10_speedrun, airbench94 (default: the first "
                        "two, those the goals name)")
    p.add_argument("--runs", type=bounded(1), default=3,
                   help="rounds, each a run of every side, in alternating order (default: 3; 8 or more for the "
                        "verdict at equal accuracy)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seed of the first round; the others count up (default: 0)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE,
                   help=f"cifarkit's side: a built-in recipe name or a YAML path (default: {DEFAULT_RECIPE})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of cifarkit's recipe, as `cifarkit train --set` does (repeatable): time a "
                        "variant of it")
    p.add_argument("--bracket-epochs", type=bounded(0.0, 1000.0, float, why="a training budget in epochs"),
                   nargs="+", default=[], metavar="E",
                   help="also train the recipe for E epochs in every round: with its own budget, these bracket a "
                        "reference's accuracy, and the speed-up is read at equal accuracy (8 for `fast`)")
    p.add_argument("--subset", type=bounded(1, 50_000, why="CIFAR-10 has 50,000 training images"),
                   help="train every side on this many images: a check that everything runs, not a comparison")
    p.add_argument("--json", help="write the results to this file after each round; rounds it already holds with "
                                  "the same settings are kept, and only the others run")
    p.set_defaults(func=cmd_reference)
