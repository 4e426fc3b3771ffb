"""Small C kernels, compiled on the machine that runs them and loaded with ctypes.

Some memory-bound steps of CPU training have no fast torch kernel (a 2x2 max-pool's backward, in
`models/pooling.py`), and torch.compile made them slower on the CPUs measured. A plain C file, compiled once per
CPU kind with the system's C compiler (under a second) for the instruction sets that the run may use, does them at
the memory's speed. The library is cached in cifarkit's home folder under a name that hashes the source, the flags,
the compiler and the CPU, and is written atomically. Without a C compiler, or with CIFARKIT_NATIVE=0, `load` returns
None and the caller keeps torch's kernel: same results, slower.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from cifarkit.core.files import home

log = logging.getLogger("cifarkit")

DISABLE_VARIABLE = "CIFARKIT_NATIVE"

# The vector instructions to compile for, by the capability torch's own kernels run at here (which
# ATEN_CPU_CAPABILITY caps to imitate an older CPU: these kernels must not use more). 512-bit vectors are preferred
# where AVX-512 is allowed: gcc and clang default to 256 on CPUs that have both.
VECTOR_FLAGS = {
    "AVX512": ["-march=native", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def compiler() -> str | None:
    return next((path for name in (os.environ.get("CC"), "cc", "gcc", "clang") if name
                 for path in [shutil.which(name)] if path), None)


def flags() -> list[str]:
    return ["-O3", "-shared", "-fPIC", "-pthread", "-std=c11",
            *VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags (one line of each from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


@functools.cache
def load(source: Path) -> ctypes.CDLL | None:
    """The C file `source` compiled into a shared library and loaded, or None where it cannot be (logged once)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler (cc, gcc or clang): %s runs on torch's kernels, which are slower", source.stem)
        return None
    options = flags()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), " ".join(options), version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    library = home() / "native" / f"{source.stem}-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run([cc, *options, "-o", str(built), str(source)], capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("compiling %s failed, so it runs on torch's kernels (slower): %s", source.name,
                            (result.stderr.strip().splitlines() or ["no message"])[-1])
                return None
            os.replace(built, library)  # atomic: a concurrent build of the same key writes the same bytes
    return ctypes.CDLL(str(library))
