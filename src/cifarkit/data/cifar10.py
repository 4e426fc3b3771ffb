"""CIFAR-10: find, download, import, verify and cache it; split it (`loader` batches and augments it).

The decoded set is cached as uint8 tensors in one safetensors file (60,000 x 3,072 bytes of pixels), which loads in
well under a second, so no run ever decodes the pickles twice. Images are kept as N x 3 x 32 x 32 uint8, the
pickles' own order.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cifarkit.core.constants import CLASSES  # noqa: F401  (cifar10.CLASSES: the label names of the data set)
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import file_digest, home, write_bytes

log = logging.getLogger(__name__)

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_MD5 = "c58f30108f718f92721af3b95e74349a"
ARCHIVE_NAME = "cifar-10-python.tar.gz"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
BATCH_SIZE_IN_FILE = 10_000
CACHE_NAME = "cifar10.safetensors"
# Two letters at least, so that a Windows drive (C:/) is not taken for one; pathlib turns "//" into "/".
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")


@dataclass
class Cifar10:
    train_x: torch.Tensor  # N x 3 x 32 x 32 uint8
    train_y: torch.Tensor  # N int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    sha256: str  # of the content: train images, train labels, test images, test labels (uint8 bytes, in order)
    source: str = ""


def cache_path() -> Path:
    return home() / CACHE_NAME


def content_sha256(*arrays: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(a.to(torch.uint8).contiguous().numpy().tobytes())
    return digest.hexdigest()


class _ArrayUnpickler(pickle.Unpickler):
    """The batches are pickles; allow only what a dict of numpy arrays needs, so a hostile file cannot run code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch")
        return super().find_class(module, name)


def _decode_batch(raw: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise CifarkitError(f"{name} is not a CIFAR-10 batch (no data/labels)")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"])
    return data, labels


def read_source(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Decode the six batches from an archive or a folder in the python layout."""
    wanted = set(TRAIN_BATCHES) | {TEST_BATCH}
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        if path.is_dir():
            folder = path / "cifar-10-batches-py" if (path / "cifar-10-batches-py").is_dir() else path
            for name in wanted:
                if (folder / name).is_file():
                    found[name] = _decode_batch((folder / name).read_bytes(), name)
        else:
            with tarfile.open(path, "r:*") as tar:
                for member in tar:
                    name = Path(member.name).name
                    if member.isfile() and name in wanted:
                        found[name] = _decode_batch(tar.extractfile(member).read(), name)
    except PermissionError:
        raise  # the file is fine but unreadable to us: the CLI names it and the permission problem, not corruption
    except (tarfile.TarError, EOFError, zlib.error, OSError, pickle.UnpicklingError, ValueError) as e:
        raise CifarkitError(f"{path}: truncated or corrupted ({type(e).__name__}: {e}); "
                            f"fetch the archive again and re-run `cifarkit data import`") from e
    missing = sorted(wanted - set(found))
    if missing:
        raise CifarkitError(f"{path}: not CIFAR-10 in the python layout, missing {', '.join(missing)}")
    return found


def _check_structure(batches: dict, path: Path) -> None:
    for name, (data, labels) in batches.items():
        if data.dtype != np.uint8 or data.shape != (BATCH_SIZE_IN_FILE, 3072):
            raise CifarkitError(f"{path}: {name} holds {data.dtype} {data.shape}, expected uint8 (10000, 3072)")
        if (labels.shape != (BATCH_SIZE_IN_FILE,) or not np.issubdtype(labels.dtype, np.integer)
                or labels.min() < 0 or labels.max() > 9):
            raise CifarkitError(f"{path}: {name} labels must be 10000 integers in 0..9, got {labels.dtype} "
                                f"{labels.shape}")
    for split, names, per_class in (("train", TRAIN_BATCHES, 5000), ("test", (TEST_BATCH,), 1000)):
        counts = np.bincount(np.concatenate([batches[n][1] for n in names]), minlength=10)
        if not (counts == per_class).all():
            raise CifarkitError(f"{path}: {split} split has {counts.tolist()} images per class, "
                                f"expected {per_class} each")


def _official_md5_matches(path: Path) -> bool:
    if path.is_file():
        return file_digest(path, "md5") == OFFICIAL_MD5
    # A folder: compare each batch with the official per-file checksums that torchvision records.
    from torchvision.datasets import CIFAR10
    folder = path / "cifar-10-batches-py" if (path / "cifar-10-batches-py").is_dir() else path
    return all((folder / name).is_file() and file_digest(folder / name, "md5") == md5
               for name, md5 in CIFAR10.train_list + CIFAR10.test_list)


def source_key(path: Path) -> str:
    """Identifies a source file cheaply (no hashing), so a cache made from it is reused while it is unchanged."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def source_name(source: str) -> str:
    """A cache's source as people know it: the archive or folder it was imported from, without source_key's size
    and mtime, or the official download."""
    path, *fingerprint = source.rsplit("|", 2)
    if len(fingerprint) != 2:  # not a source_key: a description written by whoever made the cache
        return source
    if Path(path) == (home() / "downloads" / ARCHIVE_NAME).resolve():
        return f"the official archive, downloaded from {OFFICIAL_URL}"
    return path


def _refuse_url(value: str, shown_as: str, way_out: str) -> None:
    if URL.match(value):
        raise CifarkitError(f"{shown_as} is a URL; cifarkit reads CIFAR-10 from local files only: {way_out}")


def import_data(path: str | Path) -> Cifar10:
    """Decode and verify an archive or folder, then cache it. The cache is replaced only once the new one is whole."""
    _refuse_url(str(path), str(path), "download the archive, then run `cifarkit data import FILE` (with no data "
                                      "set up at all, cifarkit downloads the official archive itself)")
    path = Path(path).expanduser()
    if not path.exists():
        raise CifarkitError(f"{path}: no such file or folder; give the path of cifar-10-python.tar.gz or its folder")
    batches = read_source(path)
    _check_structure(batches, path)
    train_x = np.concatenate([batches[n][0] for n in TRAIN_BATCHES]).reshape(-1, 3, 32, 32)
    train_y = np.concatenate([batches[n][1] for n in TRAIN_BATCHES]).astype(np.uint8)
    test_x = batches[TEST_BATCH][0].reshape(-1, 3, 32, 32)
    test_y = batches[TEST_BATCH][1].astype(np.uint8)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
               dict(train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y).items()}
    sha = content_sha256(tensors["train_x"], tensors["train_y"], tensors["test_x"], tensors["test_y"])
    if not _official_md5_matches(path):
        file_sha = file_digest(path, "sha256") if path.is_file() else "n/a (a folder)"
        log.warning("%s is not the official archive (md5 differs) but passed the structural check; "
                    "file sha256 %s, content sha256 %s", path, file_sha, sha)
    save_cache(tensors, sha, source_key(path))
    return _from_tensors(tensors, sha, str(path))


def save_cache(tensors: dict[str, torch.Tensor], sha: str, source: str, target: Path | None = None) -> Path:
    target = target or cache_path()
    # Serialized in memory (the whole cache), so a full disk raises OSError(ENOSPC) rather than a SafetensorError.
    write_bytes(target, safetensors.torch.save(tensors, metadata={"sha256": sha, "source": source}))
    return target


def _from_tensors(tensors: dict[str, torch.Tensor], sha: str, source: str) -> Cifar10:
    return Cifar10(tensors["train_x"], tensors["train_y"].long(), tensors["test_x"], tensors["test_y"].long(),
                   sha, source)


def _cache_source() -> str | None:
    try:
        with safe_open(str(cache_path()), "pt") as f:
            return (f.metadata() or {}).get("source")
    except Exception:  # an unreadable cache is simply not a usable cache; it is rebuilt from the source
        return None


def load_cache(path: Path | None = None) -> Cifar10:
    path = path or cache_path()
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as e:
        raise CifarkitError(f"cache {path} is unreadable ({e}); delete it and run `cifarkit data import PATH`") from e
    return _from_tensors(tensors, meta.get("sha256", ""), source_name(meta.get("source", str(path))))


def download(target_dir: Path) -> Path:
    """Fetch the official archive with a progress bar and verify its md5 before it is used."""
    from torchvision.datasets.utils import download_url
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as staging:
        try:
            download_url(OFFICIAL_URL, staging, ARCHIVE_NAME, md5=OFFICIAL_MD5)
        except Exception as e:
            raise CifarkitError(
                f"could not download CIFAR-10 from {OFFICIAL_URL} ({type(e).__name__}: {e}); get the archive some "
                f"other way, then run `cifarkit data import PATH` or set CIFARKIT_DATA=PATH") from e
        final = target_dir / ARCHIVE_NAME
        shutil.move(os.path.join(staging, ARCHIVE_NAME), final)
    return final


def load() -> Cifar10:
    """CIFAR-10 from CIFARKIT_DATA, else the cache under CIFARKIT_HOME, else a verified download."""
    env = os.environ.get("CIFARKIT_DATA")
    if env:
        _refuse_url(env, f"CIFARKIT_DATA={env}", "download the archive and set CIFARKIT_DATA to its path, or unset "
                                                 "it (cifarkit then downloads the official archive itself)")
        source = Path(env).expanduser()
        if not source.exists():
            raise CifarkitError(f"CIFARKIT_DATA={env} does not exist; point it at cifar-10-python.tar.gz or unset it")
        if _cache_source() == source_key(source):
            return load_cache()
        log.info("decoding %s into the cache %s (once)", source, cache_path())
        return import_data(source)
    if cache_path().exists():
        return load_cache()
    log.info("CIFAR-10 is not cached yet: downloading the official archive to %s", home())
    archive = download(home() / "downloads")
    data = import_data(archive)
    archive.unlink()
    return data


def balanced_indices(labels: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` indices with the classes as equal as possible (the first classes take any remainder)."""
    classes = int(labels.max()) + 1
    picked = []
    for c in range(classes):
        members = (labels == c).nonzero().flatten()
        take = count // classes + (1 if c < count % classes else 0)
        if take > len(members):
            raise CifarkitError(f"cannot take {count} class-balanced images: class {c} has only {len(members)}")
        picked.append(members[torch.randperm(len(members), generator=generator)[:take]])
    return torch.cat(picked).sort().values


def split_train(labels: torch.Tensor, val_split: int, subset: int | None, seed: int):
    """(train indices, val indices): the validation images are held out first, then the subset is drawn from the
    rest."""
    generator = torch.Generator().manual_seed(seed)
    all_idx = torch.arange(len(labels))
    val_idx = balanced_indices(labels, val_split, generator) if val_split else all_idx[:0]
    rest = all_idx[~torch.isin(all_idx, val_idx)]
    if subset is not None:
        if subset > len(rest):
            raise CifarkitError(f"subset {subset} is larger than the {len(rest)} training images left")
        rest = rest[balanced_indices(labels[rest], subset, generator)]
    return rest, val_idx
