import logging
import os
import pickle
import tarfile

import pytest
import torch

from cifarkit.cli import main
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10
from conftest import make_batch, write_archive


def test_import_decodes_verifies_and_caches(synthetic_archive, empty_home, caplog):
    with caplog.at_level(logging.WARNING):
        dataset = cifar10.import_data(synthetic_archive)
    assert dataset.train_x.shape == (50_000, 3, 32, 32) and dataset.train_x.dtype == torch.uint8
    assert dataset.test_x.shape == (10_000, 3, 32, 32)
    assert torch.bincount(dataset.train_y).tolist() == [5000] * 10
    # Pixels survive the trip: each synthetic image is a flat grey of 20 x its label.
    assert torch.equal(dataset.train_x[:, 0, 0, 0].long(), dataset.train_y * 20)
    # Not the official archive: accepted after the structural check, with a warning that carries the sha256.
    assert "not the official archive" in caplog.text
    assert cifar10.file_digest(synthetic_archive, "sha256") in caplog.text
    cached = cifar10.load_cache()
    assert cached.sha256 == dataset.sha256 and torch.equal(cached.test_x, dataset.test_x)


def test_second_load_reads_the_cache_without_decoding(synthetic_archive, empty_home, monkeypatch):
    monkeypatch.setenv("CIFARKIT_DATA", str(synthetic_archive))
    first = cifar10.load()
    monkeypatch.setattr(cifar10, "read_source", lambda path: pytest.fail("decoded the archive a second time"))
    second = cifar10.load()
    assert second.sha256 == first.sha256 and torch.equal(second.train_x, first.train_x)


def test_folder_source(synthetic_archive, empty_home, tmp_path):
    import tarfile
    with tarfile.open(synthetic_archive) as tar:
        tar.extractall(tmp_path / "extracted", filter="data")
    dataset = cifar10.import_data(tmp_path / "extracted")
    assert len(dataset.train_y) == 50_000 and len(dataset.test_y) == 10_000


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_truncated_archive_is_rejected_and_the_cache_is_untouched(synthetic_archive, empty_home, tmp_path, cut):
    cifar10.import_data(synthetic_archive)
    before = cifar10.cache_path().read_bytes()
    broken = tmp_path / "broken.tar.gz"
    raw = synthetic_archive.read_bytes()
    broken.write_bytes(raw[: int(len(raw) * cut)])
    with pytest.raises(CifarkitError, match="broken.tar.gz: truncated or corrupted") as err:
        cifar10.import_data(broken)
    assert "\n" not in str(err.value)
    assert cifar10.cache_path().read_bytes() == before
    assert sorted(os.listdir(empty_home)) == ["cifar10.safetensors"]  # no staged leftovers


def test_corrupted_bytes_are_rejected(synthetic_archive, empty_home, tmp_path):
    raw = bytearray(synthetic_archive.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\xff" * 64
    broken = tmp_path / "flipped.tar.gz"
    broken.write_bytes(bytes(raw))
    with pytest.raises(CifarkitError, match="flipped.tar.gz"):
        cifar10.import_data(broken)
    assert not cifar10.cache_path().exists()


@pytest.mark.parametrize("batches, message", [
    ({"data_batch_3": None}, "missing data_batch_3"),
    ({"test_batch": make_batch(0, labels=[0] * 10_000)}, r"test split has \[10000, 0"),
    ({"data_batch_1": make_batch(0, count=9_000)}, r"expected uint8 \(10000, 3072\)"),
    ({"data_batch_2": make_batch(0, labels=[11] * 10_000)}, "labels must be 10000 integers in 0..9"),
    ({"data_batch_4": make_batch(0, labels=[float(i % 10) for i in range(10_000)])},
     r"labels must be 10000 integers in 0..9, got float64"),
])
def test_structural_check(tmp_path, empty_home, batches, message):
    archive = write_archive(tmp_path / "odd.tar.gz", batches)
    with pytest.raises(CifarkitError, match=message):
        cifar10.import_data(archive)
    assert not cifar10.cache_path().exists()


@pytest.mark.unit
def test_pickle_that_would_run_code_is_refused(tmp_path, empty_home):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    archive = write_archive(tmp_path / "evil.tar.gz", {"data_batch_1": pickle.dumps(Exploit(), protocol=2)})
    with pytest.raises(CifarkitError, match="evil.tar.gz: truncated or corrupted.*unexpected object"):
        cifar10.import_data(archive)


@pytest.mark.unit
def test_failed_download_names_the_ways_out(empty_home, monkeypatch, capsys):
    import torchvision.datasets.utils as tv_utils

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")
    monkeypatch.setattr(tv_utils, "download_url", offline)
    assert main(["data", "info"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or all("INFO" in line for line in err[:-1])
    assert "cifarkit data import PATH" in err[-1] and "CIFARKIT_DATA" in err[-1]
    assert not (empty_home / "cifar10.safetensors").exists()


@pytest.mark.unit
def test_missing_cifarkit_data_path(empty_home, monkeypatch, tmp_path):
    monkeypatch.setenv("CIFARKIT_DATA", str(tmp_path / "nope.tar.gz"))
    with pytest.raises(CifarkitError, match="CIFARKIT_DATA=.*nope.tar.gz does not exist"):
        cifar10.load()


def test_import_and_info_commands(synthetic_archive, empty_home, capsys):
    assert main(["data", "import", str(synthetic_archive)]) == 0
    assert "imported 50,000 train and 10,000 test images" in capsys.readouterr().out
    assert main(["data", "info", "--json"]) == 0
    import json
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["train"]["per_class"]["truck"] == 5000
    assert info["splits"]["test"]["images"] == 10_000
    assert len(info["sha256"]) == 64


def test_an_unreadable_archive_is_a_permission_problem_not_corruption(synthetic_archive, empty_home, monkeypatch,
                                                                      capsys):
    # Injected: this machine's tests run as root, whom file modes never stop, so a chmod 000 file stays readable.
    real_open = tarfile.open

    def denied(name, *args, **kwargs):
        if str(name) == str(synthetic_archive):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, *args, **kwargs)
    monkeypatch.setattr(tarfile, "open", denied)
    assert main(["data", "import", str(synthetic_archive)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"cifarkit: error: Permission denied: {synthetic_archive}; check its permissions, or use a path "
                   f"you may access")
    assert not cifar10.cache_path().exists()


@pytest.mark.unit
def test_show_writes_a_grid(cifar_home, tmp_path):
    out = tmp_path / "grid.png"
    assert main(["data", "show", "--out", str(out), "--count", "16"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
def test_subset_is_class_balanced_and_seeded():
    labels = torch.arange(50_000) % 10
    a, val = cifar10.split_train(labels, val_split=1000, subset=5000, seed=1)
    b, _ = cifar10.split_train(labels, val_split=1000, subset=5000, seed=1)
    c, _ = cifar10.split_train(labels, val_split=1000, subset=5000, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.bincount(labels[a]).tolist() == [500] * 10
    assert torch.bincount(labels[val]).tolist() == [100] * 10
    assert not set(a.tolist()) & set(val.tolist())  # held-out images never train


@pytest.mark.unit
def test_subset_larger_than_the_set_is_an_error():
    with pytest.raises(CifarkitError, match="subset 60000 is larger"):
        cifar10.split_train(torch.arange(50_000) % 10, 0, 60_000, 0)
