"""`cifarkit bench-serve`: load-test `cifarkit serve` on loopback, batched against unbatched, or a server that runs.

    cifarkit bench-serve                                   # B; 20,000 requests per level at 1 16 64 256; 5-minute soak
    cifarkit bench-serve --requests 2000 --soak-s 0        # a quick look, a minute or two
    cifarkit bench-serve --url http://127.0.0.1:8000 --requests 2000     # a server you started, as it runs

The client is this module: asyncio (uvloop where installed), one HTTP/1.1 keep-alive connection per concurrent client,
as browsers, requests.Session and httpx keep theirs, each sending its share of exactly --requests back to back: POST
/v1/predict with a 32 x 32 PNG as the raw body, in one write; then the answer's head and exactly Content-Length bytes.
Latency: from just before the write to the last byte. A socket failure (reset, EOF, no answer in 60 s) is an error of
its kind, and the client reconnects, as after a `Connection: close`. It shares the server's cores, at about 0.05 ms of
CPU per request at concurrency 64 (0.13 ms at 1; 5% of a core at 1,000 req/s), recorded per level next to the
server's CPU. Run it alone: the JSON keeps the load average it started from. It is written by hand because locust
runs for a time, not an exact count of requests, and rounds the latencies its percentiles come from, while aiohttp,
no dependency of cifarkit, would replace only the few lines here that speak HTTP.

Without --url, one server at a time: batched (`--max-batch 64`), unbatched (`--max-batch 1`), overload (batched,
`--max-queue 32`, concurrency 256). Each: the time from launch to its ready line, RSS then; 500 warm-up requests; the
levels; the batched one then soaks (concurrency 64, `--soak-s`, in runs of ~10 s, RSS sampled every 2 s); overload
must answer /healthz, /readyz and a prediction afterwards; SIGTERM. Then the model alone, in this process, as the
batched server ran it. Per level: req/s; latency percentiles overall and per status; errors (all but 200s); /metrics
deltas; RSS, peak RSS and CPU from /proc. A missed goal is reported, never an exit code. With --url: the warm-up and
the levels against that server alone, and what its /metrics says; no server is started, so no /proc figures.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from importlib.resources import files
from urllib.parse import urlsplit

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from cifarkit.core.errors import CifarkitError

try:
    from uvloop import run as run_loop
except ImportError:
    run_loop = asyncio.run

log = logging.getLogger("cifarkit")

READY = re.compile(r"cifarkit serve: ready at (http://\S+) with .*\(([\d.]+) s after the command started\)")
# The server's own word for its model thread's count, which the model alone is then timed on.
MODEL_THREADS = re.compile(r"the model thread runs on (\d+) threads")
PREDICT = "/v1/predict"
# The page's example cat, shipped in the package: every request sends it, box-reduced to 32 x 32.
IMAGE = "serving/web/examples/cat.png"
DEFAULT_MODEL = "B"  # the release the goals below are for
START_TIMEOUT_S, STOP_TIMEOUT_S = 180, 60
REQUEST_TIMEOUT_S = 60  # past the server's own timeout (504 after 10 s): a slow answer is an answer, not a failure
WARMUP_CONCURRENCY, SOAK_CONCURRENCY, OVERLOAD_CONCURRENCY = 16, 64, 256
SOAK_CHUNK_S = 10  # the soak is a series of runs this long, so a drift shows in its time series
RSS_EVERY_S = 2
VERSIONS = ("cifarkit", "fastapi", "starlette", "uvicorn", "httptools", "uvloop", "prometheus-client")

# The issue's goals, for version B on this 2-core CPU.
GOAL_CONCURRENCY = 64  # the level the goals below are read at: busy, not overloaded
GOAL_REQ_PER_S = 1000  # the throughput the server was built for
GOAL_P99_MS = 100  # an answer still feels immediate at that load
GOAL_REQUESTS = 20_000  # enough that the p99 rests on 200 requests
GOAL_RATIO = 2.5  # batching must pay for its wait: req/s over the unbatched server's, same concurrency
GOAL_503_P99_MS = 100  # "overload answers 503 quickly": a refusal is no slower than a normal answer
GOAL_SOAK_S = 300  # long enough for a leak of a few bytes per request to show
GOAL_SOAK_RSS_PCT = 10  # RSS growth from the soak's first sample to its last: no leak


@dataclass(frozen=True)
class BenchSettings:
    """Every default of `cifarkit bench-serve`, in one place; its --help names the option of each."""
    model: str | None = None  # None: DEFAULT_MODEL on the servers started here, the server's default with a URL
    requests: int = GOAL_REQUESTS  # per load level
    concurrency: tuple[int, ...] = (1, 16, GOAL_CONCURRENCY, 256)  # clients at once, one level each
    warmup: int = 500  # unrecorded requests to each server first
    max_batch: int = 64  # of the batched servers: `cifarkit serve`'s default
    backend: str = "auto"
    serve_args: str = ""  # more `cifarkit serve` options for every server started here
    overload_queue: int = 32  # --max-queue of the overload server; 0: no overload server
    soak_s: float = GOAL_SOAK_S  # load on the batched server after its levels; 0: no soak


# The settings of the servers started here: meaningless against a server that runs already.
SERVER_OPTIONS = ("max_batch", "backend", "serve_args", "overload_queue", "soak_s")


def proc(pid: int | None) -> dict:
    """RSS and peak RSS in MiB and CPU seconds from /proc; None where the process is gone or not ours (no pid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
        with open(f"/proc/{pid}/stat") as f:
            ticks = f.read().rpartition(")")[2].split()[11:13]  # utime, stime
    except OSError:  # also where pid is None: there is no /proc/None
        return {"rss_mib": None, "peak_rss_mib": None, "cpu_s": None}
    return {"rss_mib": round(kib["VmRSS"] / 1024, 1), "peak_rss_mib": round(kib["VmHWM"] / 1024, 1),
            "cpu_s": sum(map(int, ticks)) / os.sysconf("SC_CLK_TCK")}


def scrub(text: str) -> str:
    for path, name in ((os.getcwd(), "."), (sys.prefix, "VENV"), (os.path.expanduser("~"), "~")):
        text = text.replace(path, name)
    return text


def address(url: str) -> tuple[str, int]:
    """The host and port of an http:// URL with no path, e.g. what `cifarkit serve` prints in its ready line."""
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/") or parts.query:
        raise CifarkitError(f"--url must be http://HOST:PORT, as `cifarkit serve` prints it in its ready line, "
                            f"got {url!r}")
    return parts.hostname, port


class Endpoint:
    """A server reached over HTTP. Not started here, so it has no process to read /proc of."""
    pid: int | None = None

    def __init__(self, url: str):
        host, port = address(url)
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def exit_code(self) -> int | None:
        return None

    def get(self, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        """The status and body of a GET (or a POST of `data`); status 0 and the reason when no answer came."""
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "image/png"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError as e:
            return 0, str(getattr(e, "reason", e)).encode()

    def metrics(self) -> dict | None:
        """Every sample of /metrics, (name, labels) -> value; None when it does not answer."""
        status, body = self.get("/metrics")
        return None if status != 200 else {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


class Server(Endpoint):
    """`python -m cifarkit serve --port 0 ARGS`, ready. Its output goes to a file: a pipe left unread would fill up
    and stall it, and a file needs no reader thread."""

    def __init__(self, args: list[str]):
        self.log = tempfile.TemporaryFile()
        launched = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "cifarkit", "serve", "--port", "0", *args],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid
        while not (ready := READY.search(self.output())) and self.process.poll() is None \
                and time.perf_counter() - launched < START_TIMEOUT_S:
            time.sleep(0.01)
        self.start_s = time.perf_counter() - launched
        if not ready:
            self.process.kill()
            log.error("%s", scrub(self.output())[-3000:])
            raise CifarkitError(f"`cifarkit serve {' '.join(args)}` was not ready within {START_TIMEOUT_S} s; its "
                                f"output is above")
        super().__init__(ready[1])
        self.reported_start_s, self.ready_memory = float(ready[2]), proc(self.pid)
        threads = MODEL_THREADS.search(self.output())
        self.model_threads = int(threads[1]) if threads else None

    def exit_code(self) -> int | None:
        return self.process.poll()

    def output(self) -> str:
        # pread leaves alone the file offset the server writes at.
        return os.pread(self.log.fileno(), os.fstat(self.log.fileno()).st_size, 0).decode(errors="replace")

    def stop(self) -> dict:
        started, killed = time.perf_counter(), False
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            killed = True
        lines = scrub(self.output()).splitlines()
        self.log.close()
        return {"exit_code": self.process.returncode, "stop_s": round(time.perf_counter() - started, 2),
                "killed": killed, "said_stopped": any("cifarkit serve: stopped" in line for line in lines),
                "log_lines": len(lines), "problems": [line for line in lines if re.search(
                    r"ERROR|CRITICAL|Traceback|WARNING|Exception", line)][:10]}


def metrics_delta(before: dict | None, after: dict | None, model: str) -> dict:
    """What the server counted between two scrapes of /metrics."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()} if before and after else {}

    def samples(name: str, **match) -> list[tuple[dict, float]]:
        return [(dict(lb), v) for (n, lb), v in delta.items() if n == name and match.items() <= dict(lb).items()]

    def total(name: str, **match) -> float:
        return sum(v for _, v in samples(name, **match))

    distribution, below, low = {}, 0.0, 1
    for bound, count in sorted((float(lb["le"]), v) for lb, v in samples("cifarkit_batch_size_bucket", model=model)):
        label = f">{low - 1}" if bound == float("inf") else f"{low}" if low >= bound else f"{low}-{bound:.0f}"
        if round(count - below):
            distribution[label] = round(count - below)
        below, low = count, low if bound == float("inf") else int(bound) + 1
    batches = round(total("cifarkit_batch_size_count", model=model))
    answered = total("cifarkit_http_request_duration_seconds_count", endpoint=PREDICT)
    statuses = sorted(samples("cifarkit_http_requests_total", endpoint=PREDICT), key=lambda s: s[0]["status"])
    return {
        **({} if delta else {"scrape_failed": True}),
        "statuses": {lb["status"]: round(v) for lb, v in statuses if round(v)},
        "batches": {"count": batches, "distribution": distribution, "mean_size":
                    round(total("cifarkit_batch_size_sum", model=model) / batches, 2) if batches else None},
        "images": {lb["outcome"]: round(v) for lb, v in samples("cifarkit_images_total", model=model) if round(v)},
        # From the app's first look at a request to its answer: no connect, no wait to be accepted or parsed. Its
        # histogram's buckets are too coarse for percentiles; the mean is exact.
        "server_latency": {"count": round(answered), "mean_ms": round(1000 * total(
            "cifarkit_http_request_duration_seconds_sum", endpoint=PREDICT) / answered, 2) if answered else None},
    }


def read_head(head: bytes) -> tuple[int, int, bool]:
    """Status, Content-Length and whether the server closes the connection."""
    lines = head[:-4].split(b"\r\n")
    fields = {key.strip().lower(): value.strip() for key, _, value in (line.partition(b":") for line in lines[1:])}
    if b"content-length" not in fields:
        raise ValueError("an answer without Content-Length")
    return int(lines[0].split()[1]), int(fields[b"content-length"]), fields.get(b"connection") == b"close"


def latency_figures(seconds: list[float]) -> dict:
    ms = 1000 * np.asarray(seconds)
    figures = [*np.percentile(ms, [50, 95, 99]), ms.max(), ms.mean()] if len(ms) else [None] * 5
    return {"count": len(ms), **{k: v if v is None else round(float(v), 2)
                                 for k, v in zip(("p50_ms", "p95_ms", "p99_ms", "max_ms", "mean_ms"), figures)}}


def load(url: str, model: str, body: bytes, requests: int, concurrency: int) -> dict:
    """Exactly `requests` POSTs of `body` from `concurrency` keep-alive clients at once, and what came of them."""
    host, port = address(url)
    request = (f"POST {PREDICT}?model={model} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: image/png\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    shares = [requests // concurrency + (i < requests % concurrency) for i in range(min(concurrency, requests))]
    answers: list[tuple[int, float]] = []
    failures: Counter[str] = Counter()

    async def connect():
        reader, writer = await asyncio.open_connection(host, port)
        # Or a request may wait out the peer's delayed ACK (Nagle), some 40 ms.
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def client(count: int, connection):
        for _ in range(count):
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    if connection is None:
                        connection = await connect()
                    reader, writer = connection
                    started = time.perf_counter()
                    writer.write(request)
                    status, length, close = read_head(await reader.readuntil(b"\r\n\r\n"))
                    await reader.readexactly(length)
                answers.append((status, time.perf_counter() - started))
            except (OSError, EOFError, ValueError, asyncio.LimitOverrunError) as e:  # TimeoutError is an OSError
                failures[type(e).__name__] += 1  # IncompleteReadError: EOF
                close = True
            if close and connection:
                connection[1].close()
                connection = None
        if connection:
            connection[1].close()

    async def run() -> tuple[float, float]:
        # Connected before the clock starts; a client whose connect failed retries on its first request.
        connections = await asyncio.gather(*(connect() for _ in shares), return_exceptions=True)
        # RUSAGE_SELF: in the soak, it also counts the RSS sampler thread, idle nearly all the time.
        cpu, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        await asyncio.gather(*(client(n, None if isinstance(c, BaseException) else c)
                               for n, c in zip(shares, connections)))
        wall, done = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        return wall, done.ru_utime + done.ru_stime - cpu.ru_utime - cpu.ru_stime

    wall, cpu = run_loop(run())
    statuses = Counter(status for status, _ in answers)
    return {"requests": requests, "concurrency": concurrency, "wall_s": round(wall, 3), "complete": len(answers),
            "req_per_s": round(len(answers) / wall, 1), "answers": {str(s): statuses[s] for s in sorted(statuses)},
            "failures": dict(failures), "errors": requests - statuses[200],
            **latency_figures([t for _, t in answers]),
            "by_status": {str(s): latency_figures([t for code, t in answers if code == s]) for s in sorted(statuses)},
            "client_cpu_s": round(cpu, 3), "client_cpu_ms_per_request": round(1000 * cpu / requests, 4)}


def measure(server: Endpoint, model: str, body: bytes, requests: int, concurrency: int) -> dict:
    """load(), and what the server's /metrics and /proc say of it."""
    before, cpu = server.metrics(), proc(server.pid)["cpu_s"]
    level = load(server.url, model, body, requests, concurrency)
    after = proc(server.pid)
    used = None if cpu is None or after["cpu_s"] is None else round(after["cpu_s"] - cpu, 2)
    level.update(metrics_delta(before, server.metrics(), model), server_cpu_s=used,
                 server_cpu_ms_per_request=None if used is None else round(1000 * used / requests, 3),
                 rss_mib=after["rss_mib"], peak_rss_mib=after["peak_rss_mib"])
    if (code := server.exit_code()) is not None:
        level["server_exited"] = code
    return level


def soak(server: Server, model: str, body: bytes, seconds: float, rate: float) -> dict:
    """Load for about `seconds` in runs of about SOAK_CHUNK_S at `rate`, RSS sampled all along."""
    samples, chunks, stop, started = [], [], threading.Event(), time.perf_counter()

    def sample():
        if (rss := proc(server.pid)["rss_mib"]) is not None:
            samples.append([round(time.perf_counter() - started, 1), rss])

    def sampler():
        while not stop.wait(RSS_EVERY_S):
            sample()

    sample()
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    while (left := seconds - (time.perf_counter() - started)) > 0:  # at least `seconds`: the goal's length
        count = max(SOAK_CONCURRENCY, round(rate * min(SOAK_CHUNK_S, left)))
        run = measure(server, model, body, count, SOAK_CONCURRENCY)
        rate = run["req_per_s"] or rate
        chunks.append({"at_s": round(time.perf_counter() - started, 1), **{k: run[k] for k in (
            "requests", "errors", "failures", "req_per_s", "p50_ms", "p99_ms", "max_ms", "client_cpu_s", "server_cpu_s",
            "statuses")}, "mean_batch": run["batches"]["mean_size"]})
        sample()
        if run["complete"] == 0:  # the server is gone: more runs would only add errors
            break
    duration = time.perf_counter() - started
    stop.set()
    thread.join()
    sample()
    first, last, top = samples[0][1], samples[-1][1], max(rss for _, rss in samples)
    requests, errors = sum(c["requests"] for c in chunks), sum(c["errors"] for c in chunks)
    return {"seconds": round(duration, 1), "concurrency": SOAK_CONCURRENCY, "chunk_s": SOAK_CHUNK_S,
            "requests": requests, "errors": errors,
            "req_per_s": round((requests - errors) / duration, 1),
            "worst_chunk_p99_ms": max((c["p99_ms"] for c in chunks if c["p99_ms"] is not None), default=None),
            **{k: round(sum(c[k] or 0 for c in chunks), 2) for k in ("client_cpu_s", "server_cpu_s")},
            "rss_mib": {"start": first, "end": last, "max": top, "growth_pct": round(100 * (last - first) / first, 2)},
            "peak_rss_mib": proc(server.pid)["peak_rss_mib"], "rss_samples": samples, "chunks": chunks}


def served(server: Endpoint, model: str) -> dict:
    """What /v1/models says of `model` and of the server's batching."""
    status, answer = server.get("/v1/models")
    if status != 200:
        return {}
    described = json.loads(answer)
    found = next((m for m in described["models"] if m["name"] == model), {})
    return {"served": {k: found.get(k) for k in ("name", "source", "model", "device", "backend", "backend_reason",
                                                 "cpu_kind", "weights_sha256")}, "batching": described["batching"]}


def exercise(name: str, server: Endpoint, model: str, body: bytes, settings: BenchSettings, levels,
             soak_s: float = 0, after_check: bool = False) -> dict:
    """The warm-up, the load levels, then the checks after overload and the soak: one server's record."""
    record = served(server, model)
    if settings.warmup:
        warm = load(server.url, model, body, settings.warmup, WARMUP_CONCURRENCY)
        record["warmup"] = {k: warm[k] for k in ("requests", "concurrency", "errors", "req_per_s")}
    record["levels"] = []
    for concurrency in levels:
        record["levels"].append(lv := measure(server, model, body, settings.requests, concurrency))
        log.info("%s at concurrency %d: %s req/s, p99 %s ms, answers %s, failures %s", name, concurrency,
                 f"{lv['req_per_s']:,.0f}", fmt(lv["p99_ms"]), lv["answers"], lv["failures"])
    if after_check:
        health, ready = server.get("/healthz")[0], server.get("/readyz")[0]
        predict, answer = server.get(f"{PREDICT}?model={model}", body)
        record["after"] = {"healthz": health, "readyz": ready, "predict": predict,
                           "label": json.loads(answer)["predictions"][0]["label"] if predict == 200 else None,
                           "alive": (health, ready, predict) == (200, 200, 200) and server.exit_code() is None}
    if soak_s > 0:
        rate = next((lv["req_per_s"] for lv in record["levels"] if lv["concurrency"] == SOAK_CONCURRENCY),
                    record["levels"][-1]["req_per_s"] if record["levels"] else 0)
        log.info("%s: soak for %g s", name, soak_s)
        record["soak"] = soak(server, model, body, soak_s, rate or 500)
    return record


def run_server(name: str, args: list[str], levels, settings: BenchSettings, model: str, body: bytes,
               soak_s: float = 0, after_check: bool = False) -> dict:
    log.info("%s: starting `cifarkit serve %s`", name, " ".join(args))
    server = Server(args)
    record = {"command": "python -m cifarkit serve --port 0 " + " ".join(args), "start_s": round(server.start_s, 2),
              "start_s_reported_by_server": server.reported_start_s, "ready_memory": server.ready_memory,
              "model_threads": server.model_threads}
    try:
        record.update(exercise(name, server, model, body, settings, levels, soak_s, after_check))
        record["final_memory"] = proc(server.pid)
    finally:
        record.update(server.stop())
    return record


def verdict(goal: dict) -> dict:
    return {**goal, "met": all(v for k, v in goal.items() if k.endswith("_met"))}


def summarize(servers: dict) -> dict:
    batched = {lv["concurrency"]: lv for lv in servers["batched"]["levels"]}
    unbatched = {lv["concurrency"]: lv for lv in servers["unbatched"]["levels"]}
    ratios = {c: round(b["req_per_s"] / u["req_per_s"], 2) if (u := unbatched.get(c)) and u["req_per_s"] else None
              for c, b in batched.items()}
    rows = [{"concurrency": c, "batched_req_per_s": b["req_per_s"], "ratio": ratios[c],
             "unbatched_req_per_s": unbatched[c]["req_per_s"] if c in unbatched else None} for c, b in batched.items()]
    goals = {}
    if lv := batched.get(GOAL_CONCURRENCY):
        ratio = ratios[GOAL_CONCURRENCY]
        goals[f"concurrency_{GOAL_CONCURRENCY}"] = verdict({
            "requests": lv["requests"], "requests_met": lv["requests"] >= GOAL_REQUESTS,
            "req_per_s": lv["req_per_s"], "req_per_s_met": lv["req_per_s"] >= GOAL_REQ_PER_S,
            "p99_ms": lv["p99_ms"], "p99_met": lv["p99_ms"] is not None and lv["p99_ms"] <= GOAL_P99_MS,
            "errors": lv["errors"], "errors_met": lv["errors"] == 0,
            "ratio": ratio, "ratio_met": ratio is not None and ratio >= GOAL_RATIO})
    if over := servers.get("overload"):
        lv = over["levels"][0]
        refused = lv["by_status"].get("503", {"count": 0, "p99_ms": None})
        goals["overload"] = verdict({
            "concurrency": lv["concurrency"], "max_queue": over.get("batching", {}).get("max_queue"),
            "requests": lv["requests"], "responses_503": refused["count"],
            "share_503": round(refused["count"] / lv["requests"], 4), "refused_met": refused["count"] > 0,
            "p99_503_ms": refused["p99_ms"],
            "p99_503_met": refused["p99_ms"] is not None and refused["p99_ms"] <= GOAL_503_P99_MS,
            "p99_200_ms": lv["by_status"].get("200", {}).get("p99_ms"),
            "other_errors": lv["errors"] - refused["count"], "other_errors_met": lv["errors"] == refused["count"],
            "alive_after_met": over["after"]["alive"], "exit_code_met": over["exit_code"] == 0})
    if s := servers["batched"].get("soak"):
        goals["soak"] = verdict({
            "seconds": s["seconds"], "seconds_met": s["seconds"] >= GOAL_SOAK_S, "requests": s["requests"],
            "rss_growth_pct": s["rss_mib"]["growth_pct"],
            "rss_growth_met": s["rss_mib"]["growth_pct"] < GOAL_SOAK_RSS_PCT,
            "errors": s["errors"], "errors_met": s["errors"] == 0})
    constants = {name.removeprefix("GOAL_").lower(): v for name, v in globals().items() if name.startswith("GOAL_")}
    return {"levels": rows, "goals": goals, "goal_constants": constants, "accuracy": SAME_ANSWERS}


# Every ratio here is of speed alone, and says so wherever it is printed or recorded.
SAME_ANSWERS = ("the batched and unbatched servers serve one release through one backend: the ratio is of speed; the "
                "accuracy served is the release's, measured per backend and CPU kind in its metrics.json")


def fmt(value, spec=".1f", unit="") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def table(report: dict) -> str:
    """The levels of every server, then one line each on the model alone, the starts, the soak and the goals, where
    the report has them."""
    lines = ["| server | concurrency | requests | req/s | vs unbatched | p50 / p95 / p99 / max ms | errors | 503s "
             "(their p99 ms) | mean batch | CPU ms/request, client / server | RSS MiB |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    summary = report.get("summary", {})
    ratios = {r["concurrency"]: r["ratio"] for r in summary.get("levels", [])}
    for name, server in report["servers"].items():
        for lv in server["levels"]:
            refused = lv["by_status"].get("503")
            lines.append(" | ".join([
                f"| {name}", str(lv["concurrency"]), f"{lv['requests']:,}", f"{lv['req_per_s']:,.0f}",
                fmt(ratios.get(lv["concurrency"]), ".2f", "x") if name == "batched" else "",
                " / ".join(fmt(lv[k]) for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms")), f"{lv['errors']:,}",
                f"{refused['count']:,} ({refused['p99_ms']:.1f})" if refused else "0",
                fmt(lv["batches"]["mean_size"], ".2f"),
                f"{lv['client_cpu_ms_per_request']:.3f} / {fmt(lv['server_cpu_ms_per_request'], '.3f')}",
                fmt(lv["rss_mib"], ".0f") + " |"]))
    lines.append("")
    if ratios:
        lines.append(f"- vs unbatched: {SAME_ANSWERS}")
    if alone := report.get("model_alone"):
        lines.append(f"- the model alone in the same run ({alone['backend']} on {alone.get('device', 'cpu')}, traced, "
                     f"{alone['threads']} thread(s)): "
                     + ", ".join(f"{alone[f'batch_{size}_images_per_s']:,.0f} img/s at batch {size}"
                                 for size in (1, 32, 64)))
    if started := {name: s for name, s in report["servers"].items() if "start_s" in s}:
        lines.append("- start (launch to ready), RSS then, peak RSS, exit code on SIGTERM: " + "; ".join(
            f"{name} {s['start_s']:.2f} s, {s['ready_memory']['rss_mib']:.0f} MiB, "
            f"{fmt(s.get('final_memory', {}).get('peak_rss_mib'), '.0f')} MiB, {s['exit_code']}"
            for name, s in started.items()))
    if s := report["servers"].get("batched", {}).get("soak"):
        rss = s["rss_mib"]
        lines.append(f"- soak: {s['requests']:,} requests at concurrency {s['concurrency']} in {s['seconds']:.0f} s "
                     f"({s['req_per_s']:,.0f} req/s), {s['errors']} errors, worst {SOAK_CHUNK_S} s run's p99 "
                     f"{fmt(s['worst_chunk_p99_ms'])} ms, RSS {rss['start']:.0f} -> {rss['end']:.0f} MiB "
                     f"({rss['growth_pct']:+.1f}%, max {rss['max']:.0f})")
    for name, goal in summary.get("goals", {}).items():
        missed = [k.removesuffix("_met") for k, v in goal.items() if k.endswith("_met") and not v]
        lines.append(f"- goal {name}: {'met' if goal['met'] else 'missed: ' + ', '.join(missed)}")
    return "\n".join(lines).rstrip()


def prepare_image() -> tuple[bytes, dict]:
    """The body of every request: the image box-reduced to 32 x 32, as cifarkit's preprocessing reduces it, PNG."""
    from PIL import Image
    with Image.open(io.BytesIO((files("cifarkit") / IMAGE).read_bytes())) as im:
        source = {"source": f"cifarkit/{IMAGE}", "source_format": im.format, "source_size": list(im.size)}
        buffer = io.BytesIO()
        im.convert("RGB").resize((32, 32), Image.Resampling.BOX).save(buffer, "PNG")
    raw = buffer.getvalue()
    return raw, {**source, "sent": "32 x 32 PNG", "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def model_alone(model: str, backend: str, threads: int | None, device: str = "auto") -> dict:
    """img/s of the served model's forward pass alone, in this process, as the batched server ran it (traced, on its
    device and its model thread's count, `threads`; torch's default where the server did not say), at the batch
    sizes it runs: this machine's speed at the time of the run, the ceiling the server's req/s is to be read
    against."""
    import torch

    from cifarkit.core.device import configure, pick_device
    from cifarkit.inference.classifier import Classifier
    if threads:
        torch.set_num_threads(threads)
    configure(pick_device(device))  # cuDNN's autotuner on a GPU, as the server sets it (serving.pipeline)
    classifier = Classifier.load(model, backend=backend, device=device, traced=True)
    figures = {"backend": classifier.backend, "device": str(classifier.device), "traced": classifier.traced,
               "threads": torch.get_num_threads()}
    for size in (1, 32, 64):
        pixels = np.zeros((size, 32, 32, 3), np.uint8)
        classifier.logits(pixels)
        times, until = [], time.perf_counter() + 1.0  # a second of passes per size: one pass is a noisy figure
        while time.perf_counter() < until or len(times) < 5:
            started = time.perf_counter()
            classifier.logits(pixels)
            times.append(time.perf_counter() - started)
        figures[f"batch_{size}_images_per_s"] = round(size / float(np.median(times)), 1)
    return figures


def context(command: str, model: str, settings: BenchSettings, image: dict, load_before) -> dict:
    """What every report opens with: how it was made, where, when, from which code, and what every request sent."""
    from importlib.metadata import distributions

    from cifarkit.core.device import report as environment
    from cifarkit.training.tracking import stamp
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
    return {
        "command": command, **stamp(),
        "environment": {**environment(), "cpu_count": os.cpu_count(), "load_average_before": [
            round(x, 2) for x in load_before], "versions": {name: installed.get(name) for name in VERSIONS}},
        "client": {"tool": f"Python asyncio{' on uvloop' if run_loop is not asyncio.run else ''}, HTTP/1.1 keep-alive",
                   "latency": "from just before a request's write to the last byte of its answer",
                   "cpu": "getrusage(RUSAGE_SELF): the client, and in the soak its RSS sampler thread"},
        "model": model, "image": image, "requests_per_level": settings.requests,
        "warmup": {"requests": settings.warmup, "concurrency": WARMUP_CONCURRENCY},
    }


def run(settings: BenchSettings, command: str) -> dict:
    """Batched, unbatched and overload servers started here one after the other, the model alone, and the goals."""
    model = settings.model or DEFAULT_MODEL
    common = ["--model", model, "--backend", settings.backend, *shlex.split(settings.serve_args)]
    load_before = os.getloadavg()
    body, image = prepare_image()
    batched = common + ["--max-batch", str(settings.max_batch)]
    levels = settings.concurrency
    servers = {"batched": run_server("batched", batched, levels, settings, model, body, soak_s=settings.soak_s),
               "unbatched": run_server("unbatched", common + ["--max-batch", "1"], levels, settings, model, body)}
    if settings.overload_queue:
        servers["overload"] = run_server("overload", batched + ["--max-queue", str(settings.overload_queue)],
                                         [OVERLOAD_CONCURRENCY], settings, model, body, after_check=True)
    first = servers["batched"]
    report = context(command, model, settings, image, load_before)
    served_as = first.get("served", {})
    report["model_alone"] = model_alone(model, served_as.get("backend") or settings.backend, first["model_threads"],
                                        served_as.get("device") or "auto")
    report["servers"] = servers
    report["summary"] = summarize(servers)
    return report


def run_against(url: str, settings: BenchSettings, command: str) -> dict:
    """The warm-up and the load levels against the server at `url`, which runs already: no server is started."""
    server = Endpoint(url)
    status, answer = server.get("/v1/models")
    if status == 0:
        raise CifarkitError(f"nothing answers at {server.url} ({answer.decode()}); start a server with `cifarkit "
                            f"serve`, and give --url the address its ready line prints")
    if status != 200:
        raise CifarkitError(f"{server.url}/v1/models answered {status} ({answer.decode(errors='replace')[:200]}); "
                            f"give --url the address of a `cifarkit serve` that needs no API key")
    described = json.loads(answer)
    names = [m["name"] for m in described["models"]]
    model = settings.model or described["default"]
    if model not in names:
        raise CifarkitError(f"the server at {server.url} serves {', '.join(names)}, not {model}; give --model one of "
                            f"them")
    load_before = os.getloadavg()
    body, image = prepare_image()
    record = {"url": server.url, **exercise("running", server, model, body, settings, settings.concurrency)}
    return {**context(command, model, settings, image, load_before), "servers": {"running": record}}
