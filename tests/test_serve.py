"""`cifarkit serve` as a client meets it: real server processes on loopback, real HTTP, real signals."""
from __future__ import annotations

import io
import json
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import fields
from urllib.parse import urlsplit

import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from cifarkit.cli import options
from cifarkit.cli.serving import SERVE_SETTINGS
from cifarkit.core import device
from cifarkit.inference import backends, runtime
from cifarkit.inference.classifier import Classifier
from cifarkit.serving import pipeline
from cifarkit.serving.settings import SPARE_CORES_BY_CPU_KIND, ServeSettings
from conftest import ROOT
from servers import running_server

pytestmark = pytest.mark.e2e

IMAGES = ROOT / "examples" / "images"
CAT = (IMAGES / "cat.png").read_bytes()
SHIP = (IMAGES / "ship.png").read_bytes()
PNG = {"Content-Type": "image/png"}


def call(url: str, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
    """(status, headers, parsed JSON or text) of one request; error statuses are answers too."""
    request = urllib.request.Request(url + path, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, head, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, e.headers, e.read()
    text = raw.decode()
    is_json = head.get("content-type", "").startswith("application/json")
    return status, head, json.loads(text) if is_json else text


def multipart(*files: tuple[str, bytes, str]) -> tuple[bytes, dict]:
    boundary = uuid.uuid4().hex
    body = b""
    for name, data, kind in files:
        body += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
                 f"Content-Type: {kind}\r\n\r\n").encode() + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    _, _, text = call(url, "/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server():
    with running_server("--model", "B", "A") as running:
        yield running


@pytest.fixture(scope="module")
def expected():
    """What the same releases say in-process, through the Python API."""
    b, a = Classifier.load("B"), Classifier.load("A")
    return {"B": (b.predict_label(IMAGES / "cat.png"), b.weights_sha256, b),
            "A": (a.predict_label(IMAGES / "cat.png"), a.weights_sha256, a)}


def test_predict_raw_body_matches_the_python_api(server, expected):
    status, _, answer = call(server.url, "/v1/predict?topk=3", CAT, PNG)
    assert status == 200, answer
    label, sha, _ = expected["B"]  # B: the first --model is the default
    assert answer["model"] == "B" and answer["weights_sha256"] == sha
    (prediction,) = answer["predictions"]
    assert prediction["position"] == 0 and prediction["label"] == label
    in_process = expected["B"][2].prediction(IMAGES / "cat.png", k=3)  # one schema for HTTP and the Python API
    assert [(t["label"], t["class_index"]) for t in prediction["topk"]] == \
        [(t["label"], t["class_index"]) for t in in_process["topk"]]
    assert prediction["confidence"] == pytest.approx(in_process["confidence"], abs=1e-4)
    assert [t["label"] for t in prediction["topk"]][0] == label and len(prediction["topk"]) == 3
    confidences = [t["confidence"] for t in prediction["topk"]]
    assert confidences == sorted(confidences, reverse=True) and prediction["confidence"] == confidences[0]

    status, _, answer = call(server.url, "/v1/predict?model=A", CAT, PNG)
    assert status == 200 and answer["model"] == "A"
    assert (answer["predictions"][0]["label"], answer["weights_sha256"]) == expected["A"][:2]
    assert len(answer["predictions"][0]["topk"]) == 5  # the default topk


def test_multipart_bad_image_fails_alone(server, expected):
    body, headers = multipart(("cat.png", CAT, "image/png"), ("notes.txt", b"not an image", "text/plain"),
                              ("ship.png", SHIP, "image/png"))
    status, _, answer = call(server.url, "/v1/predict?model=B&topk=1", body, headers)
    assert status == 200, answer
    cat, notes, ship = answer["predictions"]
    assert [cat["position"], notes["position"], ship["position"]] == [0, 1, 2]
    assert cat["label"] == expected["B"][0] and cat["filename"] == "cat.png" and ship["label"] == "ship"
    assert notes["error"]["status"] == 422 and "notes.txt is not an image" in notes["error"]["detail"]
    assert "label" not in notes


def too_many_pixels() -> bytes:
    """A small file whose header claims 9,000 x 8,000 = 72 M pixels, over the 64 Mi-pixel limit."""
    buffer = io.BytesIO()
    Image.new("1", (9000, 8000)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("path, body, headers, status, words", [
    ("/v1/predict", b"hello", {"Content-Type": "text/plain"}, 415, "unsupported media type 'text/plain'"),
    ("/v1/predict", b"", {}, 415, "unsupported media type"),
    ("/v1/predict", b"GIF89a broken", PNG, 422, "the request body is not an image"),
    ("/v1/predict", CAT[:200], PNG, 422, "the request body is a broken image"),
    ("/v1/predict", b"", PNG, 422, "the request body is empty"),
    ("/v1/predict", "too many pixels", PNG, 422, "over the limit of 67,108,864"),
    ("/v1/predict?model=C", CAT, PNG, 404, "no model named 'C' is loaded; loaded: B, A"),
    ("/v1/predict?topk=11", CAT, PNG, 422, "topk"),
    ("/v1/predict?topk=x", CAT, PNG, 422, "topk"),
    ("/v1/predict", *multipart(), 422, "no file"),
    ("/v1/predict", b"--x\r\nbroken", {"Content-Type": "multipart/form-data; boundary=x"}, 422, "multipart"),
    ("/v1/nothing", b"", {}, 404, "Not Found"),
], ids=["text", "no-type", "not-an-image", "broken-image", "empty", "too-many-pixels", "unknown-model", "topk-11",
        "topk-x", "no-file", "broken-multipart", "unknown-path"])  # fixed names: every pytest-xdist worker's the same
def test_errors_are_json_answers(server, path, body, headers, status, words):
    body = too_many_pixels() if body == "too many pixels" else body
    got, head, answer = call(server.url, path, body, headers, method="POST")
    assert got == status, answer
    assert head["content-type"] == "application/json" and words in answer["detail"]
    assert call(server.url, "/healthz")[0] == 200  # and the server is still there


def read_until_closed(sock: socket.socket) -> str:
    """All the server sent before it closed. A server that stops reading closes with unread bytes of ours, and
    the kernel then ends the connection with a reset: after the answer, which has arrived by then."""
    received = b""
    with suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received.decode()


def test_body_over_the_limit_is_refused_before_it_is_read(server):
    """Content-Length over 10 MB: 413 answered from the headers, while the body has not been sent at all."""
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Content-Length: 10485761\r\n\r\n")
        head = read_until_closed(sock)
    assert head.startswith("HTTP/1.1 413") and "over the limit of 10,485,760 bytes" in head

    # Chunked, with no Content-Length: stopped once past the limit. The client sends 1 MiB at a time and looks
    # for the answer in between, as it must: the server reads no further, and closes.
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        while not select.select([sock], [], [], 0.2)[0]:
            assert sent < 20, "no answer after 20 MiB"
            sock.sendall(b"100000\r\n" + b"\0" * 2**20 + b"\r\n")
            sent += 1
        head = read_until_closed(sock)
    assert head.startswith("HTTP/1.1 413") and "over the limit" in head and sent == 11


def test_models_health_docs_and_metrics(server, expected):
    status, _, listing = call(server.url, "/v1/models")
    assert status == 200 and listing["default"] == "B" and [m["name"] for m in listing["models"]] == ["B", "A"]
    for model in listing["models"]:
        assert model["weights_sha256"] == expected[model["name"]][1]
        assert 0.9 < model["test_accuracy"] < 1 and model["test_images"] == 10_000 and model["params"] > 10**6
        assert model["runs"]["n"] >= 2 and model["runs"]["std"] > 0
        # The server's auto backend is the one the Python API picks on this machine, with its reason, and the
        # img/s shown were measured on a CPU of this kind or are not shown.
        choice = expected[model["name"]][2].backend_choice
        assert (model["backend"], model["backend_reason"], model["cpu_kind"]) == (choice.backend, choice.reason,
                                                                                choice.cpu_kind)
        assert model["device"] == str(expected[model["name"]][2].device)  # the same default device: auto
        measured = backends.speed_tables(expected[model["name"]][2].info["inference"]).get(choice.cpu_kind)
        assert (model["images_per_s"] or {}).get("batch_1", 0) > 0 if measured else model["images_per_s"] is None

    assert call(server.url, "/healthz")[:3:2] == (200, {"alive": True})
    assert call(server.url, "/readyz")[:3:2] == (200, {"ready": True, "models": ["B", "A"]})
    status, _, page = call(server.url, "/docs")
    assert status == 200 and "swagger" in page.lower()
    spec = call(server.url, "/openapi.json")[2]
    content = spec["paths"]["/v1/predict"]["post"]["requestBody"]["content"]
    assert set(content) == {"multipart/form-data", "image/*"}

    before = metrics(server.url)
    call(server.url, "/v1/predict", b"hello", {"Content-Type": "text/plain"})
    after = metrics(server.url)
    key = ("cifarkit_http_requests_total", (("endpoint", "/v1/predict"), ("status", "415")))
    assert after[key] == before.get(key, 0) + 1
    names = {name for name, _ in after}
    assert {"cifarkit_http_request_duration_seconds_bucket", "cifarkit_batch_size_bucket",
            "cifarkit_queue_depth"} <= names
    assert after[("cifarkit_queue_depth", (("model", "B"),))] == 0


def test_concurrent_requests_share_forward_passes(server, expected):
    """64 clients at once: every answer right, and fewer forward passes than images."""
    def one(_):
        return call(server.url, "/v1/predict?model=B", CAT, PNG)

    def batches():
        values = metrics(server.url)
        return (values[("cifarkit_batch_size_count", (("model", "B"),))],
                values[("cifarkit_batch_size_sum", (("model", "B"),))])

    count_before, images_before = batches()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, range(256)))
    assert all(status == 200 and a["predictions"][0]["label"] == expected["B"][0] for status, _, a in answers)
    count, images = batches()
    assert images - images_before == 256
    assert count - count_before < 256, "no two requests were ever batched together"


def test_api_key_guards_v1_only():
    with running_server("--model", "B", env={"CIFARKIT_API_KEY": "s3cret"}) as server:
        for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}):
            status, head, answer = call(server.url, "/v1/predict", CAT, {**PNG, **headers})
            assert status == 401 and "API key" in answer["detail"] and head["www-authenticate"] == "Bearer"
        assert call(server.url, "/v1/models")[0] == 401
        for headers in ({"X-API-Key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            assert call(server.url, "/v1/predict", CAT, {**PNG, **headers})[0] == 200
        assert call(server.url, "/healthz")[0] == 200 and call(server.url, "/readyz")[0] == 200


def test_full_queue_and_deadline():
    """A request whose images do not fit in the queue: 503 at once, with Retry-After. A request not answered in
    --timeout-s (1 ms here, less than one forward pass): 504. The server goes on serving after both."""
    with running_server("--model", "B", "--max-queue", "2", "--timeout-s", "0.001") as server:
        body, headers = multipart(*[("cat.png", CAT, "image/png")] * 3)
        started = time.perf_counter()
        status, head, answer = call(server.url, "/v1/predict", body, headers)
        assert status == 503 and head["retry-after"] == "1" and "queue of model B is full" in answer["detail"]
        assert time.perf_counter() - started < 5
        status, _, answer = call(server.url, "/v1/predict", CAT, PNG)
        assert status == 504 and "no answer within 0.001 s" in answer["detail"]
        assert call(server.url, "/healthz")[0] == 200
        values = metrics(server.url)
        for code in ("503", "504"):
            assert values[("cifarkit_http_requests_total", (("endpoint", "/v1/predict"), ("status", code)))] == 1


# Runs the server like `cifarkit serve`, and writes the modules it had loaded when it exits.
WITH_MODULES = """
import atexit, sys
from cifarkit.cli import main
atexit.register(lambda: open(sys.argv[1], "w").write("\\n".join(sorted(sys.modules))))
sys.exit(main(sys.argv[2:]))
"""
TRAINING_SIDE = ("cifarkit.training", "cifarkit.data", "cifarkit.tools", "cifarkit.release", "tensorboard",
                 "torch.utils.tensorboard", "matplotlib", "tqdm")


def test_sigterm_finishes_the_request_in_flight_and_the_server_imports_no_training_code(tmp_path):
    modules = tmp_path / "modules.txt"
    python = [sys.executable, "-c", WITH_MODULES, str(modules)]
    with running_server("--model", "B", python=python) as server:
        call(server.url, "/v1/predict", CAT, PNG)
        host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
        with socket.create_connection((host, port), timeout=30) as sock:
            # Half a request is in flight when SIGTERM comes; the server must wait for the rest and answer it.
            sock.sendall(f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                         f"Content-Length: {len(CAT)}\r\n\r\n".encode() + CAT[:100])
            time.sleep(0.5)
            server.process.send_signal(15)
            time.sleep(1)
            assert server.process.poll() is None, "the server quit with a request in flight"
            with pytest.raises(OSError):  # no new connections meanwhile
                socket.create_connection((host, port), timeout=5).close()
            sock.sendall(CAT[100:])
            response = sock.makefile("rb").read().decode()
        assert response.startswith("HTTP/1.1 200") and '"label":' in response
        assert server.process.wait(30) == 0
        assert "cifarkit serve: stopped by SIGTERM" in server.output

    loaded = set(modules.read_text().split())
    # torch itself imports tqdm (torch.hub does, where tqdm is installed): it counts only if torch alone does not.
    by_torch = set(subprocess.run([sys.executable, "-c", "import sys, torch; print('\\n'.join(sys.modules))"],
                                  capture_output=True, text=True, check=True).stdout.split())
    imported = {m for m in TRAINING_SIDE if any(n == m or n.startswith(m + ".") for n in loaded - by_torch)}
    assert "cifarkit.serving.server" in loaded and "fastapi" in loaded and not imported


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cifarkit", *args], capture_output=True, text=True, timeout=timeout)


def test_bad_model_and_taken_port_are_one_line_errors(server):
    result = run_cli("serve", "--model", "nope", "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cifarkit: error: no weights at nope" in result.stderr and "found: A, B" in result.stderr

    port = urlsplit(server.url).port
    result = run_cli("serve", "--model", "B", "--port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "choose another --port" in result.stderr


def test_help_states_the_settings_defaults():
    helps = {dest: text for command, _, dest, text in options() if command == "cifarkit serve"}
    defaults = {f.name: f.default for f in fields(ServeSettings)}
    for name in SERVE_SETTINGS:
        stated = re.search(r"\(default: ([^)]*)\)", helps[name]).group(1)
        value = defaults[name]
        if value is None:  # threads: a rule rather than a number
            assert stated.startswith("one per core, but one on CPUs with AMX"), name
        else:
            assert stated == (f"{value:g}" if isinstance(value, float) else str(value)), name


@pytest.mark.parametrize("features, model_threads", [
    (["avx2", "avx512", "avx512_bf16", "amx"], 3), (["avx2", "avx512", "avx512_bf16"], 4), (["avx2"], 4)])
def test_the_model_thread_leaves_a_core_only_where_the_cpu_kind_says(monkeypatch, features, model_threads):
    """CPU features faked: with AMX the event loop keeps a core; the kinds measured without it give the model all."""
    monkeypatch.setattr(device, "cpu_features", lambda: features)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert ServeSettings().model_threads() == model_threads
        assert ServeSettings(threads=2).model_threads() == 2  # --threads overrides the kind's rule
    finally:
        torch.set_num_threads(before)
    assert set(SPARE_CORES_BY_CPU_KIND) <= set(backends.CPU_KINDS)


def test_an_onnxruntime_model_runs_on_the_model_thread_s_count_not_the_loader_s(monkeypatch):
    """The session sizes its pool when it is made, on the thread that loads the release: it must take --threads,
    and the loading thread gets its own count back."""
    made = []

    def recording_session(model, device):
        session = make_session(model, device)
        made.append(session.get_session_options().intra_op_num_threads)
        return session

    make_session = runtime.onnx_session
    monkeypatch.setattr(runtime, "onnx_session", recording_session)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        served = pipeline.load_models(["B"], ServeSettings(backend="onnxruntime", threads=1))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert served["B"].classifier.backend == "onnxruntime" and made == [1]


def test_idle_and_slow_clients_are_cut_off_and_one_that_leaves_is_a_line_and_a_count():
    """Connections that send nothing, half a head or half a body are closed after --read-timeout-s; a client gone
    mid-body is one INFO line and one count in /metrics, with no traceback; a normal request is still answered."""
    head = b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
    with running_server("--model", "B", "--read-timeout-s", "1") as server:
        address = urlsplit(server.url)
        clients = {name: socket.create_connection((address.hostname, address.port), timeout=30)
                   for name in ("idle", "half a head", "half a body", "gone mid-body")}
        clients["half a head"].sendall(head[:40])
        clients["half a body"].sendall(head + CAT[:100])
        clients["gone mid-body"].sendall(head + CAT[:100])
        clients.pop("gone mid-body").close()
        start = time.monotonic()
        for name, client in clients.items():
            with client:
                assert client.recv(1) == b"", name  # closed by the server, not answered
        assert time.monotonic() - start < 10
        status, _, answer = call(server.url, "/v1/predict", CAT, PNG)
        assert status == 200 and answer["predictions"][0]["label"] == "cat"
        counted = metrics(server.url)
        assert counted[("cifarkit_client_disconnects_total", ())] == 2
        # The two that left were not answered: no status is counted for them, 500 least of all.
        predict_statuses = {dict(labels)["status"]: value for (name, labels), value in counted.items()
                            if name == "cifarkit_http_requests_total" and dict(labels)["endpoint"] == "/v1/predict"}
        assert predict_statuses == {"200": 1}
        assert server.stop() == 0
    gone = [line for line in server.lines if "left before sending its whole request" in line]
    assert len(gone) == 2 and all(" INFO " in line for line in gone), server.output[-3000:]
    assert "Traceback" not in server.output and " ERROR " not in server.output, server.output[-3000:]
