"""`cifarkit serve`: releases behind an HTTP API (FastAPI on uvicorn), with dynamic batching, Prometheus metrics and a
page to try them on.

    cifarkit serve --model B          # the page at http://127.0.0.1:8000, the API's OpenAPI at /docs
    curl -F file=@cat.png 'http://127.0.0.1:8000/v1/predict?model=B&topk=3'
    curl --data-binary @cat.png -H 'Content-Type: image/png' http://127.0.0.1:8000/v1/predict

One image's path: the event loop reads the body (refused past `max_body_mb`, from its Content-Length when it has
one, before a byte of it is read) and queues it; a decode thread turns it into 32 x 32 pixels, and a model thread
runs it in a batch (`Pipeline`). A full queue is refused at once (503, Retry-After), and an image not answered
within `timeout_s` gets 504. Every error is a JSON body, {"detail": "..."}, that names the problem.

This module is the inference side alone: it imports no training code (engine, optim, the data set and its loaders,
TensorBoard, matplotlib). tests/test_serve.py checks that in a running server.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools' protocol where installed, else h11's

from cifarkit.artifacts import preprocess
from cifarkit.artifacts.releases import release_dir
from cifarkit.core.constants import VERSION
from cifarkit.core.errors import CifarkitError
from cifarkit.inference import backends
from cifarkit.inference.classifier import Classifier, prediction

log = logging.getLogger(__name__)

WEB = resources.files("cifarkit.serving") / "web"
API_KEY_ENV = "CIFARKIT_API_KEY"
LOOPBACK = "127.0.0.1"
RAW_TYPES = ("image/", "application/octet-stream")  # a raw body of these types is one image file
PREDICT = "/v1/predict"


@dataclass(frozen=True)
class ServeSettings:
    """Every serving default, in one place; `cifarkit serve --help` names the option of each."""
    # Images per forward pass. Past 64 a bigger batch stopped buying images/s on a CPU, and it lengthens the wait of
    # the batch's first image. The reasons behind these defaults, with their figures: docs/serving.md.
    max_batch: int = 64
    # The most a batch waits for more images after its oldest arrived; it waits only while admitted images are
    # still being decoded, so an idle server answers a lone request without this delay.
    max_wait_ms: float = 5.0
    # Images queued per model before new ones are refused with 503: about half a second of work on 2 CPU cores, so
    # a client is told to come back instead of waiting for seconds.
    max_queue: int = 512
    # A request not answered in this time gets 504 (its images are dropped from the queue if still there).
    timeout_s: float = 10.0
    # A connection is closed when no whole request (headers and body) has come this long after it opened or after
    # its last answer: idle and slow clients do not keep sockets and file descriptors. uvicorn's own keep-alive
    # timeout (5 s) cannot do it: any byte received disarms it, and it is armed only after an answer.
    read_timeout_s: float = 10.0
    max_body_mb: float = 10.0  # a larger request body is refused (413) before it is read
    max_images: int = 64  # images in one multipart request
    # torch's intra-op threads; None: torch's own (one per core) but one, the core left to the event loop and the
    # decode thread: a full team of threads stalls whenever the loop takes one of their cores.
    threads: int | None = None
    backend: str = "auto"
    verify: bool = True
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None, repr=False)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    def model_threads(self) -> int:
        return self.threads or max(1, torch.get_num_threads() - 1)


class _Refused(Exception):
    """An image or request that gets an error answer: the HTTP status, and the one-line reason."""

    def __init__(self, status: int, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers

    def answer(self) -> JSONResponse:
        return JSONResponse({"detail": self.detail}, self.status, self.headers)


@dataclass
class Served:
    """One loaded release: its name in the API, the classifier, and what /v1/models tells about it."""
    name: str
    classifier: Classifier
    source: str

    def infer(self, pixels: np.ndarray) -> np.ndarray:
        """N x 32 x 32 x 3 uint8 -> N x 10 class probabilities."""
        return self.classifier.logits(pixels).softmax(1).numpy()

    def describe(self) -> dict:
        info = self.classifier.info
        speedrun = info.get("speedrun") or {}
        inference = info.get("inference") or {}
        choice = self.classifier.backend_choice
        # Only speeds measured on a CPU of this machine's kind: another kind's img/s would mislead.
        table = backends.speed_tables(inference).get(choice.cpu_kind, [])
        throughput = {f"batch_{row['batch_size']}": round(row["images_per_s"], 1)
                      for row in table if row["backend"] == self.classifier.backend}
        return {
            "name": self.name, "source": self.source, "model": info.get("model"), "recipe": info.get("recipe"),
            "backend": self.classifier.backend, "backend_reason": choice.reason, "cpu_kind": choice.cpu_kind,
            "weights_sha256": self.classifier.weights_sha256,
            "params": info.get("params"), "macs": info.get("macs"),
            "test_accuracy": info.get("test_acc"), "test_images": info.get("test_images"),
            "test_accuracy_evaluation": info.get("test_acc_evaluation"),
            # Run-to-run figures: the recipe trained n times with different seeds (with its TTA).
            "runs": {"n": speedrun.get("n"), "mean": speedrun.get("mean"), "std": speedrun.get("std"),
                     "wall_time_s_mean": speedrun.get("wall_time_s_mean"),
                     "evaluation": speedrun.get("evaluation")} if speedrun else None,
            "images_per_s": throughput or None,
            "created": info.get("created"),
        }


def load_models(names: list[str], settings: ServeSettings) -> dict[str, Served]:
    """Each named release (a version name or a path, as every command takes it), loaded and verified."""
    served: dict[str, Served] = {}
    for text in names:
        path = release_dir(text)
        given_path = Path(text).exists()  # else a version name, which names the model as it is
        name = path.resolve().name.removeprefix("version_") if given_path else text
        if name.endswith(".safetensors"):
            name = Path(name).stem
        if name in served:
            raise CifarkitError(f"two models are named {name!r} ({served[name].source} and {text}); serve each "
                                f"name once")
        # Traced: a forward pass then holds the GIL only to start and to end, not between its layers, so the event
        # loop and the decode thread no longer slow it down (see Classifier).
        classifier = Classifier.load(path, backend=settings.backend, verify=settings.verify, traced=True)
        served[name] = Served(name, classifier, path.name if given_path else text)
    return served


class Metrics:
    """The Prometheus series: a registry of its own, so several apps (tests) can live in one process."""

    def __init__(self, max_batch: int):
        self.registry = CollectorRegistry()
        self.requests = Counter("cifarkit_http_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("cifarkit_http_request_duration_seconds", "Time to answer a request, by endpoint",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]
        self.batch_size = Histogram("cifarkit_batch_size", "Images per forward pass, by model", ["model"],
                                    registry=self.registry, buckets=sizes)
        self.images = Counter("cifarkit_images", "Images answered, by model and outcome", ["model", "outcome"],
                              registry=self.registry)
        self.queue_depth = Gauge("cifarkit_queue_depth", "Images waiting for a forward pass, by model", ["model"],
                                 registry=self.registry)
        self.disconnects = Counter("cifarkit_client_disconnects", "Requests whose client hung up, or was timed out, "
                                   "before its whole body had come", registry=self.registry)


@dataclass(eq=False)
class _Job:
    """One uploaded image on its way through the pipeline."""
    model: str
    data: bytes
    name: str  # what errors call it: its filename, or "the request body"
    future: asyncio.Future  # resolved on the event loop with (probabilities, ranking), or the _Refused it got
    arrived: float
    pixels: np.ndarray | None = None  # 32 x 32 x 3 uint8, once decoded


class Pipeline:
    """Two worker threads in a row, shared by all models: one decodes uploads, one runs a model on batches of them.

    The event loop only queues jobs and resolves futures: the image work never runs on it. Each thread takes what
    waits for it in one go and hands results back to the loop once per batch, so the cost of crossing threads (a
    wake-up, the GIL changing hands) is paid per batch, not per image. The model thread takes the model whose oldest
    decoded image has waited longest, up to max_batch images of it; it waits for more only while admitted images
    are still being decoded, and never past max_wait_ms after its oldest image arrived. One model thread: forward
    passes take the cores in turn instead of fighting over them. One decode thread: a 32 x 32 PNG decodes in about
    0.1 ms, and preprocess guards Pillow's warnings with warnings.catch_warnings, which is not thread-safe.
    """

    def __init__(self, models: dict[str, Served], settings: ServeSettings, metrics: Metrics):
        self.models, self.settings, self.metrics = models, settings, metrics
        self.loop = asyncio.get_running_loop()
        self.waiting = dict.fromkeys(models, 0)  # admitted, not yet answered; touched on the loop only
        self._lock = threading.Condition()
        self._undecoded: deque[_Job] = deque()
        self._decoding = 0
        self._decoded: dict[str, deque[_Job]] = {name: deque() for name in models}
        self._stopping = False
        self.warm = threading.Event()  # set once the model thread has run every model
        # Batches are padded to these sizes. oneDNN keeps kernels and buffers for every batch shape it has run, about
        # 2.5 MB each for version B: 64 shapes grew a server's RSS by 160 MB over its first minutes of load. A few
        # shapes, all run in the warm-up, keep RSS flat from the start, at the cost of at most 7 padded images.
        self.shapes = sorted({size for size in (1, 2, 4, *range(8, settings.max_batch + 1, 8))
                              if size < settings.max_batch} | {settings.max_batch})
        for name in models:
            metrics.queue_depth.labels(name).set_function(lambda name=name: self.waiting[name])
        self._threads = [threading.Thread(target=self._decode_loop, name="cifarkit-decode", daemon=True),
                         threading.Thread(target=self._model_loop, name="cifarkit-model", daemon=True)]
        for thread in self._threads:
            thread.start()

    def no_room(self, model: str, count: int) -> _Refused | None:
        """The refusal of `count` more images for `model`, if its queue cannot take them all."""
        if self.waiting.get(model, 0) + count <= self.settings.max_queue:
            return None
        return _Refused(503, f"the queue of model {model} is full ({self.settings.max_queue} images); retry in a "
                             f"moment", {"Retry-After": "1"})

    def submit(self, model: str, files: list[tuple[str, bytes]]) -> list[asyncio.Future]:
        """Queue a request's images, all or none: a queue without room for them all refuses the request."""
        if refused := self.no_room(model, len(files)):
            raise refused
        now = time.perf_counter()
        jobs = [_Job(model, data, name, self.loop.create_future(), now) for name, data in files]
        self.waiting[model] += len(jobs)
        with self._lock:
            self._undecoded.extend(jobs)
            self._lock.notify_all()
        return [job.future for job in jobs]

    def stop(self) -> None:
        """Finish what is queued, then end both threads."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()

    def has_room(self) -> bool:
        """Whether every model's queue can take one more image."""
        return all(waiting < self.settings.max_queue for waiting in self.waiting.values())

    def _deliver(self, outcomes: list[tuple[_Job, object]]) -> None:
        """On the loop: resolve the futures of finished jobs (those whose request timed out are gone already)."""
        for job, outcome in outcomes:
            self.waiting[job.model] -= 1
            if job.future.done():
                continue
            job.future.set_result(outcome)

    def _decode_loop(self) -> None:
        while True:
            with self._lock:
                while not self._undecoded and not self._stopping:
                    self._lock.wait()
                if not self._undecoded:
                    return
                jobs = list(self._undecoded)
                self._undecoded.clear()
                self._decoding = len(jobs)
            failed = []  # (job, its refusal; None: its request timed out, and nobody waits for it)
            for job in jobs:
                refusal = None
                if not job.future.done():
                    try:
                        job.pixels = preprocess.to_uint8(preprocess.from_bytes(job.data, job.name))
                    except ValueError as e:
                        refusal = _Refused(422, str(e))
                with self._lock:  # each image goes on at once, so the model thread can start while others decode
                    self._decoding -= 1
                    if job.pixels is None:
                        failed.append((job, refusal))
                        decoded = 0
                    else:
                        self._decoded[job.model].append(job)
                        decoded = len(self._decoded[job.model])
                    # Woken only when what it waits for may have changed (a first image, a full batch, the end of
                    # decoding): woken per image, the model thread took the GIL from the others once per image.
                    if decoded in (1, self.settings.max_batch) or not self._decoding:
                        self._lock.notify_all()
            if failed:
                self.loop.call_soon_threadsafe(self._deliver, failed)

    def _next_batch(self) -> tuple[str, list[_Job]] | None:
        """Under the lock: wait until a batch should run, and take it (None: stopping, and nothing is left)."""
        max_batch, max_wait = self.settings.max_batch, self.settings.max_wait_ms / 1000
        while True:
            ready = [(queue[0].arrived, name) for name, queue in self._decoded.items() if queue]
            if not ready:
                if self._stopping and not self._undecoded and not self._decoding:
                    return None
                self._lock.wait()
                continue
            _, name = min(ready)
            queue = self._decoded[name]
            wait = queue[0].arrived + max_wait - time.perf_counter()
            coming = self._undecoded or self._decoding
            if len(queue) >= max_batch or wait <= 0 or not coming:
                return name, [queue.popleft() for _ in range(min(max_batch, len(queue)))]
            self._lock.wait(wait)

    def _shape(self, count: int) -> int:
        return next(size for size in self.shapes if size >= count)

    def _model_loop(self) -> None:
        # Here: OpenMP keeps the setting per calling thread.
        torch.set_num_threads(self.settings.model_threads())
        # Warm up on this thread, the one that will run the models: OpenMP starts its thread team, and oneDNN builds
        # and caches its kernels, on a thread's first forward pass of each shape.
        for served in self.models.values():
            for size in self.shapes:
                served.infer(np.zeros((size, preprocess.SIZE, preprocess.SIZE, 3), np.uint8))
        self.warm.set()
        while True:
            with self._lock:
                taken = self._next_batch()
            if taken is None:
                return
            name, jobs = taken
            live = [job for job in jobs if not job.future.done()]
            outcomes: list[tuple[_Job, object]] = [(job, None) for job in jobs if job.future.done()]
            if live:
                self.metrics.batch_size.labels(name).observe(len(live))
                try:
                    pixels = np.zeros((self._shape(len(live)), preprocess.SIZE, preprocess.SIZE, 3), np.uint8)
                    pixels[:len(live)] = [job.pixels for job in live]
                    probabilities = self.models[name].infer(pixels)[:len(live)]  # without the padding's rows
                    # Ranked here, and as plain lists: the event loop, which all requests share, only reads them.
                    ranked = np.argsort(-probabilities, axis=1, kind="stable")
                    outcomes += zip(live, zip(probabilities.tolist(), ranked.tolist()))
                except Exception as e:  # a failed forward pass fails its batch, never the server
                    log.exception("model %s failed on a batch of %d", name, len(live))
                    outcomes += [(job, _Refused(500, f"model {name} failed: {e}")) for job in live]
            self.loop.call_soon_threadsafe(self._deliver, outcomes)


def _topk(text: str | None) -> int:
    if text is None:
        return 5
    if not text.isdigit() or not 1 <= int(text) <= 10:
        raise _Refused(422, f"topk must be a whole number from 1 to 10, got {text!r}")
    return int(text)


def _answer(position: int, scores: tuple[list[float], list[int]], classes, topk: int, filename: str | None) -> dict:
    """One image's answer (inference.prediction) from its class probabilities and their ranking, best first, with
    its position in the request."""
    probabilities, ranked = scores
    answer = {"position": position, **prediction(probabilities, ranked, classes, topk)}
    if filename is not None:
        answer["filename"] = filename
    return answer


def _endpoint(path: str) -> str:
    """The metrics label of a path: the API's routes by name, everything else as one (bounded cardinality)."""
    if path in (PREDICT, "/v1/models", "/healthz", "/readyz", "/metrics", "/"):
        return path
    return "static" if path.startswith("/static/") else "other"


class Gate:
    """ASGI middleware in front of every route: the API key on /v1, the body limit, and the request metrics."""

    def __init__(self, app, settings: ServeSettings, metrics: Metrics, shed, predict):
        """`shed(scope)`: the refusal of a request that cannot be served now, decided from its head alone.
        `predict`: the ASGI app of /v1/predict, called from here, past FastAPI's exception middleware and router:
        in a profile under load, they took a third of the time spent from here to the answer."""
        self.app, self.settings, self.metrics, self.shed, self.predict = app, settings, metrics, shed, predict

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, endpoint, status = time.perf_counter(), _endpoint(scope["path"]), [500]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refused = self._check(scope)
            if refused is not None:
                await refused.answer()(scope, receive, send_and_record)
                return
            app = self.predict if scope["path"] == PREDICT else self.app
            await app(scope, self._limited(receive), send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    def _check(self, scope) -> _Refused | None:
        headers = dict(scope["headers"])
        key = self.settings.api_key
        if key and scope["path"].startswith("/v1/"):
            given = headers.get(b"x-api-key", b"")
            bearer = headers.get(b"authorization", b"")
            if bearer[:7].lower() == b"bearer ":
                given = bearer[7:].strip()
            if not hmac.compare_digest(given, key.encode()):
                return _Refused(401, f"missing or wrong API key; send the server's {API_KEY_ENV} as "
                                     f"`Authorization: Bearer KEY` or `X-API-Key: KEY`",
                                {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_body_bytes:
            return self._too_large(int(length))
        return self.shed(scope)

    def _too_large(self, size: int | None) -> _Refused:
        got = f"{size:,} bytes" if size is not None else "more"
        return _Refused(413, f"the request body is {got}, over the limit of {self.settings.max_body_bytes:,} "
                             f"bytes; send smaller images (the model sees 32 x 32) or raise `cifarkit serve "
                             f"--max-body-mb`", {"Connection": "close"})

    def _limited(self, receive):
        """`receive` that stops a body without Content-Length (chunked) at the limit, reading no further."""
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.settings.max_body_bytes:
                refused = self._too_large(None)
                raise HTTPException(refused.status, refused.detail, refused.headers)
            return message

        return limited


def create_app(models: dict[str, Served], settings: ServeSettings | None = None) -> FastAPI:
    """The ASGI app serving `models` (name -> Served), loaded already; warmed when its lifespan starts."""
    settings = settings or ServeSettings()
    if not models:
        raise CifarkitError("no model to serve; give one or more with --model")
    metrics = Metrics(settings.max_batch)
    state: dict = {"ready": False, "pipeline": None}
    default_model = next(iter(models))

    @asynccontextmanager
    async def lifespan(app):
        started = time.perf_counter()
        state["pipeline"] = Pipeline(models, settings, metrics)
        await asyncio.to_thread(state["pipeline"].warm.wait)
        # torch, FastAPI and the models are some 250,000 objects that live as long as the process: without this, each
        # full collection walks them all, a pause long enough to show in the p99 latency under load.
        gc.collect()
        gc.freeze()
        log.info("models %s loaded and warm in %.2f s", ", ".join(models), time.perf_counter() - started)
        state["ready"] = True
        try:
            yield
        finally:
            state["ready"] = False
            state["pipeline"].stop()

    app = FastAPI(title="cifarkit", version=VERSION, lifespan=lifespan,
                  description="CIFAR-10 classifiers released by cifarkit. Errors are JSON: {\"detail\": \"...\"}.")

    def shed(scope) -> _Refused | None:
        """A prediction for a model whose queue is full already is refused at the door, before its body is read
        and before FastAPI sees it: under overload a 503 then costs a fraction of what an answer costs."""
        pipeline = state["pipeline"]
        if scope["path"] != PREDICT or pipeline is None or pipeline.has_room():
            return None
        name = parse_qs(scope["query_string"].decode("latin-1")).get("model", [default_model])[0]
        return pipeline.no_room(name, 1)

    for exception in (HTTPException, _Refused, Exception):
        app.add_exception_handler(exception, _error_answer)

    async def predict(request: Request) -> Response:
        return await _predict(request, models, settings, state["pipeline"], metrics, default_model)

    app.add_middleware(Gate, settings=settings, metrics=metrics, shed=shed, predict=_asgi_predict(predict, metrics))

    # Its query is read by hand: FastAPI's request handler (dependency solving, parameter validation) took a quarter
    # of the event loop's time per prediction under load. openapi() documents it.
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema["paths"][PREDICT] = {"post": {
                "summary": "Classify one or several images", "operationId": "predict", **_PREDICT_DOC,
                "responses": {str(status): response for status, response in _PREDICT_RESPONSES.items()}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/v1/models", summary="The loaded releases and their measured figures")
    async def list_models():
        return {"default": default_model, "models": [served.describe() for served in models.values()],
                "batching": {"max_batch": settings.max_batch, "max_wait_ms": settings.max_wait_ms,
                             "max_queue": settings.max_queue}}

    @app.get("/healthz", summary="Alive: the process answers")
    async def healthz():
        return {"alive": True}

    @app.get("/readyz", summary="Ready: every model is loaded and warm")
    async def readyz():
        body = {"ready": state["ready"], "models": list(models) if state["ready"] else []}
        return JSONResponse(body, 200 if state["ready"] else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(Path(str(WEB)) / "index.html", headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=str(WEB)), name="static")
    return app


def _asgi_predict(predict, metrics: Metrics):
    """The prediction route as a bare ASGI app (the gate calls it without FastAPI's routing): POST only; a client that
    leaves mid-request is a log line and a count, any other failure a JSON answer."""
    async def predict_app(scope, receive, send):
        request = Request(scope, receive)
        try:
            if request.method != "POST":
                raise _Refused(405, f"{PREDICT} takes POST", {"Allow": "POST"})
            response = await predict(request)
        except ClientDisconnect:  # nobody is left to answer: a line, a count, and no traceback
            client = f"{scope['client'][0]}:{scope['client'][1]}" if scope.get("client") else "a client"
            log.info("%s left before sending its whole request; nothing was answered", client)
            metrics.disconnects.inc()
            return
        except Exception as e:
            response = await _error_answer(request, e)
        await response(scope, receive, send)

    return predict_app


async def _predict(request: Request, models: dict[str, Served], settings: ServeSettings, pipeline: Pipeline,
                   metrics: Metrics, default_model: str) -> Response:
    """POST /v1/predict: the images of a request, classified by the model it names, each answered or refused."""
    name = request.query_params.get("model") or default_model
    topk = _topk(request.query_params.get("topk"))
    if name not in models:
        raise _Refused(404, f"no model named {name!r} is loaded; loaded: {', '.join(models)}")
    files, named = await _read_images(request, settings)
    futures = pipeline.submit(name, files)
    try:
        async with asyncio.timeout(settings.timeout_s):
            outcomes = [await future for future in futures]
    except TimeoutError:
        for future in futures:
            future.cancel()  # the pipeline drops what it has not started
        raise _Refused(504, f"no answer within {settings.timeout_s:g} s: the server is overloaded; retry later, "
                            f"or raise `cifarkit serve --timeout-s`") from None
    classes = models[name].classifier.classes
    answers = []
    for position, ((filename, _), outcome) in enumerate(zip(files, outcomes)):
        if isinstance(outcome, _Refused):
            answers.append({"position": position, "filename": filename,
                            "error": {"status": outcome.status, "detail": outcome.detail}})
        else:
            answers.append(_answer(position, outcome, classes, topk, filename if named else None))
    failed = sum("error" in answer for answer in answers)
    metrics.images.labels(name, "ok").inc(len(answers) - failed)
    metrics.images.labels(name, "refused").inc(failed)
    if len(files) == 1 and failed:
        raise outcomes[0]  # one image: its error is the request's
    return JSONResponse({"model": name, "weights_sha256": models[name].classifier.weights_sha256,
                         "predictions": answers})


async def _error_answer(request: Request, exc: Exception) -> JSONResponse:
    """The JSON answer of an exception, for every route: {"detail": "..."} with its status and headers."""
    if isinstance(exc, _Refused):
        return exc.answer()
    if isinstance(exc, HTTPException):
        return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)  # a bug of ours: the traceback too
    return JSONResponse({"detail": f"internal error ({type(exc).__name__}); see the server's log"}, 500)


async def _read_images(request: Request, settings: ServeSettings) -> tuple[list[tuple[str, bytes]], bool]:
    """(name, bytes) of each image in the request, and whether the names are the client's own filenames: multipart
    files, or one raw body of an image type."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        try:
            form = await request.form(max_files=settings.max_images, max_fields=settings.max_images)
        except HTTPException as e:
            if e.status_code == 413:
                raise
            raise _Refused(422, f"the multipart body is malformed or holds too many parts ({e.detail}); send at "
                                f"most {settings.max_images} images") from None
        uploads = [value for _, value in form.multi_items() if hasattr(value, "read")]
        if not uploads:
            raise _Refused(422, "the form holds no file; send images as multipart files, e.g. "
                                "`curl -F file=@cat.png URL`")
        return [(upload.filename or f"file {i + 1}", await upload.read()) for i, upload in enumerate(uploads)], True
    if kind.startswith(RAW_TYPES):
        return [("the request body", await request.body())], False
    raise _Refused(415, f"unsupported media type {kind or '(none)'!r}; send one image as the body with an image/* "
                        f"Content-Type, or images as multipart/form-data files")


# The page's own scripts and styles only: nothing inline, nothing from elsewhere.
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:"}

_PREDICT_DOC = {"parameters": [
    {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "a loaded model's name (GET /v1/models); default: the first one given to --model"},
    {"name": "topk", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 10,
                                                                  "default": 5},
     "description": "classes to return per image, best first"}],
    "requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"}}}}}
_ERROR = {"content": {"application/json": {"example": {"detail": "what went wrong, and what to do"}}}}
_PREDICT_RESPONSES = {
    200: {"description": "One entry per image, in order, `position` its place in the request (from 0); the class "
                         "is `label` and `class_index` (0-9), as in `cifarkit predict --json` and "
                         "`Classifier.prediction`; in a multipart request, a bad image has an `error` entry instead "
                         "of a label", "content": {"application/json": {"example": {
                             "model": "B", "weights_sha256": "...", "predictions": [{
                                 "position": 0, "label": "cat", "class_index": 3, "confidence": 0.93,
                                 "topk": [{"label": "cat", "class_index": 3, "confidence": 0.93}]}]}}}},
    401: {"description": "CIFARKIT_API_KEY is set and the request lacks it", **_ERROR},
    404: {"description": "no such model is loaded", **_ERROR},
    413: {"description": "the body is over --max-body-mb", **_ERROR},
    415: {"description": "neither an image/* body nor multipart/form-data", **_ERROR},
    422: {"description": "not an image, a broken image, an image over the pixel limit, or a bad parameter",
          **_ERROR},
    503: {"description": "the model's queue is full; retry after Retry-After seconds", **_ERROR},
    504: {"description": "not answered within --timeout-s", **_ERROR},
}


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CifarkitError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port, or stop what "
                            f"uses it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _with_read_deadline(protocol: type, seconds: float) -> type:
    """uvicorn's HTTP protocol class `protocol`, which closes its connection when no whole request (headers and
    body) has arrived `seconds` after the connection opened or after its last answer. A closed connection in the
    middle of a body reaches the app as a client disconnect."""

    class ReadDeadline(protocol):
        deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._disarm()  # the whole request is in: from here on it is the server's time, not the client's

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return ReadDeadline


def serve(names: list[str], host: str = LOOPBACK, port: int = 8000, settings: ServeSettings | None = None,
          access_log: bool = False) -> None:
    """Load and verify the models, bind, warm them, say where it is ready, and serve until SIGTERM or Ctrl-C, which
    finish the requests in flight first."""
    started = time.perf_counter()
    settings = settings or ServeSettings()
    models = load_models(names, settings)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if not bound_host.startswith("127.") and bound_host != "::1":
        log.warning("listening on %s: other machines can reach this server%s", host,
                    "" if settings.api_key else f"; set {API_KEY_ENV} to require a key")
    config = uvicorn.Config(create_app(models, settings), log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=int(settings.timeout_s) + 1, lifespan="on",
                            http=_with_read_deadline(AutoHTTPProtocol, settings.read_timeout_s),
                            proxy_headers=False)  # no proxy in front by default: X-Forwarded-* are not trusted
    server = uvicorn.Server(config)

    stopped_by = []

    def stop(signum, frame):
        # uvicorn catches the signal first and shuts down gracefully; after that it raises the signal again, here
        stopped_by.append(signal.Signals(signum).name)

    async def run():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            # Tests and scripts wait for this line; it names the real port when --port was 0.
            print(f"cifarkit serve: ready at http://{shown}:{bound_port} with {', '.join(models)} "
                  f"({time.perf_counter() - started:.2f} s after the command started)", flush=True)
        await serving

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:  # uvloop where it is installed
        runner.run(run())
    if not server.started:
        raise CifarkitError("the server did not start; see the messages above")
    print(f"cifarkit serve: stopped{' by ' + stopped_by[0] if stopped_by else ''}, after answering the requests "
          f"in flight", flush=True)
