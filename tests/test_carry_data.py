"""lab/carry_data.py: CIFAR-10 packed into parts for a lent GPU comes back byte for byte, and a missing or damaged
part is refused rather than trained on."""
import shutil

import pytest
from safetensors.torch import load_file

from conftest import FIXTURE, ROOT, load_script

carry = load_script(ROOT / "lab" / "carry_data.py")


def test_packed_parts_rebuild_the_same_cache(cifar_home, tmp_path, monkeypatch):
    packed = tmp_path / "carry"
    carry.main(["pack", str(packed), "--method", "0"])  # method 0: WebP's fastest, lossless all the same
    assert sorted(p.name for p in packed.iterdir()) == ["part1", "part2"]
    there = tmp_path / "there"
    there.mkdir()
    monkeypatch.setenv("CIFARKIT_HOME", str(there))
    carry.main(["unpack", str(packed)])
    rebuilt, original = load_file(there / "cifar10.safetensors"), load_file(FIXTURE)
    assert rebuilt.keys() == original.keys()
    assert all(rebuilt[k].equal(original[k]) for k in original)

    damaged = sorted(packed.glob("part*/train-*.webp"))[0]
    shutil.copy(sorted(packed.glob("part*/test-*.webp"))[0], damaged)  # another mosaic in its place
    (there / "cifar10.safetensors").unlink()
    with pytest.raises(SystemExit, match="not the packed .*: a part is missing or damaged"):
        carry.main(["unpack", str(packed)])
    assert not (there / "cifar10.safetensors").exists()
    shutil.rmtree(packed / "part2")  # the part with the labels and the recorded hash
    with pytest.raises(SystemExit, match="the last part is missing"):
        carry.main(["unpack", str(packed)])
