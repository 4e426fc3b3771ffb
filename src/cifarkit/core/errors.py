"""How problems reach the user: one line that names the file or value and the way out."""
from __future__ import annotations

import errno
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"

_WAY_OUT = {
    errno.ENOSPC: "free some disk space (nothing that existed was changed) and run the command again",
    errno.EDQUOT: "free some of your disk quota (nothing that existed was changed) and run the command again",
    errno.EROFS: "choose a folder on a writable disk",
    errno.EACCES: "check its permissions, or use a path you may access",
    errno.EPERM: "check its permissions, or use a path you may access",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "it is a folder; give a file",
}


class CifarkitError(Exception):
    """A user-facing problem: the message names what is wrong and how to fix it, on one line."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none: for one-line reports."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def describe_os_error(error: OSError) -> str:
    """An OSError as one line: what failed, on which file, and what to do about it."""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else str(error))
    where = f": {error.filename}" if error.filename else ""
    way_out = _WAY_OUT.get(error.errno)
    return f"{reason}{where}" + (f"; {way_out}" if way_out else "")
