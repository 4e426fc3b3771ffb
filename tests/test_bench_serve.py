"""`cifarkit bench-serve` for real, but tiny: three `cifarkit serve` processes on loopback, a few hundred requests
each from its own client, a 3-second soak, and the JSON and table it writes; then against a server that runs
(`--url`), the errors a bad --url gets, and the client alone, against a stub server that drops connections."""
from __future__ import annotations

import http.server
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
from dataclasses import fields
from datetime import datetime

import pytest

from cifarkit.cli import main, options
from cifarkit.cli.serving import BENCH_SETTINGS
from cifarkit.tools.bench_serve import BenchSettings, load
from conftest import ROOT
from servers import running_server

REQUESTS = 200
LEVELS = (1, 8)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One run of the command: (its JSON, its stdout, the path it wrote)."""
    out = tmp_path_factory.mktemp("bench") / "serve-bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "cifarkit", "bench-serve", "--requests", str(REQUESTS), "--concurrency",
         *map(str, LEVELS), "--warmup", "20", "--overload-queue", "4", "--soak-s", "3", "--serve-args", "--threads 1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout, out


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_start_memory_and_exit(bench):
    report, _, _ = bench
    for name, server in report["servers"].items():
        assert 0 < server["start_s"] < 180 and server["start_s_reported_by_server"] is not None, name
        assert server["ready_memory"]["rss_mib"] > 50, name
        assert server["final_memory"]["peak_rss_mib"] >= server["ready_memory"]["rss_mib"], name
        assert server["exit_code"] == 0 and server["said_stopped"] and not server["killed"], name
        assert server["served"]["name"] == "B" and server["model_threads"] == 1, name


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_summary_table_and_provenance(bench):
    report, stdout, out = bench
    rows = {row["concurrency"]: row for row in report["summary"]["levels"]}
    assert set(rows) == set(LEVELS)
    for row in rows.values():
        assert row["ratio"] == round(row["batched_req_per_s"] / row["unbatched_req_per_s"], 2)
    assert "| batched | 8 |" in stdout and "| unbatched | 1 |" in stdout and "| overload | 256 |" in stdout
    # No ratio without its word on accuracy: the same release and backend on both sides.
    assert "- vs unbatched: the batched and unbatched servers serve one release" in stdout
    assert "the ratio is of speed" in report["summary"]["accuracy"]
    assert stdout.rstrip().endswith(f"wrote {out.name}")
    assert report["image"]["sent"] == "32 x 32 PNG"
    assert report["image"]["source"] == "cifarkit/serving/web/examples/cat.png"  # the same on every machine
    assert "HTTP/1.1 keep-alive" in report["client"]["tool"]
    text = out.read_text()
    for path in (str(ROOT), str(out.parent), sys.prefix):
        assert path not in text, f"{path} written into the JSON"
    # The command as typed, pasted back word for word: --serve-args stays one word.
    command = shlex.split(report["command"])
    assert command[:2] == ["cifarkit", "bench-serve"] and command[command.index("--serve-args") + 1] == "--threads 1"
    assert report["command"].endswith(f"--out {out.name}")
    assert datetime.fromisoformat(report["measured"]).utcoffset().total_seconds() == 0
    assert re.fullmatch(r"[0-9a-f]{40}", report["source"]["commit"])  # the tests run in a git checkout
    assert report["model_alone"]["threads"] == 1  # the servers' --threads, not the default's count


@pytest.mark.e2e
def test_a_server_that_runs(tmp_path, capsys):
    """--url: the same levels against a server the user started, none started here; its /proc is not ours to read."""
    out = tmp_path / "running.json"
    with running_server("--model", "B", "--threads", "1") as server:
        assert main(["bench-serve", "--url", server.url, "--requests", "40", "--concurrency", "1", "4",
                     "--warmup", "8", "--out", str(out)]) == 0
        printed = capsys.readouterr()
        assert main(["bench-serve", "--url", server.url, "--model", "A", "--requests", "1"]) == 2
        refused = capsys.readouterr().err
    report = json.loads(out.read_text())
    assert list(report["servers"]) == ["running"] and "summary" not in report and "model_alone" not in report
    running = report["servers"]["running"]
    assert running["url"] == server.url and report["model"] == running["served"]["name"] == "B"
    assert [level["concurrency"] for level in running["levels"]] == [1, 4]
    for level in running["levels"]:
        assert level["answers"] == level["statuses"] == {"200": 40} and level["errors"] == 0
        assert 0 < level["p50_ms"] <= level["p95_ms"] <= level["p99_ms"]
        assert level["rss_mib"] is None and level["server_cpu_s"] is None
    assert report["command"].startswith(f"cifarkit bench-serve --url {server.url} ")
    assert "| running | 4 |" in printed.out and "Traceback" not in printed.err
    assert refused.strip() == f"cifarkit: error: the server at {server.url} serves B, not A; give --model one of them"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.unit
@pytest.mark.parametrize("argv, says", [
    (["--url", "http://127.0.0.1:{port}"],
     "nothing answers at http://127.0.0.1:{port} ([Errno 111] Connection refused); start a server with "
     "`cifarkit serve`, and give --url the address its ready line prints"),
    (["--url", "127.0.0.1:{port}"], "--url must be http://HOST:PORT, as `cifarkit serve` prints it in its ready line"),
    (["--url", "https://127.0.0.1:{port}"], "--url must be http://HOST:PORT"),
    (["--url", "http://127.0.0.1:{port}", "--soak-s", "5", "--max-batch", "8"],
     "--max-batch, --soak-s set the servers that bench-serve starts, and with --url it starts none"),
])
def test_a_bad_url_is_one_line_that_says_what_to_do(tmp_path, capsys, argv, says):
    port = closed_port()
    out = tmp_path / "out.json"
    assert main(["bench-serve", *(a.format(port=port) for a in argv), "--requests", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cifarkit: error: " + says.format(port=port)) and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.unit
def test_help_states_the_settings_defaults():
    helps = {dest: text for command, _, dest, text in options() if command == "cifarkit bench-serve"}
    defaults = {f.name: f.default for f in fields(BenchSettings)}
    assert set(BENCH_SETTINGS) == set(defaults)
    for name in BENCH_SETTINGS:
        stated = re.search(r"\(default: ([^)]*)\)", helps[name]).group(1)
        value = defaults[name]
        if name == "model":  # a rule rather than a name
            assert stated.startswith("B; with --url, the server's default"), name
        elif isinstance(value, tuple):
            assert stated == " ".join(map(str, value)), name
        else:
            assert stated == ("none" if value == "" else f"{value:,}" if isinstance(value, int) else str(value)), name


@pytest.mark.e2e
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
        result = load(f"http://127.0.0.1:{server.server_port}", "B", b"x" * 100, 103, 4)
    finally:
        server.shutdown()
        server.server_close()
    assert result["requests"] == 103 and len(seen) == 103
    assert result["complete"] + sum(result["failures"].values()) == 103
    assert result["failures"] == {"IncompleteReadError": len(seen) // 5}
    assert set(result["answers"]) == {"200", "503"} and result["errors"] == 103 - result["answers"]["200"]
    assert result["by_status"]["503"]["count"] == result["answers"]["503"]
