"""lab/bench_serve.py for real, but tiny: three `cifarkit serve` processes on loopback, a few hundred requests
each from the script's own client, a 3-second soak; the JSON it writes, its table, and the README block rendered
from that JSON. And the client alone, against a stub server that drops connections."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from cifarkit.inference import backends
from conftest import ROOT, load_script

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "lab" / "bench_serve.py"
REQUESTS = 200
LEVELS = (1, 8)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One run of the script: (its JSON, its stdout, the path it wrote)."""
    out = tmp_path_factory.mktemp("bench") / "serve-bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", str(REQUESTS), "--concurrency", *map(str, LEVELS),
         "--warmup", "20", "--overload-queue", "4", "--soak-s", "3", "--serve-args", "--threads 1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout, out


def test_every_level_is_measured(bench):
    report, _, _ = bench
    servers = report["servers"]
    assert list(servers) == ["batched", "unbatched", "overload"]
    for name in ("batched", "unbatched"):
        assert [level["concurrency"] for level in servers[name]["levels"]] == list(LEVELS)
    for name, server in servers.items():
        for level in server["levels"]:
            where = f"{name} at concurrency {level['concurrency']}"
            assert level["req_per_s"] > 0 and level["requests"] == REQUESTS, where
            assert 0 < level["p50_ms"] <= level["p95_ms"] <= level["p99_ms"] <= level["max_ms"], where
            assert sum(level["answers"].values()) == level["complete"] == REQUESTS and not level["failures"], where
            # What the server counted agrees with what the client got: one /v1/predict answer per request.
            assert level["statuses"] == level["answers"], where
            assert level["server_latency"]["count"] == REQUESTS, where
            assert level["batches"]["count"] > 0 and level["batches"]["mean_size"] >= 1, where
            assert level["rss_mib"] > 0 and level["peak_rss_mib"] >= level["rss_mib"], where
            assert level["client_cpu_s"] > 0 and level["client_cpu_ms_per_request"] > 0, where
            assert level["server_cpu_s"] is not None, where
            if name != "overload":
                assert level["errors"] == 0 and level["answers"] == {"200": REQUESTS}, where
                assert level["by_status"]["200"]["p99_ms"] == level["p99_ms"], where


def test_batch_sizes(bench):
    report, _, _ = bench
    servers = report["servers"]
    for level in servers["unbatched"]["levels"]:
        assert level["batches"]["mean_size"] == 1
        assert level["batches"]["distribution"] == {"1": REQUESTS} and level["batches"]["count"] == REQUESTS
    assert servers["batched"]["batching"]["max_batch"] == 64 and servers["unbatched"]["batching"]["max_batch"] == 1
    # Eight requests in flight at once are batched: fewer forward passes than requests.
    eight = servers["batched"]["levels"][1]
    assert eight["batches"]["count"] < REQUESTS and eight["batches"]["mean_size"] > 1
    assert sum(eight["batches"]["distribution"].values()) == eight["batches"]["count"]


def test_start_memory_and_exit(bench):
    report, _, _ = bench
    for name, server in report["servers"].items():
        assert 0 < server["start_s"] < 180 and server["start_s_reported_by_server"] is not None, name
        assert server["ready_memory"]["rss_mib"] > 50, name
        assert server["final_memory"]["peak_rss_mib"] >= server["ready_memory"]["rss_mib"], name
        assert server["exit_code"] == 0 and server["said_stopped"] and not server["killed"], name
        assert server["served"]["name"] == "B", name


def test_overload_and_soak(bench):
    report, _, _ = bench
    over = report["servers"]["overload"]
    assert over["batching"]["max_queue"] == 4
    level = over["levels"][0]
    assert level["concurrency"] == 256 and set(level["answers"]) <= {"200", "503"}
    refused = level["by_status"]["503"]  # 200 requests at once against a queue of 4: most are refused
    assert refused["count"] == level["answers"]["503"] > 0 and 0 < refused["p50_ms"] <= refused["p99_ms"]
    assert over["after"]["alive"] and over["after"]["label"] == "cat"
    goal = report["summary"]["goals"]["overload"]
    assert goal["responses_503"] == refused["count"] and goal["p99_503_ms"] == refused["p99_ms"]
    assert goal["alive_after_met"] and goal["other_errors"] == 0 and goal["refused_met"]

    soak = report["servers"]["batched"]["soak"]
    assert 2 <= soak["seconds"] < 30 and soak["requests"] > 0 and soak["errors"] == 0
    assert soak["rss_mib"]["start"] > 0 and soak["rss_mib"]["max"] >= soak["rss_mib"]["end"]
    assert len(soak["rss_samples"]) >= 3 and soak["chunks"] and soak["client_cpu_s"] > 0
    goals = report["summary"]["goals"]
    assert goals["soak"]["errors_met"] and not goals["soak"]["seconds_met"]  # 3 s is no 5-minute soak
    assert "concurrency_64" not in goals  # not measured here, so not claimed
    for name, goal in goals.items():
        assert goal["met"] == all(v for k, v in goal.items() if k.endswith("_met")), name


def test_summary_table_and_portability(bench):
    report, stdout, out = bench
    rows = {row["concurrency"]: row for row in report["summary"]["levels"]}
    assert set(rows) == set(LEVELS)
    for row in rows.values():
        assert row["ratio"] == round(row["batched_req_per_s"] / row["unbatched_req_per_s"], 2)
    assert "| batched | 8 |" in stdout and "| unbatched | 1 |" in stdout and "| overload | 256 |" in stdout
    assert report["image"]["sent"] == "32 x 32 PNG" and report["image"]["source"] == "examples/images/cat.png"
    assert "HTTP/1.1 keep-alive" in report["client"]["tool"]
    text = out.read_text()
    for path in (str(ROOT), str(out.parent), sys.prefix):
        assert path not in text, f"{path} written into the JSON"
    assert report["command"].endswith(f"--out {out.name}")
    assert report["model_alone"]["threads"] == 1  # the servers' --threads, not the default's count


def test_readme_block(bench, monkeypatch):
    _, _, out = bench
    render = load_script(ROOT / "lab" / "render_readme.py")
    monkeypatch.setattr(render, "RESULTS", out.parent / "missing")
    assert render.serve_block().startswith("Not measured yet")
    monkeypatch.setattr(render, "RESULTS", out.parent)
    block = render.serve_block()
    assert "| concurrency | batched req/s | unbatched req/s | ratio |" in block
    assert "\n| 8 | " in block and "HTTP/1.1 keep-alive" in block
    assert "Overload" in block and "Soak" in block and "Start" in block
    # the per-CPU-kind table: this machine's kind, the backend the server chose, and the command
    report = json.loads(out.read_text())
    row = next(line for line in render.cpu_kind_block().splitlines() if "serving release B" in line)
    assert row.startswith(f"| {backends.cpu_kind()} | ") and report["servers"]["batched"]["served"]["backend"] in row
    assert f"`{report['command']}`" in row


def test_client_counts_failures_and_reconnects():
    """Every third answer says `Connection: close`, every fifth request gets none (the connection just closes): still
    exactly the requests asked for, each either answered or counted as a failure."""
    seen, lock = [], threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                seen.append(1)
                n = len(seen)
            if n % 5 == 0:
                self.close_connection = True
                return
            self.send_response(200 if n % 7 else 503)
            self.send_header("Content-Length", "2")
            if n % 3 == 0:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bench_serve = load_script(SCRIPT)
        result = bench_serve.load(f"http://127.0.0.1:{server.server_port}", "B", b"x" * 100, 103, 4)
    finally:
        server.shutdown()
    assert result["requests"] == 103 and len(seen) == 103
    assert result["complete"] + sum(result["failures"].values()) == 103
    assert result["failures"] == {"IncompleteReadError": len(seen) // 5}
    assert set(result["answers"]) == {"200", "503"} and result["errors"] == 103 - result["answers"]["200"]
    assert result["by_status"]["503"]["count"] == result["answers"]["503"]
