"""The ASGI middleware in front of every route: the API key, the body limit and the request metrics."""
from __future__ import annotations

import hmac
import time

from starlette.exceptions import HTTPException

from cifarkit.serving.pipeline import Metrics
from cifarkit.serving.settings import API_KEY_ENV, PREDICT, Refused, ServeSettings


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
        started, endpoint, status = time.perf_counter(), _endpoint(scope["path"]), [None]

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
        except BaseException:
            if status[0] is None:  # the ASGI server answers a failure before any response with a 500
                status[0] = 500
            raise
        finally:
            # A request that ended without an answer or an error is a client that left (the app counted it in
            # cifarkit_client_disconnects): nothing was answered, so it is not counted here as one.
            if status[0] is not None:
                self.metrics.requests.labels(endpoint, str(status[0])).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    def _check(self, scope) -> Refused | None:
        headers = dict(scope["headers"])
        key = self.settings.api_key
        if key and scope["path"].startswith("/v1/"):
            given = headers.get(b"x-api-key", b"")
            bearer = headers.get(b"authorization", b"")
            if bearer[:7].lower() == b"bearer ":
                given = bearer[7:].strip()
            if not hmac.compare_digest(given, key.encode()):
                return Refused(401, f"missing or wrong API key; send the server's {API_KEY_ENV} as "
                                     f"`Authorization: Bearer KEY` or `X-API-Key: KEY`",
                                {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_body_bytes:
            return self._too_large(int(length))
        return self.shed(scope)

    def _too_large(self, size: int | None) -> Refused:
        got = f"{size:,} bytes" if size is not None else "more"
        return Refused(413, f"the request body is {got}, over the limit of {self.settings.max_body_bytes:,} "
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
