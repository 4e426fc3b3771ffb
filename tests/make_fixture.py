"""Rebuild tests/fixtures/cifar10-mini.safetensors: a seeded, class-balanced sample of the real CIFAR-10.

    python tests/make_fixture.py PATH_TO/cifar-10-python.tar.gz

It is in the cache format, so a test can drop it into CIFARKIT_HOME and run the real commands on it.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch

TRAIN_PER_CLASS, TEST_PER_CLASS, SEED = 200, 50, 2024
TARGET = Path(__file__).parent / "fixtures" / "cifar10-mini.safetensors"


def main(archive: str) -> None:
    os.environ["CIFARKIT_HOME"] = tempfile.mkdtemp()  # decode into a scratch cache, never the user's
    from cifarkit.data import cifar10
    full = cifar10.import_data(archive)
    generator = torch.Generator().manual_seed(SEED)
    train = cifar10.balanced_indices(full.train_y, 10 * TRAIN_PER_CLASS, generator)
    test = cifar10.balanced_indices(full.test_y, 10 * TEST_PER_CLASS, generator)
    tensors = {"train_x": full.train_x[train].contiguous(), "train_y": full.train_y[train].to(torch.uint8),
               "test_x": full.test_x[test].contiguous(), "test_y": full.test_y[test].to(torch.uint8)}
    sha = cifar10.content_sha256(*tensors.values())
    cifar10.save_cache(tensors, sha, f"fixture: seed {SEED}, {TRAIN_PER_CLASS}/{TEST_PER_CLASS} per class of "
                                  f"dataset {full.sha256}", TARGET)
    print(f"wrote {TARGET} ({TARGET.stat().st_size / 1e6:.1f} MB), content sha256 {sha}")


if __name__ == "__main__":
    main(sys.argv[1])
