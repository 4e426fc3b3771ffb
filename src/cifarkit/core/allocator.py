"""The memory allocator training runs on: tcmalloc when the system has it, else mimalloc from its PyPI wheel (a
dependency on Linux, so a pip-only install has it), preloaded the way PyTorch's own CPU launcher
(`torch.backends.xeon.run_cpu`) does it, by running the command again with LD_PRELOAD.

A training step allocates and frees large tensors all the time. glibc hands the big ones back to the system and
takes them again through page faults: a quarter of a CPU's time can go to the kernel. Its tunables do not fix it
for PyTorch: with mmap off, the heap grows at every step instead, because torch's aligned allocations do not fit
in the blocks it freed. tcmalloc and mimalloc keep freed blocks and hand them out again. The allocator that ran is
recorded (config.yaml's run.allocator, `cifarkit env`); lab/measure_allocators.py compares them
(results/allocators-*.json). `CIFARKIT_ALLOCATOR=system` keeps the system's allocator; `=mimalloc` takes the
wheel's even where tcmalloc is installed.
"""
from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

ENV = "CIFARKIT_ALLOCATOR"  # "system": no preload; "mimalloc": the wheel's, even where tcmalloc is installed
TRIED = "CIFARKIT_ALLOCATOR_TRIED"  # set before the second start, so a preload that fails cannot loop
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # Debian's libtcmalloc-minimal4, then gperftools'
FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
           f"{sys.prefix}/lib")
MIMALLOC_WHEEL = "cmeel-mimalloc"
MIMALLOC_SETTINGS = {"MIMALLOC_PURGE_DELAY": "-1"}
NAMES = {"libtcmalloc": "tcmalloc", "libmimalloc": "mimalloc"}  # a mapped library's name -> the allocator's


def find() -> Path | None:
    """The tcmalloc library of this machine, or None."""
    for name in LIBRARIES:
        for folder in FOLDERS:
            if (Path(folder) / name).is_file():
                return Path(folder) / name
    return None


def find_mimalloc() -> Path | None:
    """libmimalloc.so from the cmeel-mimalloc wheel, or None where it is not installed."""
    try:
        files = metadata.files(MIMALLOC_WHEEL) or []
    except metadata.PackageNotFoundError:
        return None
    found = [Path(f.locate()) for f in files if f.name.startswith("libmimalloc.so.")]
    return min(found, key=lambda p: len(p.name)) if found else None  # libmimalloc.so.3 before libmimalloc.so.3.4


def in_use() -> str:
    """"tcmalloc" or "mimalloc" when it is loaded into this process, else the system's ("glibc" on Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return next((name for library, name in NAMES.items() if library in maps), "glibc")


def preload_environment(environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` with the allocator of training commands preloaded: tcmalloc where it is installed, else mimalloc
    from its wheel; None where CIFARKIT_ALLOCATOR is "system", off Linux, or where neither is found. Also used by
    scripts that start other programs (cifarkit reference), so that both sides run on the same one."""
    setting = environ.get(ENV, "").lower()
    if setting == "system" or not sys.platform.startswith("linux"):
        return None
    library = (None if setting == "mimalloc" else find()) or find_mimalloc()
    if library is None:
        return None
    preload = " ".join(filter(None, [str(library), environ.get("LD_PRELOAD")]))
    # mimalloc hands memory that stays free for 10 ms back to the system (its purge), and a step's activations are
    # free for longer than that between two uses: never purging keeps them, as tcmalloc does. A user's value stays.
    settings = {**MIMALLOC_SETTINGS, **environ} if "mimalloc" in library.name else dict(environ)
    return {**settings, "LD_PRELOAD": preload}


def restart_on_tcmalloc(argv: list[str], program: tuple[str, ...] = ("-m", "cifarkit")) -> None:
    """Run `python PROGRAM ARGV` (by default `cifarkit ARGV`) again in this process with the allocator of
    `preload_environment`, unless one of them is loaded already or this process is that second start; otherwise
    return, and the command goes on as it is."""
    if os.environ.get(TRIED) or in_use() != "glibc":
        return
    environ = preload_environment(dict(os.environ))
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *program, *argv], {**environ, TRIED: "1"})
