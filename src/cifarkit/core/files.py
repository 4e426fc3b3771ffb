"""Atomic, durable writes: a reader (or a crash, a kill, a full disk) never sees a half-written file, only the old
one or the new one.

Every write goes to a hidden temporary file beside the target, is fsync'ed, renamed onto the target, and the folder
is fsync'ed so the rename itself survives a power cut. Temporary names carry the writer's process id, so the
leftovers of a killed writer are recognised and removed by the next write of the same file.

Also here, for both sides of the package (training and inference): where cifarkit keeps its caches, file hashes,
and a stop by SIGTERM that cleans up as Ctrl-C does.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

FILE_MODE = 0o644  # set explicitly: the process umask is never changed
FOLDER_MODE = 0o755


def home() -> Path:
    """cifarkit's cache folder: the imported data set, exported ONNX models and the TensorRT provider's engines."""
    return Path(os.environ.get("CIFARKIT_HOME", Path.home() / ".cache" / "cifarkit")).expanduser()


def file_digest(path: Path, algorithm: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def fsync_folder(folder: Path) -> None:
    """Make a rename or creation inside `folder` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file below `folder` and the folders themselves, e.g. before a staged folder is renamed in."""
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_folder(Path(root))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def temp_name(name: str) -> str:
    """`.NAME.PID.RANDOM.tmp`: hidden, tied to this process so a dead writer's leftovers can be told apart."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def remove_stale_temps(folder: Path, name: str) -> None:
    """Remove temporaries of `name` in `folder` that a killed process left behind (never a live writer's)."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp(\..*)?")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; it replaces `path`, durably, only if the block finishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)
    # The real suffix goes last: some writers (torch.export.save) insist on it.
    tmp = path.with_name(temp_name(path.name) + path.suffix)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
        fsync_folder(path.parent)
    except OSError as e:
        if e.filename is None or Path(e.filename) == tmp:  # a failed write(): name the file the user knows
            e.filename = str(path)
        raise
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def portable(path: str | Path) -> str:
    """A path fit for a file that is shared or committed: relative to the working folder when it lies inside it,
    otherwise just its name. Never an absolute path of this machine."""
    resolved, cwd = Path(path).resolve(), Path.cwd().resolve()
    return resolved.relative_to(cwd).as_posix() if resolved.is_relative_to(cwd) else resolved.name


@contextmanager
def terminate_as_interrupt():
    """Inside, SIGTERM (`kill`, a scheduler's stop) raises KeyboardInterrupt as Ctrl-C does, so that the `with` blocks
    around the work run their exits: a temporary folder is removed and a child process is stopped, not left behind
    by a process that vanished mid-statement. Only the main thread can handle a signal: elsewhere this changes
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt("stopped by SIGTERM")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
