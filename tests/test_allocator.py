"""Training runs on tcmalloc when it is installed (CI installs it), else on glibc tuned by GLIBC_TUNABLES, says so
in config.yaml, and CIFARKIT_ALLOCATOR=system keeps the system's allocator as it is. Real `cifarkit` processes: the
restart replaces the process."""
import os
import subprocess
import sys

import pytest
import yaml

from cifarkit.core import allocator

TRAIN = ["train", "--recipe", "simplecnn", "--set", "train.epochs=1", "--set", "data.subset=100", "--set",
         "train.batch_size=50"]


def trains_on(tmp_path, setting: str) -> str:
    """The allocator a real `cifarkit train` process with CIFARKIT_ALLOCATOR=setting records having run on."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in (allocator.TRIED, "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-m", "cifarkit", *TRAIN, "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**env, allocator.ENV: setting})
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = yaml.safe_load((out / "config.yaml").read_text())["run"]["allocator"]
    assert f"memory allocator: {recorded}" in (out / "train.log").read_text()
    return recorded


@pytest.mark.parametrize("setting, expected", [("", "tcmalloc"), ("system", "glibc")])
def test_training_runs_on_tcmalloc_unless_told_not_to_and_records_it(cifar_home, tmp_path, setting, expected):
    if allocator.find() is None:
        if os.environ.get("CI"):
            pytest.fail("tcmalloc is missing; .ci/run installs it (apt-get install libtcmalloc-minimal4)")
        pytest.skip("tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    assert trains_on(tmp_path, setting) == expected


def test_without_tcmalloc_training_runs_on_the_mimalloc_wheel(cifar_home, tmp_path):
    """mimalloc comes with the package's dependencies: a pip-only install trains on it, and CIFARKIT_ALLOCATOR=mimalloc
    takes it where tcmalloc is installed too."""
    assert allocator.find_mimalloc() is not None, "the cmeel-mimalloc wheel is a dependency on Linux"
    assert trains_on(tmp_path, "mimalloc" if allocator.find() else "") == "mimalloc"


# Allocates, fills and frees a 64 MiB tensor ten times, as a training step does its activations, and prints the
# minor page faults that took.
REUSE = """
import resource, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16, 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_preloaded_allocator_keeps_freed_memory_for_the_next_allocation():
    """Why the preload: glibc hands the freed tensor back and faults its pages in again each time; mimalloc (and
    tcmalloc where installed) keeps it for the next one."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    libraries = {"glibc": None, "mimalloc": allocator.find_mimalloc(), "tcmalloc": allocator.find()}
    faults = {name: int(subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True, check=True,
                                       timeout=120, env={**env, **({"LD_PRELOAD": str(lib)} if lib else {})}).stdout)
              for name, lib in libraries.items() if name == "glibc" or lib}
    pages = 64 * 2**20 // 4096
    assert faults["glibc"] > 5 * pages, faults
    # tcmalloc hands some back at its own pace: at most 3 of the 10 allocations' pages
    assert all(count < 3 * pages for name, count in faults.items() if name != "glibc"), faults


@pytest.mark.unit
def test_the_preload_environment_is_the_one_a_training_command_restarts_with():
    """What commands that start other programs preload (`cifarkit reference`): the restart's own choice."""
    assert allocator.preload_environment({allocator.ENV: "system"}) is None
    library = allocator.find_mimalloc()
    if library is None:
        pytest.skip("the cmeel-mimalloc wheel is not installed")
    chosen = allocator.preload_environment({allocator.ENV: "mimalloc", "LD_PRELOAD": "libother.so"})
    assert chosen["LD_PRELOAD"] == f"{library} libother.so"
    assert chosen["MIMALLOC_PURGE_DELAY"] == allocator.MIMALLOC_SETTINGS["MIMALLOC_PURGE_DELAY"]
    users = allocator.preload_environment({allocator.ENV: "mimalloc", "MIMALLOC_PURGE_DELAY": "10"})
    assert users["MIMALLOC_PURGE_DELAY"] == "10"  # a user's setting stays
