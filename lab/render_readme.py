"""Rewrite the generated blocks of README.md and docs/*.md from the registry and the measurement files in results/.

    python lab/render_readme.py

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, in exactly one of those pages; nothing else
in them is touched. The numbers come only from files that `cifarkit` commands wrote, so the pages cannot drift from
the evidence.
"""
from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from cifarkit import models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core import device
from cifarkit.core.files import write_text
from cifarkit.inference import backends
from cifarkit.models.winograd import blocks as winograd_blocks
from cifarkit.release.compare import compare
from cifarkit.tools.benchmark import device_table
from cifarkit.tools.speedrun import describe_difference, difference_of_means

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
# lab/ab_profile.py records the batch since 2026-12-06; every A/B file written before timed `fast` at batch 2,000,
# its batch until 5276c1b (`git show COMMIT:src/cifarkit/training/recipes/fast.yaml` at each file's "after").
AB_BATCH_BEFORE_RECORDED = 2000


def models_block() -> str:
    lines = ["| model | params | MACs / image |", "|---|---:|---:|"]
    for name in models.names():
        model = models.create(name)
        lines.append(f"| `{name}` | {models.count_params(model):,} | {models.count_macs(model):,} |")
    return "\n".join(lines)


def _importlinter() -> dict:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _summary(path: Path) -> str:
    """The first sentence of a module's (or a package's __init__'s) docstring."""
    import ast
    paragraph = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
    return re.split(r"(?<=\.) ", paragraph)[0].rstrip(".")


def layers_block() -> str:
    """The layer map of pyproject.toml's `layers` contract, top to bottom, each layer with its modules and what it
    is, read from the package itself, so the map cannot drift from the code or from what `lint-imports` checks."""
    package = ROOT / "src" / "cifarkit"
    [contract] = [c for c in _importlinter()["contracts"] if c["type"] == "layers"]
    lines = ["| layer (imports only from the rows below it) | modules | what it is |", "|---|---|---|"]
    for level in contract["layers"]:
        for name in (part.strip() for part in level.split("|")):
            folder = package / name
            init = folder / "__init__.py" if folder.is_dir() else package / f"{name}.py"
            modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") if folder.is_dir() else []
            shown = f"`{name}`" + (" (independent of the other in this row)" if "|" in level else "")
            lines.append(f"| {shown} | {', '.join(modules) or '-'} | {_summary(init)} |")
    return "\n".join(lines)


def modules_block() -> str:
    """Every module of the package with the first sentence of its docstring, by layer folder."""
    package = ROOT / "src" / "cifarkit"
    lines = ["| module | what it holds |", "|---|---|"]
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or "pretrained" in path.parts:
            continue
        lines.append(f"| `{path.relative_to(package).as_posix()}` | {_summary(path)} |")
    return "\n".join(lines)


def contracts_block() -> str:
    """The other import rules of pyproject.toml's [tool.importlinter], which `lint-imports` checks in CI."""
    lines = ["| rule | modules | may not import |", "|---|---|---|"]
    for contract in _importlinter()["contracts"]:
        if contract["type"] == "layers":
            continue
        if contract["type"] == "acyclic_siblings":
            sources, forbidden = contract["ancestors"], ["one another in a cycle"]
        else:
            sources, forbidden = contract["source_modules"], contract["forbidden_modules"]
        lines.append(f"| {contract['name']} | {', '.join(f'`{m}`' for m in sources)} | "
                     f"{', '.join(f'`{m}`' for m in forbidden)} |")
    return "\n".join(lines)


def full_runs() -> list[tuple[str, dict]]:
    """(folder name, summary) of each kept `cifarkit train` run in results/."""
    return [(path.parent.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*/summary.json"))]


def training_block() -> str:
    lines = ["| run | recipe | epochs | test accuracy | wall time | train time | device | precision | torch |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for folder, s in full_runs():
        lines.append(f"| `results/{folder}` | `{s['recipe']}` | {s['epochs']} | "
                     f"{100 * s['test_acc']:.2f}% | {s['wall_time_s'] / 60:.1f} min | {s['train_time_s'] / 60:.1f} min "
                     f"| {s['device']} | {s['precision']} | {s['torch']} |")
    return "\n".join(lines)


def bench_block() -> str:
    bench = json.loads((RESULTS / "bench-train-cpu.json").read_text())
    env = bench["environment"]
    baseline = bench["results"][0]["mode"]
    model_names = " ".join(dict.fromkeys(r["model"] for r in bench["results"]))
    modes = " ".join(dict.fromkeys(r["mode"] for r in bench["results"]))
    command = (f"cifarkit bench --models {model_names} --modes {modes} --batch-size {bench['batch_size']} "
               f"--steps {bench['steps']} --rounds {bench['rounds']} --json results/bench-train-cpu.json")
    lines = [f"{processor_of(env)}, {env['threads']} threads, torch {env['torch']}, memory allocator "
             f"{env['allocator']}; batch {bench['batch_size']}, median of {bench['rounds']} interleaved rounds of "
             f"{bench['steps']} steps (`{command}`).", "",
             f"| model | mode | training img/s | vs {baseline} |", "|---|---|---:|---:|"]
    for r in bench["results"]:
        lines.append(f"| `{r['model']}` | {r['mode']} | {r['images_per_s']:,.0f} | "
                     f"{r[f'speedup_vs_{baseline}']:.2f}x |")
    return "\n".join(lines)


def speedrun_block() -> str:
    lines = ["| recipe | n | mean test accuracy | std | 95% CI | p (mean > target) | wall time mean / max | device | "
             "machine speed before each run | file |", "|---|---:|---:|---:|---|---:|---:|---|---:|---|"]
    for path in sorted(RESULTS.glob("speedrun-*.json")):
        report = json.loads(path.read_text())
        acc, wall = report["accuracy"], report["wall_time_s"]
        overrides = "".join(f" `{o}`" for o in report["overrides"])
        if acc["std"] is None:
            spread = "n/a | n/a | n/a"
        else:
            spread = (f"{100 * acc['std']:.2f} | [{100 * acc['ci95'][0]:.2f}, {100 * acc['ci95'][1]:.2f}] | "
                      f"{acc['p_value_mean_above_target']:.3g} (target {100 * report['target']:.1f}%)")
        lines.append(f"| `{report['recipe']}`{overrides} | {acc['n']} | {100 * acc['mean']:.2f}% | {spread} | "
                     f"{_duration(wall['mean'])} / {_duration(wall['max'])} | {hardware(report['environment'])} | "
                     f"{machine_speeds(report['runs'])} | "
                     f"`results/{path.name}` |")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def cpu_kind_of(environment: dict) -> str:
    """The CPU kind of a recorded environment; results from before the CPU's features were recorded say so."""
    features = environment.get("cpu_features")
    return backends.cpu_kind(features) if features is not None else "not recorded"


def cpu_kind_block() -> str:
    """What a user can expect per CPU kind: each `fast` speed run and each serving benchmark, with its command."""
    lines = ["| CPU kind | processor | what | measured | command |", "|---|---|---|---|---|"]

    for path, report in fast_speedruns("cpu"):
        acc, wall = report["accuracy"], report["wall_time_s"]
        environment = report["environment"]
        lines.append(f"| {cpu_kind_of(environment)} | {processor_of(environment)} | `fast` training, "
                     f"{_precision(report)} | {100 * acc['mean']:.2f}% mean test accuracy (n = {acc['n']}), "
                     f"{wall['mean'] / 60:.1f} min mean wall time | {_speedrun_command(report)} "
                     f"(`results/{path.name}`) |")
    for path in sorted(RESULTS.glob("compare-reference*.json")):
        compared = json.loads(path.read_text())
        if "references" not in compared or compared["subset"]:  # the first form, or a check that the sides run
            continue
        ours = compared["cifarkit"]
        against = "; ".join(f"{side['speedup']['whole_process']['mean']:.2f}x as fast as {name} (whole process, "
                            f"{100 * side['accuracy']['mean']:.2f}% there)"
                            for name, side in compared["references"].items())
        lines.append(f"| {compared['cpu_kind']} | {processor_of(compared['environment'])} | {_side_of(compared)} "
                     f"training, {compared['precision_policy']}{_code_of(compared)} | "
                     f"{100 * ours['accuracy']['mean']:.2f}% mean test accuracy (n = {_rounds_done(compared)}; "
                     f"{100 * ours['accuracy_6_views']['mean']:.2f}% with 6 TTA views), "
                     f"{ours['wall_time_s'] / 60:.1f} min mean wall time; {against} | `{compared['command']}` "
                     f"(`results/{path.name}`) |")
    for path in sorted(RESULTS.glob("profile-ab-fast-*.json")):  # where no speed run was made on the kind yet
        ab = json.loads(path.read_text())
        after = ab["runs"]["after"]
        step = statistics.fmean(r["step_s"] for r in after)
        batch = after[0].get("batch_size", AB_BATCH_BEFORE_RECORDED)
        half = ab.get("speedup_ci95_half_width")
        spread = f", 95% CI +- {half:.2f}" if half is not None else ""
        lines.append(f"| {ab['cpu_kind']} | {processor_of(ab['environment'])} | `fast` training step, "
                     f"{after[0]['precision']}, batch {batch:,}, {after[0]['allocator']} | {step:.1f} s per step "
                     f"({batch / step:,.0f} img/s) at {ab['after']}, {ab['speedup_mean']:.2f}x the step at "
                     f"{ab['before']} (n = {len(after)} pairs{spread}) | `{ab['command']}` (`results/{path.name}`) |")
    for path in sorted(RESULTS.glob("profile-*.json")):  # `cifarkit profile --json`: the convolutions' share of peak
        if path.name.startswith("profile-ab-"):
            continue
        profiled = json.loads(path.read_text())
        peak = profiled["matmul_peak"]
        # Files from before the computed count have only the direct one.
        rate, counted = next((profiled[key], what) for key, what in (
            ("convolution_computed_flop_per_s", "of the products computed"),
            ("convolution_flop_per_s", "counted as direct convolutions")) if profiled.get(key))
        lines.append(f"| {cpu_kind_of(profiled['environment'])} | {processor_of(profiled['environment'])} | "
                     f"`{profiled['recipe']}` step's convolutions, {profiled['precision']}, batch "
                     f"{profiled['batch_size']:,} | {rate / 1e12:.3f} TFLOP/s {counted}, "
                     f"{rate / peak['flop_per_s']:.2f}x a {peak['size']}^3 {peak['dtype']} matmul's "
                     f"{peak['flop_per_s'] / 1e12:.3f} in the same run; {profiled['step_s']:.1f} s per step | "
                     f"`{profiled['command']}` (`results/{path.name}`) |")
    for path in sorted(RESULTS.glob("serve-bench*.json")):
        bench = json.loads(path.read_text())
        batched = bench["servers"]["batched"]
        # at 64 connections, the serving goals' load, or the most the file measured
        level = min(batched["levels"], key=lambda lv: (lv["concurrency"] != 64, -lv["concurrency"]))
        ratio = next((r["ratio"] for r in bench["summary"]["levels"] if r["concurrency"] == level["concurrency"]),
                     None)
        versus = f"{ratio:.2f}x" if ratio else "n/a"
        options = serve_options(bench)
        options = f" with `{options}`" if options else ""
        lines.append(f"| {cpu_kind_of(bench['environment'])} | {processor_of(bench['environment'])} | serving release "
                     f"{bench['model']} through {batched['served']['backend']}{options}, {level['concurrency']} "
                     f"connections | "
                     f"{level['req_per_s']:,.0f} req/s, p99 {level['p99_ms']:.0f} ms, batched {versus} unbatched | "
                     f"`{bench['command']}` (`results/{path.name}`) |")
    return "\n".join(lines)


def fast_speedruns(device_type: str) -> list[tuple[Path, dict]]:
    """The `fast` speed runs made on `device_type` ("cpu" or "cuda"), each with its file."""
    reports = [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob("speedrun-fast*.json"))]
    return [(path, report) for path, report in reports if report["environment"].get("device", "cpu") == device_type]


def _precision(report: dict) -> str:
    return report["runs"][0].get("run", {}).get("precision", "not recorded")


def _speedrun_command(report: dict) -> str:
    """The command the JSON records; from files written before it did, as far as they tell it: the overrides, and
    --no-curve where no run has a per-epoch curve."""
    if report.get("command"):
        return f"`{report['command']}`"
    overrides = "".join(f" --set {o}" for o in report["overrides"])
    no_curve = " --no-curve" if all(len(r.get("curve", [])) <= 1 for r in report["runs"]) else ""
    return f"`cifarkit speedrun --recipe {report['recipe']} --runs {report['accuracy']['n']}{overrides}{no_curve}`"


def gpu_block() -> str:
    """`fast` on each GPU measured: accuracy, wall time and each run's training time, the first run's included
    (it pays for cuDNN's autotuning), with the torch that ran there."""
    lines = ["| GPU | torch | what | measured | command |", "|---|---|---|---|---|"]
    for path, report in fast_speedruns("cuda"):
        acc, wall, environment = report["accuracy"], report["wall_time_s"], report["environment"]
        training = ", ".join(f"{r['train_time_s']:.1f}" for r in report["runs"])
        lines.append(f"| {environment['gpus'][0]['name']} | {environment['torch']} | `fast` training, "
                     f"{_precision(report)}, not compiled | {100 * acc['mean']:.2f}% mean test accuracy "
                     f"(n = {acc['n']}), {wall['mean']:.1f} s mean wall time; training {training} s by run | "
                     f"{_speedrun_command(report)} (`results/{path.name}`) |")
    return "\n".join(lines) if len(lines) > 2 else "No GPU measured yet: `bash lab/device_check.sh` on one."


def processor_of(environment: dict, *details: str) -> str:
    """The processor's name, with its x86 family and model where recorded (VMs name Zen 3, 4 and 5 alike "AMD EPYC"),
    the ISA caps that made it imitate an older CPU, and `details`."""
    caps = device.caps_text(environment.get("isa_caps") or {})
    details = ((environment["cpu_model"],) if environment.get("cpu_model") else ()) + (*caps, *details)
    return f"{environment['processor']} ({', '.join(details)})" if details else environment["processor"]


def hardware(environment: dict) -> str:
    """The GPU of a CUDA run; else the processor and whether it has AMX, which sets its bf16 training speed (about
    2x that of AVX512-BF16 alone)."""
    if environment.get("device") == "cuda":
        return environment["gpus"][0]["name"]
    features = environment.get("cpu_features")
    if features is None:  # speed runs from before the CPU's instruction sets were recorded
        return processor_of(environment)
    return processor_of(environment, "AMX" if "amx" in features else "no AMX")


def machine_speeds(runs: list[dict]) -> str:
    """The probe's img/s before each run, or why there is none: speed runs from before the probe have none."""
    probed = [r["machine_speed"]["before"]["images_per_s"] for r in runs if r.get("machine_speed")]
    if not probed:
        return "not probed"
    return ", ".join(f"{rate:,.0f}" for rate in probed) + " img/s" + ("" if len(probed) == len(runs) else
                                                                    f" ({len(runs) - len(probed)} not probed)")


def releases_block() -> str:
    return compare(SHIPPED, RESULTS / "releases.png")


def inference_block() -> str:
    """Each shipped release's speeds per CPU kind measured, the accuracy rule's figures `auto` judges on that kind,
    and what it picks there (cifarkit.inference.backends)."""
    lines = ["| release | CPU kind | backend | img/s, batch 1 | ms, batch 1 | img/s, batch 256 | test acc | "
             "top-1 = fp32 | accuracy figures |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for path in sorted(SHIPPED.glob("version_*/metrics.json")):
        m = json.loads(path.read_text())
        inference = m["inference"]
        for kind, table in sorted(backends.speed_tables(inference).items()):
            picked = backends.choose(m, features=list(backends.CPU_KINDS[backends.CPU_KINDS.index(kind):])).backend
            figures, where = backends.accuracy_figures(inference, kind)
            accuracy, agreement = figures.get("test_acc_by_backend", {}), figures["top1_agreement_with_fp32"]
            speed = {(r["backend"], r["batch_size"]): r for r in table}
            for backend in backends.BACKENDS:
                one, many = speed[(backend, 1)], speed[(backend, 256)]
                acc = f"{100 * accuracy[backend]:.2f}%" if backend in accuracy else "-"
                lines.append(f"| {m['release']} | {kind} | {backend}{' (auto)' if backend == picked else ''} | "
                             f"{one['images_per_s']:,.0f} | {one['ms_per_batch']:.2f} | {many['images_per_s']:,.0f} | "
                             f"{acc} | {100 * agreement[backend]:.2f}% | {where} |")
    return "\n".join(lines)


def predict_block() -> str:
    """What the README's `cifarkit predict` example prints, run here as written."""
    images = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "images").glob("*.png"))
    printed = subprocess.run([sys.executable, "-m", "cifarkit", "predict", *images, "--topk", "3"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    return "```\n" + printed + "```"


def _measured(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _not_measured(name: str, command: str) -> str:
    return f"Not measured yet: `{command}` writes `results/{name}`, and `lab/render_readme.py` renders it here."


def serve_options(bench: dict) -> str:
    """The `cifarkit serve` options a bench_serve run added to the defaults (its --serve-args), or ""."""
    command = shlex.split(bench["command"])
    return command[command.index("--serve-args") + 1] if "--serve-args" in command else ""


def serving_goals_block() -> str:
    """The serving goals at 64 connections on each CPU kind measured (results/serve-bench*.json), each beside what
    the model alone allows in the same run: a closed loop of C connections answered at R req/s waits C / R on
    average (Little's law), so the model's best img/s bounds the mean latency from below, and the most batching can
    give is the model's own gain from batch 1 to its best batch."""
    rows = []
    for path in sorted(RESULTS.glob("serve-bench*.json")):
        bench = json.loads(path.read_text())
        goals, alone = bench["summary"]["goals"]["concurrency_64"], bench["model_alone"]
        constants = bench["summary"]["goal_constants"]
        best = max(alone[f"batch_{b}_images_per_s"] for b in (1, 32, 64))
        command, options = shlex.split(bench["command"]), serve_options(bench)
        auto = "--backend" not in command or command[command.index("--backend") + 1] == "auto"
        backend = bench["servers"]["batched"]["served"]["backend"]
        rows.append({"path": path, "kind": cpu_kind_of(bench["environment"]),
                     "processor": processor_of(bench["environment"]), "defaults": auto and not options,
                     "backend": f"{backend}, `{options}`" if options else backend, "goals": goals,
                     "constants": constants, "best": best, "gain": best / alone["batch_1_images_per_s"]})
    if not rows:
        return _not_measured("serve-bench*.json", "python lab/bench_serve.py")
    best_by_machine = {}  # a kind's processors differ (Zen 2 and Zen 3 are both AVX2): compare on one only
    for row in rows:
        machine = row["kind"], row["processor"]
        best_by_machine[machine] = max(best_by_machine.get(machine, 0.0), row["goals"]["req_per_s"])
    c = rows[0]["constants"]
    lines = [f"| CPU kind | processor | backend | req/s at {c['concurrency']} connections | "
             f"p99 ms (goal <= {c['p99_ms']}) | "
             f"batched / unbatched (goal >= {c['ratio']}x) | the model alone: best batch / batch 1 | the model alone: "
             f"least mean latency at {c['concurrency']} connections | defaults / best here (goal >= 0.9x) | "
             f"file |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        g = row["goals"]
        best_here = best_by_machine[row["kind"], row["processor"]]
        versus = f"{g['req_per_s'] / best_here:.2f}x" if row["defaults"] else "-"
        defaults = " (defaults)" if row["defaults"] else ""
        lines.append(f"| {row['kind']} | {row['processor']} | {row['backend']}{defaults} | "
                     f"{g['req_per_s']:,.0f} | {g['p99_ms']:.0f} {'met' if g['p99_met'] else 'not met'} | "
                     f"{g['ratio']:.2f}x {'met' if g['ratio_met'] else 'not met'} | {row['gain']:.2f}x | "
                     f"{1000 * c['concurrency'] / row['best']:.0f} ms | {versus} | `results/{row['path'].name}` |")
    return "\n".join(lines)


def serve_block() -> str:
    """results/serve-bench.json, written by lab/bench_serve.py: batched against unbatched per concurrency."""
    bench = _measured("serve-bench.json")
    if bench is None:
        return _not_measured("serve-bench.json", "python lab/bench_serve.py")
    env, servers, summary = bench["environment"], bench["servers"], bench["summary"]
    batching = servers["batched"]["batching"]
    unbatched = {level["concurrency"]: level for level in servers["unbatched"]["levels"]}
    ratios = {row["concurrency"]: row["ratio"] for row in summary["levels"]}

    def ms(level):
        return " / ".join("n/a" if level[k] is None else f"{level[k]:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms"))

    lines = [f"Release {bench['model']} on {processor_of(env)} ({env['cpu_count']} cores, torch {env['torch']}, "
             f"uvicorn {env['versions']['uvicorn']}); {bench['requests_per_level']:,} requests per level, each a "
             f"{bench['image']['sent']} of {bench['image']['bytes']:,} bytes, from the script's own client on the same "
             f"cores ({bench['client']['tool']}, one connection per concurrent client). Batched: up to "
             f"{batching['max_batch']} images "
             f"per forward pass, waiting at most {batching['max_wait_ms']:g} ms for them; unbatched: one.", "",
             "| concurrency | batched req/s | unbatched req/s | ratio | p50 / p95 / p99 ms, batched | "
             "p50 / p95 / p99 ms, unbatched | errors, batched / unbatched | mean batch |",
             "|---:|---:|---:|---:|---|---|---:|---:|"]
    for level in servers["batched"]["levels"]:
        c, u = level["concurrency"], unbatched.get(level["concurrency"])
        ratio = "n/a" if ratios.get(c) is None else f"{ratios[c]:.2f}x"
        other = (f"{u['req_per_s']:,.0f}", ms(u), f" / {u['errors']:,}") if u else ("n/a", "n/a", "")
        lines.append(f"| {c} | {level['req_per_s']:,.0f} | {other[0]} | {ratio} | {ms(level)} | {other[1]} | "
                     f"{level['errors']:,}{other[2]} | {level['batches']['mean_size']:.2f} |")
    lines.append("")
    if "overload" in servers:
        goal, after = summary["goals"]["overload"], servers["overload"]["after"]
        lines.append(f"- Overload (queue of {goal['max_queue']} images, concurrency {goal['concurrency']}): "
                     f"{100 * goal['share_503']:.1f}% of {goal['requests']:,} requests answered 503, those with a "
                     f"p99 of {goal['p99_503_ms']:.1f} ms (the 200s: {goal['p99_200_ms']:.1f} ms); "
                     f"{goal['other_errors']} other errors; afterwards /healthz {after['healthz']}, /readyz "
                     f"{after['readyz']}, a prediction {after['predict']}.")
    if "soak" in servers["batched"]:
        soak = servers["batched"]["soak"]
        rss = soak["rss_mib"]
        lines.append(f"- Soak (batched, concurrency {soak['concurrency']}, {soak['seconds']:.0f} s): "
                     f"{soak['requests']:,} requests ({soak['req_per_s']:,.0f} req/s), {soak['errors']:,} errors, "
                     f"the worst p99 of its {soak['chunk_s']:g} s runs "
                     f"{soak['worst_chunk_p99_ms']:.1f} ms; RSS {rss['start']:.0f} -> {rss['end']:.0f} MiB "
                     f"({rss['growth_pct']:+.1f}%, at most {rss['max']:.0f} MiB).")
    starts = "; ".join(f"{name} {server['start_s']:.1f} s and {server['ready_memory']['rss_mib']:.0f} MiB (peak "
                       f"{server['final_memory']['peak_rss_mib']:.0f} MiB)" for name, server in servers.items())
    lines.append(f"- Start, from launch to the ready line, and RSS then: {starts}.")
    if alone := bench.get("model_alone"):
        speeds = ", ".join(f"{alone[f'batch_{n}_images_per_s']:,.0f} img/s at batch {n}" for n in (1, 32, 64))
        lines.append(f"- The model alone, timed in the same run ({alone['backend']}, traced, {alone['threads']} "
                     f"thread(s)), for the machine's speed at the time: {speeds}.")
    def missed(goal: dict) -> str:
        figures = []
        for key, met in goal.items():
            name = key.removesuffix("_met")
            if key.endswith("_met") and not met:
                value = goal.get(name, goal.get(f"{name}_ms"))
                figures.append(f"{name.replace('_per_', '/').replace('_', ' ')} {value:,}" if value is not None
                               else name.replace("_", " "))
        return ", ".join(figures)

    verdicts = [f"{name.replace('_', ' ')} " + ("met" if goal["met"] else f"missed ({missed(goal)})")
                for name, goal in summary["goals"].items()]
    lines.append(f"- The issue's goals in this run: {'; '.join(verdicts)}.")
    lines.append(f"- Written by `{bench['command']}`.")
    return "\n".join(lines)


def scaling_block() -> str:
    bench = json.loads((RESULTS / "bench-scaling-cpu.json").read_text())
    env, result = bench["environment"], bench["scaling"]
    lines = [f"{processor_of(env)}, {env['threads']} cores, torch {env['torch']}; `{result['model']}` in "
             f"{result['mode']}, global batch {result['batch_size']}, median of {result['rounds']} interleaved rounds "
             f"of {result['steps']} steps, each count launched by torchrun (`{bench['command']}`).", "",
             "| processes | training img/s | speed-up | efficiency |", "|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['processes']} | {row['images_per_s']:,.0f} | {row['speedup']:.2f}x | "
                     f"{100 * row['efficiency']:.0f}% |")
    seconds = result["eval_images"] / result["eval_images_per_s"]
    lines += ["", f"Rank 0 evaluates alone: {result['eval_images_per_s']:,.0f} img/s, {seconds:.1f} s per pass over "
                  f"{result['eval_images']:,} test images, during which the other ranks wait."]
    return "\n".join(lines)


def devices_block() -> str:
    """results/bench-devices.json, written by `cifarkit bench --devices cpu cuda`: the CPU rows measured on this
    project's machine, the CUDA rows on a GPU when one was lent (lab/device_check.sh)."""
    result = json.loads((RESULTS / "bench-devices.json").read_text())
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    lines = [f"{processor_of(env)} ({env['threads']} threads), {gpus}; torch {env['torch']} (`{result['command']}`).",
             "", device_table(result)]
    if result["skipped"]:
        lines += ["", "Not measured: " + "; ".join(f"{what} ({why})" for what, why in result["skipped"].items()) + "."]
    lines += ["", "![training speed-up over the CPU in fp32, per model, device and mode](results/bench-devices.png)"]
    return "\n".join(lines)


def reference_block() -> str:
    """results/compare-reference*.json, written by lab/compare_reference.py: the published airbench speedruns next
    to `fast`, timed on one machine in alternating rounds; a file per machine measured."""
    blocks = []
    for path in sorted(RESULTS.glob("compare-reference*.json")):
        result = json.loads(path.read_text())
        blocks.append(_reference_comparison(result) if "references" in result else _airbench94_only(result))
    return "\n\n".join(blocks)


def _reference_comparison(result: dict) -> str:
    env, ours = result["environment"], result["cifarkit"]
    lines = [f"{hardware(env)}, {env['threads']} cores, torch {env['torch']}; "
             f"precision {result['precision_policy']}, "
             f"Newton-Schulz in {result['newton_schulz_dtype']}, {result['preloaded_by_all'] or 'no allocator'} "
             f"preloaded by every side (`{result['command']}`).", ""]
    if result["subset"]:
        lines += [f"Trained on {result['subset']:,} images only: a check that every side runs, not a comparison.", ""]
    lines += ["| side | runs | test accuracy, its own TTA | 6 views of every image | whole process | training "
              "| `fast`'s speed-up, whole process (95% CI) | training (95% CI) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|",
              f"| `cifarkit train --recipe {_variant(result)}` | {ours['accuracy']['n']} | "
              f"{100 * ours['accuracy']['mean']:.2f}% | {100 * ours['accuracy_6_views']['mean']:.2f}% | "
              f"{ours['wall_time_s'] / 60:.1f} min | {ours['train_time_s'] / 60:.1f} min | | |"]
    for name, side in result["references"].items():
        ratios = [f"{r['mean']:.2f}x" + (f" ({r['ci95'][0]:.2f}-{r['ci95'][1]:.2f})" if r["ci95"] else "")
                  for r in (side["speedup"]["whole_process"], side["speedup"]["training"])]
        lines.append(f"| {name} (`{side['source'].split(',')[0]}`) | {side['accuracy']['n']} | | "
                     f"{100 * side['accuracy']['mean']:.2f}% | {side['wall_time_s'] / 60:.1f} min | "
                     f"{side['train_time_s'] / 60:.1f} min | {ratios[0]} | {ratios[1]} |")
    lines += ["", *(_accuracy_difference(_variant(result), ours["runs"], name, side["runs"])
                    for name, side in result["references"].items())]
    observed = "; ".join(f"{name}: " + ", ".join(sorted({_observed(run) for run in side["runs"]}))
                         for name, side in [("cifarkit", ours), *result["references"].items()])
    lines += ["", f"Read from each timed process: {observed}."]
    if "settings" in result:  # the script's rounds form, which a later command may extend
        finished = ", ".join(r["finished"].replace("T", " ").removesuffix("+00:00")
                             + (f" (run from {r['commit']})" if "commit" in r else "") for r in result["rounds"])
        lines.append(f"cifarkit's src/ at commit {result['settings']['code']['commit']}; the rounds finished at "
                     f"{finished} UTC.")
        if len(result["rounds"]) < _rounds_asked(result):
            lines.append(f"Unfinished: {_rounds_done(result)} so far. The same command, on this CPU kind with the "
                         f"same src/, allocator and threads, runs the rest and keeps these.")
    return "\n".join(lines)


def _accuracy_difference(recipe: str, ours: list[dict], name: str, theirs: list[dict]) -> str:
    """`recipe`'s mean accuracy minus a reference's, as shipped and with the reference's 6 views, with the intervals
    that say whether a handful of runs can tell the difference from zero."""
    cells = []
    for label, key in (("its own TTA", "test_acc"), ("6 views", "test_acc_6_views")):
        difference = difference_of_means([r[key] for r in ours], [r["test_acc"] for r in theirs])
        cells.append(f"{label} {describe_difference(difference)}")
    return f"Mean test accuracy, `{recipe}` minus {name}: {'; '.join(cells)}."


def _rounds_asked(result: dict) -> int:
    """The rounds the comparison's command asks for; a file may hold fewer while the comparison is unfinished."""
    return int(re.search(r"--runs (\d+)", result["command"]).group(1))


def _rounds_done(result: dict) -> str:
    done = len(result.get("rounds", result["cifarkit"]["runs"]))
    asked = _rounds_asked(result)
    return str(done) if done >= asked else f"{done} of the command's {asked} rounds"


def _variant(result: dict) -> str:
    """cifarkit's side of a comparison as its command line named it: the recipe, then any --set."""
    return " ".join([result["recipe"], *(f"--set {o}" for o in result.get("overrides") or [])])


def _side_of(result: dict) -> str:
    """The README's name for cifarkit's side: the recipe, and the fields a --set changed in it."""
    changed = ", ".join(f"`{o}`" for o in result.get("overrides") or [])
    return f"`{result['recipe']}`" + (f" with {changed}" if changed else "")


def _code_of(result: dict) -> str:
    """The cifarkit commit a comparison timed, where the file records it: two files on one kind are two versions."""
    return f", src/ at {result['settings']['code']['commit']}" if "settings" in result else ""


def _observed(run: dict) -> str:
    """What one timed process ran: its precision (cifarkit's, or the dtype of a reference's logits), Newton-Schulz
    dtype where it has one, allocator and threads."""
    precision = run.get("precision") or run["logits_dtype"]
    newton_schulz = f", Newton-Schulz {run['newton_schulz_dtype']}" if run.get("newton_schulz_dtype") else ""
    return f"{precision}{newton_schulz}, {run['allocator']}, {run['threads']} threads"


def _airbench94_only(result: dict) -> str:
    """The first form of the comparison: airbench94 alone, with bf16 autocast forced on it, one timer."""
    env = result["environment"]
    lines = [f"{hardware(env)}, {env['threads']} cores, torch {env['torch']} "
             f"(`{result['command']}`, an earlier version of the script; timer: {result['timer_covers']}).", "",
             "| | runs | test accuracy (TTA), each | mean | whole process, each | mean |",
             "|---|---:|---|---:|---|---:|"]
    for name, label in (("reference", f"`{result['reference_package']}` `lib_airbench94` (CPU, bf16 autocast)"),
                        ("cifarkit", "`cifarkit train --recipe fast` (2.25 TTA views per image)")):
        side = result[name]
        accuracies = ", ".join(f"{100 * r['test_acc']:.2f}%" for r in side["runs"])
        walls = ", ".join(f"{r['wall_time_s'] / 60:.1f}" for r in side["runs"])
        lines.append(f"| {label} | {side['accuracy']['n']} | {accuracies} | {100 * side['accuracy']['mean']:.2f}% | "
                     f"{walls} min | {side['wall_time_s'] / 60:.1f} min |")
    lines += ["", f"`fast` took {1 / result['speedup']:.2f}x the reference's time: {result['speedup']:.2f}x as fast."]
    return "\n".join(lines)


def containers_block() -> str:
    """results/container-check.json, written by lab/container_check.py: both images built offline and run."""
    result = _measured("container-check.json")
    if result is None:
        return _not_measured("container-check.json",
                             "python lab/container_check.py --json results/container-check.json")
    base, wheels, cpu = result["base"], result["wheelhouse"], result["cpu"]
    serving = cpu["serving"]
    releases = ", ".join(sorted({p["model"] for p in serving["predictions"].values()}))
    answers = f"release {releases} answered " + ", ".join(f"{name} {p['label']} {p['confidence']:.0%}"
                                                        for name, p in serving["predictions"].items())
    lines = [f"{result['engine']}, base `{base['image']}` (Python {base['python']}: {base['made_by']}), "
             f"{wheels['wheels']} wheels ({wheels['mib']:,} MiB) in the wheelhouse (`{result['command']}`).", "",
             "| image | built offline | size | user | command | in the container |", "|---|---:|---:|---|---|---|",
             f"| `{cpu['dockerfile']}` on `{cpu['base']}` | {cpu['build_seconds']:.0f} s | {cpu['image_mib']:,} MiB | "
             f"{cpu['user']} (uid {serving['uid']}) | `{' '.join(cpu['cmd'])}` | healthy "
             f"{serving['healthy_seconds']:.1f} s after the start; {answers} |"]
    if "cuda" in result:
        cuda, training = result["cuda"], result["cuda"]["training"]
        verdict = "passes" if training["healthcheck_passes"] else "fails, as it should without a GPU"
        lines.append(f"| `{cuda['dockerfile']}` on the stand-in `{cuda['base']}` | {cuda['build_seconds']:.0f} s | "
                     f"{cuda['image_mib']:,} MiB | {cuda['user']} | `{' '.join(cuda['cmd'])}` | "
                     f"`{training['command']}`: {training['seconds']:.0f} s on the {training['device']} "
                     f"({training['precision']}), test accuracy {training['test_acc']:.1%}; "
                     f"the healthcheck {verdict} |")
    lines += ["", "The wheelhouse here holds PyPI's torch, the CUDA build, so the CPU image measured here carries "
                  "CUDA's libraries; built online from PyTorch's CPU-only index it would not (that index is not "
                  "reachable here)."]
    return "\n".join(lines)


PLAN_NAMES = {"onednn": "every layer on oneDNN", "f2_only": "F(2x2, 3x3) alone, as before F(4x4, 3x3)",
              "without_winograd": "the kernel plan without Winograd",
              "pooled_up_to_8": "the pooled 15x15 layer on oneDNN, pooled layers up to 8x8 on Winograd"}


def winograd_block() -> str:
    """Each 3x3 layer's forward + backward time in fp32 or bf16, oneDNN against Winograd's F(2x2, 3x3) and F(4x4,
    3x3), per CPU kind measured (lab/measure_winograd.py), and the path training takes there (in bf16, also timed
    as it takes it)."""
    parts = []
    for path in sorted(RESULTS.glob("winograd-layers-*.json")):
        result = json.loads(path.read_text())
        precision = result.get("precision", "fp32")
        variants = [name.removeprefix("winograd").split("_") for name in result["layers"][0]["median_s"]
                    if name.startswith("winograd")]
        variants = sorted((int(tile), int(rows)) for tile, rows in variants)
        chosen_rows = {int(tile): rows for tile, rows in result["tile_rows_chosen"].items()}
        parts.append(f"{result['cpu_kind']}, {processor_of(result['environment'])}, `{result['model']}`, batch "
                     f"{result['batch_size']:,}, {result['threads']} threads, medians of {result['rounds']} "
                     f"interleaved rounds (`{result['command']}`, `results/{path.name}`):\n")
        timed_as_trained = "as_trained" in result["layers"][0]["median_s"]  # bf16: each layer on its kernel plan
        parts.append(f"| layer | input gradient | {precision} training takes | oneDNN, ms | "
                     + ("as training takes it, ms | " if timed_as_trained else "")
                     + " | ".join(f"F({tile}x{tile}), {rows:,} tiles a slice, ms" for tile, rows in variants)
                     + " | oneDNN / training's choice |")
        parts.append("|---|---|---|---:|" + "---:|" * (len(variants) + timed_as_trained) + "---:|")
        for layer in result["layers"]:
            medians, tile, kept = layer["median_s"], layer["winograd_tile"], layer["kept_outputs"]
            shape = f"{layer['c_in']} -> {layer['c_out']} at {layer['width']}x{layer['width']}"
            if layer["pooled"]:
                shape += f", pooled ({kept}x{kept} kept)"
            training_path = layer[f"{precision}_training_path"]
            winograd = training_path.startswith("winograd")
            computed = tile * winograd_blocks(kept, tile)
            if winograd and computed != kept:  # the outputs Winograd computes and crops, where training takes it
                shape += f" ({computed}x{computed} by F({tile}x{tile}))"
            takes = f"F({tile}x{tile}, 3x3)" if winograd else "oneDNN" if training_path == "plain" else training_path
            chosen = medians["as_trained"] if timed_as_trained else (
                medians[f"winograd{tile}_{chosen_rows[tile]}"] if winograd else medians["onednn"])
            parts.append(f"| {shape} | {'yes' if layer['input_gradient'] else 'no'} | {takes} | "
                         f"{1e3 * medians['onednn']:,.0f} | "
                         + (f"{1e3 * chosen:,.0f} | " if timed_as_trained else "")
                         + " | ".join(f"{1e3 * medians[f'winograd{tile}_{rows}']:,.0f}" for tile, rows in variants)
                         + f" | {medians['onednn'] / chosen:.2f}x |")
        if "whole_model" in result:
            whole = result["whole_model"]
            rounds = len(next(iter(whole["samples_s"].values())))
            trained = whole["median_s"]["as_trained"]
            parts.append(f"\nThe whole `{result['model']}`, forward and backward, the choices taking turns (medians of "
                         f"{rounds} rounds): " + ", ".join(
                             f"{PLAN_NAMES[plan]} {1e3 * s:,.0f} ms ({s / trained:.2f}x training's choice)"
                             for plan, s in whole["median_s"].items() if plan != "as_trained")
                         + f", as {precision} training takes them {1e3 * trained:,.0f} ms.")
        parts.append("")
    return "\n".join(parts).rstrip() or "No measurement yet: `python lab/measure_winograd.py`."


def validation_block() -> str:
    """Every recipe sweep on a validation split (lab/validation_runs.py), oldest first, with the table the
    script printed."""
    sweeps = sorted(((json.loads(path.read_text()), path) for path in RESULTS.glob("validation-*.json")),
                    key=lambda sweep: sweep[0]["measured"])
    parts = []
    for result, path in sweeps:
        first_run = next(iter(result["variants"][0]["runs"].values()))
        # A recipe's values change over time: the commit the table was written at names the ones its runs had.
        parts.append(f"`{result['recipe']}` as at {result['written_at_commit']}, on {result['val_split']:,} held-out "
                     f"training images, {hardware(result['environment'])}, {first_run['precision']} "
                     f"(`{result['command']}`, `results/{path.name}`):\n\n"
                     + "\n".join(result["table"]))
    return "\n\n".join(parts) or "No sweep yet: `python lab/validation_runs.py`."


BLOCKS = {"models": models_block, "training": training_block, "speedrun": speedrun_block, "bench": bench_block,
          "releases": releases_block, "inference": inference_block, "cpu-kinds": cpu_kind_block, "gpu": gpu_block,
          "predict": predict_block, "serve": serve_block,
          "scaling": scaling_block, "reference": reference_block, "devices": devices_block,
          "containers": containers_block, "contracts": contracts_block, "layers": layers_block,
          "serving-goals": serving_goals_block, "winograd": winograd_block,
          "modules": modules_block, "validation": validation_block}


def pages() -> list[Path]:
    """The pages that may hold generated blocks: the README, then the docs."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> None:
    texts = {page: page.read_text() for page in pages()}
    for name, render in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        holders = [page for page, text in texts.items() if pattern.search(text)]
        if len(holders) != 1:
            found = ", ".join(page.relative_to(ROOT).as_posix() for page in holders) or "none of them"
            raise SystemExit(f"the block <!-- {name}:begin --> ... <!-- {name}:end --> must be in exactly one of "
                             f"README.md and docs/*.md; found in {found}")
        page = holders[0]
        block = render()
        if page.parent.name == "docs":  # the blocks link results/ from the project's root
            block = block.replace("](results/", "](../results/")
        texts[page] = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), texts[page])
    for page, text in texts.items():
        write_text(page, text)
    print(f"rewrote {', '.join(BLOCKS)} in README.md and docs/")


if __name__ == "__main__":
    main()
