"""How the code is laid out, measured: the import graph, file and function sizes, the prose share, long lines.

    python lab/layout_metrics.py --json results/layout-after.json [--unit-tests]

Issue 32 asks for these figures before and after the move into layered subpackages; this script takes them from
the working tree, so the two JSON files can be compared field by field. `--unit-tests` also times `pytest -m unit`.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "cifarkit"
SHIPPED = PACKAGE / "pretrained"  # release files, copied verbatim into the package; not the package's code
LONG_LINE = 100
TOP = 10


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if SHIPPED not in p.parents)


def import_graph() -> dict:
    graph = grimp.build_graph("cifarkit")
    modules = sorted(m for m in graph.modules if not m.startswith("cifarkit.pretrained"))
    edges = sorted((a, b) for a in modules for b in graph.find_modules_directly_imported_by(a)
                   if b in modules and not a.startswith(b + "."))  # a package's own __init__ is not an edge
    return {"modules": len(modules), "edges": len(edges), "cycles": cycles(modules, edges)}


def cycles(modules: list[str], edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan): each is a set of modules in a cycle."""
    after = {m: [] for m in modules}
    for a, b in edges:
        after[a].append(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in after[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for m in modules:
        if m not in index:
            visit(m)
    return sorted(found)


def prose_lines(text: str) -> set[int]:
    """Line numbers holding a comment or a docstring."""
    lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def functions(path: Path, text: str) -> list[dict]:
    name = str(path.relative_to(PACKAGE.parent))
    return [{"function": f"{name}:{node.name}", "lines": node.end_lineno - node.lineno + 1}
            for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def code_figures() -> dict:
    files, funcs, total, prose, long_lines = [], [], 0, 0, 0
    for path in source_files():
        text = path.read_text()
        lines = text.splitlines()
        code = sum(1 for line in lines if line.strip())
        total += code
        prose += len(prose_lines(text))
        long_lines += sum(1 for line in lines if len(line) > LONG_LINE)
        files.append({"file": str(path.relative_to(PACKAGE.parent)), "lines": len(lines),
                      "bytes": path.stat().st_size})
        funcs.extend(functions(path, text))
    folders = {}
    for f in files:
        folders.setdefault(str(Path(f["file"]).parent), []).append(f["file"])
    return {
        "files": len(files),
        "lines": sum(f["lines"] for f in files),
        "bytes": sum(f["bytes"] for f in files),
        "most_files_in_one_folder": max(len(v) for v in folders.values()),
        "largest_files": sorted(files, key=lambda f: -f["bytes"])[:TOP],
        "largest_functions": sorted(funcs, key=lambda f: -f["lines"])[:TOP],
        "prose_share": round(prose / total, 3),
        f"lines_over_{LONG_LINE}_columns": long_lines,
    }


def unit_test_seconds() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "unit", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          capture_output=True, text=True)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    return {"command": "pytest -m unit", "wall_s": round(time.perf_counter() - start, 1), "summary": summary,
            "returncode": done.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here as well")
    parser.add_argument("--unit-tests", action="store_true", help="also time `pytest -m unit`")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True)
    env = json.loads(subprocess.run(["cifarkit", "env", "--json"], capture_output=True, text=True, check=True).stdout)
    report = {"commit": commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else ""),
              "cpu": {key: env[key] for key in ("processor", "cpu_features", "threads")},
              "import_graph": import_graph(), **code_figures(),
              "readme_lines": len((ROOT / "README.md").read_text().splitlines())}
    if args.unit_tests:
        report["unit_tests"] = unit_test_seconds()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
