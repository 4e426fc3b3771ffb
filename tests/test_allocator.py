"""Training runs on tcmalloc when it is installed (CI installs it), says so in config.yaml, and
CIFARKIT_ALLOCATOR=system keeps the system's allocator. Real `cifarkit` processes: the restart replaces the process."""
import os
import subprocess
import sys

import pytest
import yaml

from cifarkit import allocator

TRAIN = ["train", "--recipe", "simplecnn", "--set", "train.epochs=1", "--set", "data.subset=100", "--set",
         "train.batch_size=50"]


@pytest.mark.parametrize("setting, expected", [("", "tcmalloc"), ("system", "glibc")])
def test_training_runs_on_tcmalloc_unless_told_not_to_and_records_it(cifar_home, tmp_path, setting, expected):
    if allocator.find() is None:
        if os.environ.get("CI"):
            pytest.fail("tcmalloc is missing; .ci/run installs it (apt-get install libtcmalloc-minimal4)")
        pytest.skip("tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in (allocator.TRIED, "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-m", "cifarkit", *TRAIN, "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**env, allocator.ENV: setting})
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["run"]["allocator"] == expected
    assert f"memory allocator: {expected}" in (out / "train.log").read_text()
