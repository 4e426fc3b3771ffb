"""Rewrite the README's generated blocks from the registry and from the measurement files in results/.

    python scripts/render_readme.py

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; nothing else in the README is touched.
The numbers come only from files that `cifarkit` commands wrote, so the README cannot drift from the evidence.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from cifarkit import models, release
from cifarkit.files import write_text
from cifarkit.inference import SHIPPED

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def models_block() -> str:
    lines = ["| model | params | MACs / image |", "|---|---:|---:|"]
    for name in models.names():
        model = models.create(name)
        lines.append(f"| `{name}` | {models.count_params(model):,} | {models.count_macs(model):,} |")
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
    lines = [f"{env['processor']}, {env['threads']} threads, torch {env['torch']}; batch {bench['batch_size']}, "
             f"median of {bench['rounds']} interleaved rounds of {bench['steps']} steps (`{command}`).", "",
             f"| model | mode | training img/s | vs {baseline} |", "|---|---|---:|---:|"]
    for r in bench["results"]:
        lines.append(f"| `{r['model']}` | {r['mode']} | {r['images_per_s']:,.0f} | "
                     f"{r[f'speedup_vs_{baseline}']:.2f}x |")
    return "\n".join(lines)


def speedrun_block() -> str:
    lines = ["| recipe | n | mean test accuracy | std | 95% CI | p (mean > target) | wall time mean / max | file |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
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
                     f"{wall['mean'] / 60:.1f} / {wall['max'] / 60:.1f} min | `results/{path.name}` |")
    return "\n".join(lines)


def releases_block() -> str:
    return release.compare(SHIPPED, RESULTS / "releases.png")


def inference_block() -> str:
    lines = ["| release | model | backend | img/s, batch 1 | ms, batch 1 | img/s, batch 256 | top-1 = fp32 on test set |",
             "|---|---|---|---:|---:|---:|---:|"]
    for path in sorted(SHIPPED.glob("version_*/metrics.json")):
        m = json.loads(path.read_text())
        inference = m["inference"]
        speed = {(r["backend"], r["batch_size"]): r for r in inference["throughput"]}
        for backend, agreement in inference["top1_agreement_with_fp32"].items():
            one, many = speed[(backend, 1)], speed[(backend, 256)]
            default = " (default)" if backend == inference["default_backend"] else ""
            lines.append(f"| {m['release']} | `{m['model']}` | {backend}{default} | {one['images_per_s']:,.0f} | "
                         f"{one['ms_per_batch']:.2f} | {many['images_per_s']:,.0f} | {100 * agreement:.2f}% |")
    return "\n".join(lines)


def predict_block() -> str:
    """What the README's `cifarkit predict` example prints, run here as written."""
    images = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "images").glob("*.png"))
    printed = subprocess.run([sys.executable, "-m", "cifarkit", "predict", *images, "--topk", "3"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    return "```\n" + printed + "```"


BLOCKS = {"models": models_block, "training": training_block, "speedrun": speedrun_block, "bench": bench_block,
          "releases": releases_block, "inference": inference_block, "predict": predict_block}


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name, render in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        text = pattern.sub(lambda m: m.group(1) + render() + "\n" + m.group(2), text)
    write_text(readme, text)
    print(f"rewrote {', '.join(BLOCKS)} in {readme}")


if __name__ == "__main__":
    main()
