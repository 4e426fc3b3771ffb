"""Atomic writes: a reader (or a crash) never sees a half-written file, only the old one or the new one."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def permissions(base: int = 0o666) -> int:
    """`base` less the process umask: what open() would have given. mkstemp/mkdtemp use 0600/0700 instead."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block finishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The real suffix goes last: some writers (torch.export.save) insist on it.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, permissions())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")
