"""Rewrite the generated blocks of README.md, docs/*.md and results/README.md from the registry and the measurement
files in results/; `--check` only compares, and fails where a page differs from a fresh render.

    python lab/render_readme.py
    python lab/render_readme.py --check

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`, in exactly one of those pages; nothing else
in them is touched. The numbers come only from files that `cifarkit` commands wrote, read by the package's
cifarkit.tools.results and result_tables (what `cifarkit results` prints), so the pages cannot drift from the
evidence; the blocks about the project itself (its layers, modules, releases, containers) are rendered here.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cifarkit import models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core.files import write_text
from cifarkit.inference import backends
from cifarkit.release.compare import compare
from cifarkit.tools import result_tables as tables
from cifarkit.tools.result_tables import not_measured
from cifarkit.tools.results import (
    ARCHIVE,
    PROVENANCE,
    expect_table,
    index_table,
    provenance,
    quickstart_text,
    recorded_commit,
    recorded_date,
    result_files,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
CHARTS = RESULTS  # where the blocks that draw a chart put it; `--check` draws in a scratch folder


def update_provenance() -> None:
    """Add, from git, the commit and day each results file was added in, for the files that record neither; kept
    entries stay as they are, so the record survives a shallow clone."""
    known = provenance(RESULTS)
    for path in result_files(RESULTS, "*.json") + result_files(RESULTS, "*.png"):
        data = json.loads(path.read_text()) if path.suffix == ".json" else {}
        if path.name in known or (recorded_commit(data) and recorded_date(data)):
            continue
        # By name in both folders, without --follow, whose guesses at renames can name another file's first commit.
        log = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %cs", "--", f"results/{path.name}",
                              f"results/{ARCHIVE}/{path.name}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        if log:
            known[path.name] = {"added_in": log[-2], "date": log[-1]}
    write_text(RESULTS / PROVENANCE, json.dumps(dict(sorted(known.items())), indent=2) + "\n")


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


def releases_block() -> str:
    return compare([str(SHIPPED)], CHARTS / "releases.png")


def inference_block() -> str:
    """Each shipped release's speeds per CPU kind measured, the accuracy rule's figures `auto` judges on that kind,
    and what it picks there (cifarkit.inference.backends)."""
    lines = ["| release | CPU kind | backend | img/s, batch 1 | ms, batch 1 | img/s, batch 256 | test acc | "
             "top-1 = fp32 | accuracy figures |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for path in sorted(SHIPPED.glob("version_*/metrics.json")):
        m = json.loads(path.read_text())
        inference = m["inference"]
        for kind, table in sorted(backends.speed_tables(inference).items()):
            if kind not in backends.CPU_KINDS:  # a GPU's auto turns on its own bf16, which no page can know
                continue
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


def containers_block() -> str:
    """results/container-check.json, written by lab/container_check.py: both images built offline and run."""
    path = RESULTS / "container-check.json"
    if not path.exists():
        return not_measured("container-check.json",
                             "python lab/container_check.py --json results/container-check.json")
    result = json.loads(path.read_text())
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
        trained = (f"`{training['command']}`: {training['seconds']:.0f} s on the {training['device']} "
                   f"({training['precision']}), test accuracy {training['test_acc']:.1%}")
        if "jupyter" in cuda:
            jupyter = cuda["jupyter"]
            trained = (f"without a GPU it stops: `{training['refused_without_gpu']}`; with `CIFARKIT_ALLOW_CPU=1`, as "
                       f"uid {training['user']} (`--user`, in no passwd), {trained}, its files the uid's "
                       f"({training['files_uid']}); `{jupyter['command']}` as that uid answered in "
                       f"{jupyter['answered_seconds']:.0f} s with {jupyter['notebook']} and the kernels "
                       f"{', '.join(jupyter['kernels'])}")
        lines.append(f"| `{cuda['dockerfile']}` on the stand-in `{cuda['base']}` | {cuda['build_seconds']:.0f} s | "
                     f"{cuda['image_mib']:,} MiB | {cuda['user']} | `{' '.join(cuda['cmd'])}` | {trained}; "
                     f"the healthcheck {verdict} |")
        if "jupyter" not in cuda:
            lines += ["", "This record predates the CUDA image's entrypoint, its JupyterLab and the run as a host "
                          "user's uid: `python lab/container_check.py` checks them where podman is."]
    lines += ["", "The wheelhouse here holds PyPI's torch, the CUDA build, so the CPU image measured here carries "
                  "CUDA's libraries; built online from PyTorch's CPU-only index it would not (that index is not "
                  "reachable here)."]
    return "\n".join(lines)


# Each block: the project's own, or a table of results/ (read at render time, so a test may point RESULTS elsewhere).
BLOCKS = {"models": models_block, "releases": releases_block, "inference": inference_block,
          "predict": predict_block, "containers": containers_block, "contracts": contracts_block,
          "layers": layers_block, "modules": modules_block,
          **{name: (lambda table=table: table(RESULTS)) for name, table in (
              ("expect", expect_table), ("quickstart", quickstart_text), ("index", index_table),
              ("training", tables.training_table), ("speedrun", tables.speedrun_table),
              ("bench", tables.bench_table), ("steps", tables.step_table), ("serve", tables.serve_table),
              ("scaling", tables.scaling_table), ("reference", tables.reference_tables),
              ("devices", tables.devices_table), ("serving-goals", tables.serving_goals_table),
              ("winograd", tables.winograd_tables), ("validation", tables.validation_tables))}}


# Blocks that run a command here rather than read results/: their figures are this machine's (a prediction's
# confidences differ in the last digit between CPU kinds), so `--check` leaves them out.
LIVE_BLOCKS = {"predict"}


def pages() -> list[Path]:
    """The pages that may hold generated blocks: the README, the docs, and the index of results/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]


def render(pages_text: dict[Path, str], skip: set[str]) -> dict[Path, str]:
    """The pages with every block but `skip` rendered afresh."""
    texts = dict(pages_text)
    for name, block_of in BLOCKS.items():
        if name in skip:
            continue
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        holders = [page for page, text in texts.items() if pattern.search(text)]
        if len(holders) != 1:
            found = ", ".join(page.relative_to(ROOT).as_posix() for page in holders) or "none of them"
            raise SystemExit(f"the block <!-- {name}:begin --> ... <!-- {name}:end --> must be in exactly one of "
                             f"README.md, docs/*.md and results/README.md; found in {found}")
        page = holders[0]
        block = block_of()
        if page.parent.name == "docs":  # the blocks link results/ from the project's root
            block = block.replace("](results/", "](../results/").replace("](docs/", "](")
        texts[page] = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), texts[page])
    return texts


def stale_pages() -> list[str]:
    """The pages whose blocks differ from a fresh render of results/ (the live blocks aside), with the first line
    that differs; the charts of the check are drawn in a scratch folder."""
    global CHARTS
    texts = {page: page.read_text() for page in pages()}
    kept, CHARTS = CHARTS, Path(tempfile.mkdtemp())
    try:
        fresh = render(texts, skip=LIVE_BLOCKS)
    finally:
        shutil.rmtree(CHARTS)
        CHARTS = kept
    stale = []
    for page, text in texts.items():
        if fresh[page] != text:
            line = next(new for old, new in zip(text.splitlines() + [""], fresh[page].splitlines() + [""])
                        if old != new)
            stale.append(f"{page.relative_to(ROOT).as_posix()}: differs first at {line[:100]!r}")
    return stale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each page that differs from a fresh render")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        if stale:
            raise SystemExit("stale renders, fix with `python lab/render_readme.py`:\n" + "\n".join(stale))
        print("every generated block matches results/")
        return
    update_provenance()
    for page, text in render({page: page.read_text() for page in pages()}, skip=set()).items():
        write_text(page, text)
    print(f"rewrote {', '.join(BLOCKS)} in README.md, docs/ and results/README.md")


if __name__ == "__main__":
    main()
