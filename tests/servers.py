"""A real `cifarkit serve` process on loopback for the tests that need one, stopped by SIGTERM when they end."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

READY = re.compile(r"cifarkit serve: ready at (http://\S+) ")
START_TIMEOUT_S = 120  # loading torch and two releases takes a few seconds; a loaded CI machine, more


class Server:
    def __init__(self, process: subprocess.Popen, url: str, lines: list[str]):
        self.process, self.url, self.lines = process, url, lines

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@contextmanager
def running_server(*args: str, env: dict | None = None, cwd: Path | None = None, python: list[str] | None = None):
    """`cifarkit serve --port 0 ARGS` started and ready; yields a Server. `python` replaces `python -m cifarkit`."""
    command = (python or [sys.executable, "-m", "cifarkit"]) + ["serve", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                               env={**os.environ, **(env or {})})
    lines: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def read():
        for line in process.stdout:
            lines.append(line)
            if (match := READY.search(line)) and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.1) and time.monotonic() < deadline:
        pass
    server = Server(process, found[0] if found else "", lines)
    try:
        if not found:
            raise AssertionError(f"the server did not report ready:\n{server.output}")
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
