"""The serving tables (cifarkit.tools.result_tables), rendered from what a tiny `cifarkit bench-serve` run writes: the
batched-against-unbatched table and the serving goals' row of this machine's CPU kind."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cifarkit.inference import backends
from cifarkit.tools import result_tables, results

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One tiny run, with the goals' level (64) among its levels and its servers on one thread: (its JSON, its path)."""
    out = tmp_path_factory.mktemp("checkout") / "results" / "serve-bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "cifarkit", "bench-serve", "--requests", "128", "--concurrency", "8", "64",
         "--warmup", "0", "--overload-queue", "4", "--soak-s", "2", "--serve-args", "--threads 1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), out


def test_serve_table(bench):
    report, out = bench
    block = result_tables.serve_table(out.parent)
    assert "| concurrency | batched req/s | unbatched req/s | ratio |" in block
    assert "\n| 8 | " in block and "\n| 64 | " in block and "HTTP/1.1 keep-alive" in block
    assert "Overload" in block and "Soak" in block and "Start" in block
    assert f"Written by `{report['command']}` (`results/serve-bench.json`)." in block
    assert result_tables.serve_table(out.parent / "missing").startswith("Not measured yet")


def test_serving_goals_row(bench):
    """This machine's kind, the backend the server chose and the options the command gave the servers."""
    report, out = bench
    assert results.serve_options(report) == "--threads 1" and not results.serves_defaults(report)
    assert shlex.split(report["command"])[:2] == ["cifarkit", "bench-serve"]
    row = next(line for line in result_tables.serving_goals_table(out.parent).splitlines()
               if f"`results/{out.name}`" in line)
    backend = report["servers"]["batched"]["served"]["backend"]
    assert row.startswith(f"| {backends.cpu_kind()} | ") and f"| {backend}, `--threads 1` |" in row
