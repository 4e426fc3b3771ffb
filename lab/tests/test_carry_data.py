"""lab/carry_data.py: CIFAR-10 packed into parts for a lent GPU comes back byte for byte, and a missing or damaged
part is refused rather than trained on."""
import importlib.util
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "cifar10-mini.safetensors"  # the committed real-data sample

spec = importlib.util.spec_from_file_location("carry_data", ROOT / "lab" / "carry_data.py")
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)


def test_packed_parts_rebuild_the_same_cache(tmp_path, monkeypatch):
    here = tmp_path / "here"  # a cifarkit cache holding the committed sample, packed from here
    here.mkdir()
    shutil.copy(FIXTURE, here / "cifar10.safetensors")
    monkeypatch.setenv("CIFARKIT_HOME", str(here))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)
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
