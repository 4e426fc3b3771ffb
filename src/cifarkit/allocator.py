"""The memory allocator training runs on: tcmalloc when it is installed, preloaded the way PyTorch's own CPU launcher
(`torch.backends.xeon.run_cpu`) does it, by running the command again with LD_PRELOAD.

A training step allocates and frees large tensors all the time. glibc hands the big ones back to the system and
takes them again through page faults; tcmalloc keeps them. `cifarkit bench --models fastnet --modes bf16+cl
--batch-size 512 --steps 30 --rounds 1`, each allocator twice, alternately, on this project's 2 cores: 790 and 519
img/s on glibc, 912 and 654 on tcmalloc (+15%, +26%), with 1.3-1.4 million minor page faults and 3.1 s of system
time on glibc against 0.27 million and 0.6 s (results/bench-allocator-*.json hold the second pair).
`CIFARKIT_ALLOCATOR=system` keeps the system's allocator.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "CIFARKIT_ALLOCATOR"  # "system": no preload
TRIED = "CIFARKIT_ALLOCATOR_TRIED"  # set before the second start, so a preload that fails cannot loop
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # Debian's libtcmalloc-minimal4, then gperftools'
FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
           f"{sys.prefix}/lib")


def find() -> Path | None:
    """The tcmalloc library of this machine, or None."""
    for name in LIBRARIES:
        for folder in FOLDERS:
            if (Path(folder) / name).is_file():
                return Path(folder) / name
    return None


def in_use() -> str:
    """"tcmalloc" when it is loaded into this process, else the system's ("glibc" on Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "glibc"


def restart_on_tcmalloc(argv: list[str]) -> None:
    """Run `cifarkit ARGV` again in this process with tcmalloc preloaded, if it is installed and not loaded yet and
    CIFARKIT_ALLOCATOR is not "system"; otherwise return, and the command goes on as it is."""
    if os.environ.get(ENV, "").lower() == "system" or os.environ.get(TRIED) or not sys.platform.startswith("linux"):
        return
    library = find()
    if library is None or in_use() == "tcmalloc":
        return
    preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "cifarkit", *argv],
              {**os.environ, "LD_PRELOAD": preload, TRIED: "1"})
