"""Every serving default in one place (`ServeSettings`), and the refusal every layer of the server answers with."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from fastapi.responses import JSONResponse

from cifarkit.inference import backends

API_KEY_ENV = "CIFARKIT_API_KEY"
LOOPBACK = "127.0.0.1"
PREDICT = "/v1/predict"

# Cores the model thread leaves to the event loop and the decode thread, by CPU kind (backends.cpu_kind); other kinds
# leave none. Measured on 2 cores at 64 connections (docs/serving.md): with AMX the model outruns HTTP and decoding,
# and a full team of threads stalls whenever the loop takes one of their cores, so it leaves one. With AVX512-BF16
# alone the model limits req/s, and it takes both cores; on AVX2 the default (onnxruntime) was measured on both.
SPARE_CORES_BY_CPU_KIND = {"amx": 1}


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
    # The model thread's intra-op threads (torch's or onnxruntime's); None: torch's own (one per core) less the CPU
    # kind's SPARE_CORES_BY_CPU_KIND.
    threads: int | None = None
    backend: str = "auto"
    # auto: CUDA, then MPS, then the CPU. A machine without a GPU serves on its CPU as before; one with a GPU runs
    # its batches there.
    device: str = "auto"
    verify: bool = True
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None, repr=False)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    def model_threads(self) -> int:
        """Read on a thread that has torch's own count (OpenMP keeps the setting per thread): the model thread sets
        its own to this."""
        spare = SPARE_CORES_BY_CPU_KIND.get(backends.cpu_kind(), 0)
        return self.threads or max(1, torch.get_num_threads() - spare)


class Refused(Exception):
    """An image or request that gets an error answer: the HTTP status, and the one-line reason."""

    def __init__(self, status: int, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers

    def answer(self) -> JSONResponse:
        return JSONResponse({"detail": self.detail}, self.status, self.headers)
