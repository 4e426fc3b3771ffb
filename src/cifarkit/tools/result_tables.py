"""The tables of each kind of results file, current and superseded alike, each row marked with its status: speed
runs, step profiles, comparisons with a reference, serving benchmarks, throughput, kernel timings and validation
sweeps. The project's pages are rendered from them (lab/render_readme.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from cifarkit.models.winograd import blocks as winograd_blocks
from cifarkit.tools.benchmark import SPEED_ONLY, comparison_tables, device_table, gpu_comparisons
from cifarkit.tools.equal_accuracy import ratio_text
from cifarkit.tools.reference import equal_accuracy_lines
from cifarkit.tools.results import (
    cpu_kind_of,
    current_files,
    hardware,
    processor_of,
    rel,
    result_files,
    rounds_asked,
    serve_options,
    serves_defaults,
    status,
)
from cifarkit.tools.speedrun import describe_difference, difference_of_means

# The A/B files record the batch since 2026-12-06; every A/B file written before timed `fast` at batch 2,000,
# its batch until 5276c1b (`git show COMMIT:src/cifarkit/training/recipes/fast.yaml` at each file's "after").
AB_BATCH_BEFORE_RECORDED = 2000


SPEED_ONLY_SENTENCE = f"{SPEED_ONLY[0].upper()}{SPEED_ONLY[1:]}."


def full_runs(folder: Path) -> list[tuple[str, dict]]:
    """(folder name, summary) of each kept `cifarkit train` run in results/."""
    return [(path.parent.name, json.loads(path.read_text())) for path in sorted(folder.glob("*/summary.json"))]


def training_table(folder: Path) -> str:
    lines = ["| run | recipe | epochs | test accuracy | wall time | train time | device | precision | torch |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for run, s in full_runs(folder):
        lines.append(f"| `{folder.name}/{run}` | `{s['recipe']}` | {s['epochs']} | "
                     f"{100 * s['test_acc']:.2f}% | {s['wall_time_s'] / 60:.1f} min | {s['train_time_s'] / 60:.1f} min "
                     f"| {s['device']} | {s['precision']} | {s['torch']} |")
    return "\n".join(lines)


def bench_table(folder: Path) -> str:
    bench = json.loads((folder / "bench-train-cpu.json").read_text())
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
    return "\n".join(lines + ["", SPEED_ONLY_SENTENCE])


def speedrun_table(folder: Path) -> str:
    """Every speed run, current and superseded, with the command that made it."""
    lines = ["| recipe | n | mean test accuracy | std | 95% CI | p (mean > target) | wall time mean / max | device | "
             "precision | machine speed before each run | status | command |",
             "|---|---:|---:|---:|---|---:|---:|---|---|---:|---|---|"]
    for path in result_files(folder, "*speedrun-*.json"):
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
                     f"{_precision(report)} | {machine_speeds(report['runs'])} | {status(folder, path)} | "
                     f"{_speedrun_command(report)} (`{rel(folder, path)}`) |")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def step_table(folder: Path) -> str:
    """Where a step's time goes per CPU kind (`cifarkit profile`), and the A/B step times of code changes, each
    marked current or superseded. They time steps only: a step's accuracy is the speed runs' to measure."""
    lines = ["| CPU kind | processor | what | measured | status | command |", "|---|---|---|---|---|---|"]
    for path in result_files(folder, "profile-ab-fast-*.json"):
        ab = json.loads(path.read_text())
        after = ab["runs"]["after"]
        step = statistics.fmean(r["step_s"] for r in after)
        batch = after[0].get("batch_size", AB_BATCH_BEFORE_RECORDED)
        half = ab.get("speedup_ci95_half_width")
        spread = f", 95% CI +- {half:.2f}" if half is not None else ""
        lines.append(f"| {ab['cpu_kind']} | {processor_of(ab['environment'])} | `fast` training step, "
                     f"{after[0]['precision']}, batch {batch:,}, {after[0]['allocator']} | {step:.1f} s per step "
                     f"({batch / step:,.0f} img/s) at {ab['after']}, {ab['speedup_mean']:.2f}x the step at "
                     f"{ab['before']} (n = {len(after)} pairs{spread}); accuracy not measured (step time only) | "
                     f"{status(folder, path)} | `{ab['command']}` (`{rel(folder, path)}`) |")
    for path in result_files(folder, "*profile-*.json"):  # `cifarkit profile --json`: the convolutions' share of peak
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
                     f"{status(folder, path)} | `{profiled['command']}` (`{rel(folder, path)}`) |")
    return "\n".join(lines)


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


def machine_speeds(runs: list[dict]) -> str:
    """The probe's img/s before each run, or why there is none: speed runs from before the probe have none."""
    probed = [r["machine_speed"]["before"]["images_per_s"] for r in runs if r.get("machine_speed")]
    if not probed:
        return "not probed"
    return ", ".join(f"{rate:,.0f}" for rate in probed) + " img/s" + ("" if len(probed) == len(runs) else
                                                                    f" ({len(runs) - len(probed)} not probed)")


def not_measured(name: str, command: str) -> str:
    return f"Not measured yet: `{command}` writes `results/{name}`."


def serving_goals_table(folder: Path) -> str:
    """The serving goals at 64 connections on each CPU kind measured (results/serve-bench*.json), each beside what
    the model alone allows in the same run: a closed loop of C connections answered at R req/s waits C / R on
    average (Little's law), so the model's best img/s bounds the mean latency from below, and the most batching can
    give is the model's own gain from batch 1 to its best batch."""
    rows = []
    for path in result_files(folder, "serve-bench*.json"):
        bench = json.loads(path.read_text())
        goals, alone = bench["summary"]["goals"]["concurrency_64"], bench["model_alone"]
        constants = bench["summary"]["goal_constants"]
        best = max(alone[f"batch_{b}_images_per_s"] for b in (1, 32, 64))
        options = serve_options(bench)
        backend = bench["servers"]["batched"]["served"]["backend"]
        rows.append({"path": path, "kind": cpu_kind_of(bench["environment"]),
                     "processor": processor_of(bench["environment"]), "defaults": serves_defaults(bench),
                     "backend": f"{backend}, `{options}`" if options else backend, "goals": goals,
                     "constants": constants, "best": best, "gain": best / alone["batch_1_images_per_s"]})
    if not rows:
        return not_measured("serve-bench*.json", "cifarkit bench-serve")
    best_by_machine = {}  # a kind's processors differ (Zen 2 and Zen 3 are both AVX2): compare on one only
    for row in rows:
        machine = row["kind"], row["processor"]
        best_by_machine[machine] = max(best_by_machine.get(machine, 0.0), row["goals"]["req_per_s"])
    c = rows[0]["constants"]
    lines = [f"| CPU kind | processor | backend | req/s at {c['concurrency']} connections | "
             f"p99 ms (goal <= {c['p99_ms']}) | "
             f"batched / unbatched (goal >= {c['ratio']}x) | the model alone: best batch / batch 1 | the model alone: "
             f"least mean latency at {c['concurrency']} connections | defaults / best here (goal >= 0.9x) | "
             f"status | file |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        g = row["goals"]
        best_here = best_by_machine[row["kind"], row["processor"]]
        versus = f"{g['req_per_s'] / best_here:.2f}x" if row["defaults"] else "-"
        defaults = " (defaults)" if row["defaults"] else ""
        lines.append(f"| {row['kind']} | {row['processor']} | {row['backend']}{defaults} | "
                     f"{g['req_per_s']:,.0f} | {g['p99_ms']:.0f} {'met' if g['p99_met'] else 'not met'} | "
                     f"{g['ratio']:.2f}x {'met' if g['ratio_met'] else 'not met'} | {row['gain']:.2f}x | "
                     f"{1000 * c['concurrency'] / row['best']:.0f} ms | {versus} | {status(folder, row['path'])} | "
                     f"`{rel(folder, row['path'])}` |")
    return "\n".join(lines + ["", "Both servers of a file serve one release through one backend: the ratios are of "
                                  "speed. The accuracy each backend serves is the release's, measured per CPU kind "
                                  "([releases](releases.md)), and `auto` takes bf16 only where it keeps it."])


def serve_table(folder: Path) -> str:
    """The newest current benchmark of `cifarkit serve` (`cifarkit bench-serve`), one of its defaults where there is
    one: batched against unbatched per concurrency."""
    benches = current_files(folder, "serve-bench*.json")
    if not benches:
        return not_measured("serve-bench.json", "cifarkit bench-serve")
    path, bench = max(benches, key=lambda item: (serves_defaults(item[1]), item[1]["measured"]))
    env, servers, summary = bench["environment"], bench["servers"], bench["summary"]
    batching = servers["batched"]["batching"]
    unbatched = {level["concurrency"]: level for level in servers["unbatched"]["levels"]}
    ratios = {row["concurrency"]: row["ratio"] for row in summary["levels"]}

    def ms(level):
        return " / ".join("n/a" if level[k] is None else f"{level[k]:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms"))

    lines = [f"Release {bench['model']} on {processor_of(env)} ({env['cpu_count']} cores, torch {env['torch']}, "
             f"uvicorn {env['versions']['uvicorn']}); {bench['requests_per_level']:,} requests per level, each a "
             f"{bench['image']['sent']} of {bench['image']['bytes']:,} bytes, from the benchmark's own client on the "
             f"same cores ({bench['client']['tool']}, one connection per concurrent client). Batched: up to "
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
    lines.append(f"- Written by `{bench['command']}` (`{rel(folder, path)}`).")
    return "\n".join(lines)


def scaling_table(folder: Path) -> str:
    bench = json.loads((folder / "bench-scaling-cpu.json").read_text())
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
                  f"{result['eval_images']:,} test images, during which the other ranks wait. " + SPEED_ONLY_SENTENCE]
    return "\n".join(lines)


def devices_table(folder: Path) -> str:
    """results/bench-devices.json, written by `cifarkit bench --devices cpu cuda`: the CPU rows measured on this
    project's machine, the CUDA rows on a GPU when one was lent (lab/device_check.sh); where a GPU was measured, its
    rows again as three tables: against the CPU, fp32 against mixed precision, cuDNN's autotuning on against off."""
    result = json.loads((folder / "bench-devices.json").read_text())
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    lines = [f"{processor_of(env)} ({env['threads']} threads), {gpus}; torch {env['torch']} (`{result['command']}`).",
             "", device_table(result)]
    comparisons = comparison_tables(gpu_comparisons(result["rows"]))
    lines += ["", comparisons] if comparisons else []
    lines += ["", SPEED_ONLY_SENTENCE]
    if result["skipped"]:
        lines += ["", "Not measured: " + "; ".join(f"{what} ({why})" for what, why in result["skipped"].items()) + "."]
    lines += ["", "![training speed-up over the CPU in fp32, per model, device and mode](results/bench-devices.png)"]
    return "\n".join(lines)


def reference_tables(folder: Path) -> str:
    """results/compare-reference*.json, written by `cifarkit reference`: the published airbench speedruns next
    to `fast`, timed on one machine in alternating rounds; a file per machine measured."""
    blocks = []
    for path in result_files(folder, "compare-reference*.json"):
        result = json.loads(path.read_text())
        table = comparison_table(result) if "references" in result else _airbench94_only(result)
        blocks.append(f"**`{rel(folder, path)}`**, {status(folder, path)}:\n\n{table}")
    return "\n\n".join(blocks)


def comparison_table(result: dict) -> str:
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
              *(f"| `cifarkit train --recipe {_variant(result)}`{label} | {side['accuracy']['n']} | "
                f"{100 * side['accuracy']['mean']:.2f}% | {100 * side['accuracy_6_views']['mean']:.2f}% | "
                f"{side['wall_time_s'] / 60:.1f} min | {side['train_time_s'] / 60:.1f} min | | |"
                for label, side in [("", ours), *((f" `--set train.epochs={b['epochs']:g}`", b)
                                                  for b in result.get("brackets", {}).values())])]
    for name, side in result["references"].items():
        ratios = [ratio_text(r["mean"], r["ci95"])
                  for r in (side["speedup"]["whole_process"], side["speedup"]["training"])]
        # A reference's own TTA is 6 views where it records no other figure (airbench94_muon, airbench94)
        six_views = side.get("accuracy_6_views", side["accuracy"])["mean"]
        lines.append(f"| {name} (`{side['source'].split(',')[0]}`) | {side['accuracy']['n']} | "
                     f"{100 * side['accuracy']['mean']:.2f}% | {100 * six_views:.2f}% | "
                     f"{side['wall_time_s'] / 60:.1f} min | {side['train_time_s'] / 60:.1f} min | {ratios[0]} | "
                     f"{ratios[1]} |")
    lines += ["", *(_accuracy_difference(_variant(result), ours["runs"], name, side["runs"])
                    for name, side in result["references"].items())]
    if "time_to_mark" in result:  # the comparison bracketed the references' accuracy with a second budget
        lines += ["", "At equal accuracy (6 views on every side; `fast`'s time read between its budgets):", "",
                  *(f"- {line}" for line in equal_accuracy_lines(result))]
    observed = "; ".join(f"{name}: " + ", ".join(sorted({_observed(run) for run in side["runs"]}))
                         for name, side in [("cifarkit", ours), *result["references"].items()])
    lines += ["", f"Read from each timed process: {observed}."]
    if "settings" in result:  # the script's rounds form, which a later command may extend
        finished = ", ".join(r["finished"].replace("T", " ").removesuffix("+00:00")
                             + (f" (run from {r['commit']})" if "commit" in r else "") for r in result["rounds"])
        lines.append(f"cifarkit's src/ at commit {result['settings']['code']['commit']}; the rounds finished at "
                     f"{finished} UTC.")
        if len(result["rounds"]) < rounds_asked(result):
            lines.append(f"Unfinished: {_rounds_done(result)} so far. The same command, on this CPU kind with the "
                         f"same src/, allocator and threads, runs the rest and keeps these.")
    return "\n".join(lines)


def _accuracy_difference(recipe: str, ours: list[dict], name: str, theirs: list[dict]) -> str:
    """`recipe`'s mean accuracy minus a reference's, as shipped and with the reference's 6 views, with the intervals
    that say whether a handful of runs can tell the difference from zero."""
    cells = []
    for label, key in (("its own TTA", "test_acc"), ("6 views", "test_acc_6_views")):
        # A reference that records no 6-view figure has them as its own TTA (airbench94_muon's, before it did)
        difference = difference_of_means([r[key] for r in ours], [r.get(key, r["test_acc"]) for r in theirs])
        cells.append(f"{label} {describe_difference(difference)}")
    return f"Mean test accuracy, `{recipe}` minus {name}: {'; '.join(cells)}."


def _rounds_done(result: dict) -> str:
    done = len(result.get("rounds", result["cifarkit"]["runs"]))
    asked = rounds_asked(result)
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


PLAN_NAMES = {"onednn": "every layer on oneDNN", "f2_only": "F(2x2, 3x3) alone, as before F(4x4, 3x3)",
              "without_winograd": "the kernel plan without Winograd",
              "pooled_up_to_8": "the pooled 15x15 layer on oneDNN, pooled layers up to 8x8 on Winograd"}


def winograd_tables(folder: Path) -> str:
    """Each 3x3 layer's forward + backward time in fp32 or bf16, oneDNN against Winograd's F(2x2, 3x3) and F(4x4,
    3x3), per CPU kind measured (lab/measure_winograd.py), and the path training takes there (in bf16, also timed
    as it takes it)."""
    parts = []
    for path in result_files(folder, "winograd-layers-*.json"):
        result = json.loads(path.read_text())
        precision = result.get("precision", "fp32")
        variants = [name.removeprefix("winograd").split("_") for name in result["layers"][0]["median_s"]
                    if name.startswith("winograd")]
        variants = sorted((int(tile), int(rows)) for tile, rows in variants)
        chosen_rows = {int(tile): rows for tile, rows in result["tile_rows_chosen"].items()}
        parts.append(f"{result['cpu_kind']}, {processor_of(result['environment'])}, `{result['model']}`, batch "
                     f"{result['batch_size']:,}, {result['threads']} threads, medians of {result['rounds']} "
                     f"interleaved rounds (`{result['command']}`, `{rel(folder, path)}`, {status(folder, path)}):\n")
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
    if not parts:
        return "No measurement yet: `python lab/measure_winograd.py`."
    return "\n".join(parts) + SPEED_ONLY_SENTENCE


def validation_tables(folder: Path) -> str:
    """Every recipe sweep on a validation split by the former `cifarkit validate`, oldest first, with the table the
    script printed."""
    sweeps = sorted(((json.loads(path.read_text()), path) for path in folder.glob("validation-*.json")),
                    key=lambda sweep: sweep[0]["measured"])
    parts = []
    for result, path in sweeps:
        first_run = next(iter(result["variants"][0]["runs"].values()))
        # A recipe's values change over time: the commit the table was written at names the ones its runs had.
        parts.append(f"`{result['recipe']}` as at {result['written_at_commit']}, on {result['val_split']:,} held-out "
                     f"training images, {hardware(result['environment'])}, {first_run['precision']} "
                     f"(`{result['command']}`, `results/{path.name}`):\n\n"
                     + "\n".join(result["table"]))
    return "\n\n".join(parts) or "No sweep of the former `cifarkit validate`."
