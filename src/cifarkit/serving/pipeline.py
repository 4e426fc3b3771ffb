"""The loaded releases, the Prometheus series, and the two worker threads that decode uploads and run batches."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cifarkit.artifacts import preprocess
from cifarkit.artifacts.releases import release_dir
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.inference import backends
from cifarkit.inference.classifier import Classifier
from cifarkit.serving.settings import Refused, ServeSettings

log = logging.getLogger(__name__)


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
        # Only speeds measured on a device of this machine's kind: another kind's img/s would mislead.
        table = backends.speed_tables(inference).get(choice.cpu_kind, [])
        throughput = {f"batch_{row['batch_size']}": round(row["images_per_s"], 1)
                      for row in table if row["backend"] == self.classifier.backend}
        return {
            "name": self.name, "source": self.source, "model": info.get("model"), "recipe": info.get("recipe"),
            "device": str(self.classifier.device), "backend": self.classifier.backend,
            "backend_reason": choice.reason, "cpu_kind": choice.cpu_kind, "onnx_provider": self.classifier.provider,
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
    """Each named release (a version name or a path, as every command takes it), loaded and verified, on
    `settings.device`."""
    served: dict[str, Served] = {}
    # cuDNN times its algorithms for each batch shape on first use, which the warm-up does for every shape the
    # batches are padded to, so no request pays for it. Set before tracing: a traced graph keeps the flag.
    device.configure(device.pick_device(settings.device))
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
        with torch_threads(settings.model_threads()):
            classifier = Classifier.load(path, backend=settings.backend, device=settings.device,
                                         verify=settings.verify, traced=True)
        served[name] = Served(name, classifier, path.name if given_path else text)
    return served


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op threads on this thread set to `count` for the block: an onnxruntime session takes its
    thread count from torch's when it is made (runtime.onnx_session), and it must take the model thread's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    future: asyncio.Future  # resolved on the event loop with (probabilities, ranking), or the Refused it got
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
        # shapes, all run in the warm-up, keep RSS flat from the start, at the cost of at most 7 padded images. On a
        # GPU they are the shapes cuDNN times its algorithms for in the warm-up (load_models).
        self.shapes = sorted({size for size in (1, 2, 4, *range(8, settings.max_batch + 1, 8))
                              if size < settings.max_batch} | {settings.max_batch})
        for name in models:
            metrics.queue_depth.labels(name).set_function(lambda name=name: self.waiting[name])
        self._threads = [threading.Thread(target=self._decode_loop, name="cifarkit-decode", daemon=True),
                         threading.Thread(target=self._model_loop, name="cifarkit-model", daemon=True)]
        for thread in self._threads:
            thread.start()

    def no_room(self, model: str, count: int) -> Refused | None:
        """The refusal of `count` more images for `model`, if its queue cannot take them all."""
        if self.waiting.get(model, 0) + count <= self.settings.max_queue:
            return None
        return Refused(503, f"the queue of model {model} is full ({self.settings.max_queue} images); retry in a "
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
                        refusal = Refused(422, str(e))
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
                    outcomes += [(job, Refused(500, f"model {name} failed: {e}")) for job in live]
            self.loop.call_soon_threadsafe(self._deliver, outcomes)
