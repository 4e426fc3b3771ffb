"""`cifarkit serve` itself: bind the port, run uvicorn with read deadlines, stop gracefully on SIGTERM or Ctrl-C."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools' protocol where installed, else h11's

from cifarkit.core.errors import CifarkitError
from cifarkit.serving.app import create_app
from cifarkit.serving.pipeline import load_models
from cifarkit.serving.settings import API_KEY_ENV, LOOPBACK, ServeSettings

log = logging.getLogger(__name__)


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
