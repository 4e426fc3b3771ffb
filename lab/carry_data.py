"""Carry the real CIFAR-10 to a lent GPU machine that takes at most 64 MiB per call, and rebuild it there exactly.

    python lab/carry_data.py pack .carry              # here: .carry/part1, .carry/part2 (about 51 MB each)
    python lab/carry_data.py unpack .carry            # there, with every part in place: cifarkit's cache

The archive (170 MB) and cifarkit's cache (184 MB) are too big for one call, and they hardly compress. Lossless WebP
of the images, laid out as mosaics of 5,000 (100 a row), takes 56% of their bytes: two calls. `unpack` rebuilds the
cache under CIFARKIT_HOME and refuses unless the images and labels hash to the content sha256 that `pack` recorded,
the one every run's JSON records as dataset_sha256.

On the lease: the device tool removes a path the call does not carry, so each call's command copies its part out of
the project (`cp -r .carry/part1 /tmp/`) and the last one copies the others back before `unpack`; the machine must
stay warm between the calls. A user with a GPU needs none of this: CIFARKIT_DATA or the download does it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROW = 100  # images per mosaic row
MOSAIC = 5_000  # images per mosaic: a 1600 x 3200 picture
SPLITS = ("train", "test")


def _encode(job: tuple[np.ndarray, Path, int]) -> None:
    from PIL import Image
    images, path, method = job  # N x 3 x 32 x 32 uint8, N a multiple of ROW
    rows = len(images) // ROW
    picture = images.transpose(0, 2, 3, 1).reshape(rows, ROW, 32, 32, 3).transpose(0, 2, 1, 3, 4)
    Image.fromarray(np.ascontiguousarray(picture.reshape(rows * 32, ROW * 32, 3))).save(
        path, "WEBP", lossless=True, quality=100, method=method)


def _decode(path: Path) -> np.ndarray:
    from PIL import Image
    picture = np.asarray(Image.open(path).convert("RGB"))
    rows = picture.shape[0] // 32
    return picture.reshape(rows, 32, ROW, 32, 3).transpose(0, 2, 1, 3, 4).reshape(rows * ROW, 32, 32, 3) \
        .transpose(0, 3, 1, 2)


def pack(folder: Path, parts: int, method: int) -> None:
    from cifarkit.data import cifar10
    dataset = cifar10.load()
    splits = {"train": (dataset.train_x.numpy(), dataset.train_y), "test": (dataset.test_x.numpy(), dataset.test_y)}
    odd = [name for name, (x, _) in splits.items() if len(x) % ROW]
    if odd:
        sys.exit(f"pack: the {odd[0]} split has {len(splits[odd[0]][0])} images, not a multiple of {ROW}")
    mosaics = [(split, start) for split, (x, _) in splits.items() for start in range(0, len(x), MOSAIC)]
    homes = [folder / f"part{1 + index * parts // len(mosaics)}" for index in range(len(mosaics))]
    for home in set(homes):
        home.mkdir(parents=True, exist_ok=True)
    jobs = [(splits[split][0][start:start + MOSAIC], home / f"{split}-{start}.webp", method)
            for (split, start), home in zip(mosaics, homes)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # the encoder is C code; Pillow releases the GIL in it
        list(pool.map(_encode, jobs))
    np.savez(homes[-1] / "labels.npz", **{split: y.numpy().astype(np.uint8) for split, (_, y) in splits.items()})
    (homes[-1] / "content.json").write_text(json.dumps({"sha256": dataset.sha256,
                                                        "source": Path(dataset.source).name}))
    for home in sorted(set(homes)):
        size = sum(f.stat().st_size for f in home.iterdir())
        print(f"{home}: {size / 1e6:.1f} MB")


def unpack(folder: Path) -> Path:
    import torch

    from cifarkit.data import cifar10
    last = next((f.parent for f in folder.glob("part*/content.json")), None)  # pack puts the records in the last part
    if last is None:
        sys.exit(f"unpack: no part in {folder} holds content.json: the last part is missing; carry every part again")
    recorded = json.loads((last / "content.json").read_text())
    labels = np.load(last / "labels.npz")
    tensors = {}
    for split in SPLITS:
        files = sorted(folder.glob(f"part*/{split}-*.webp"), key=lambda f: int(f.stem.split("-")[1]))
        images = np.concatenate([_decode(f) for f in files]) if files else np.empty((0, 3, 32, 32), np.uint8)
        tensors[f"{split}_x"] = torch.from_numpy(np.ascontiguousarray(images))
        tensors[f"{split}_y"] = torch.from_numpy(labels[split])
    sha = cifar10.content_sha256(*(tensors[k] for k in ("train_x", "train_y", "test_x", "test_y")))
    if sha != recorded["sha256"]:
        sys.exit(f"unpack: the images in {folder} hash to {sha}, not the packed {recorded['sha256']}: a part is "
                 f"missing or damaged; carry every part again")
    return cifar10.save_cache(tensors, sha, f"{recorded['source']}, carried by lab/carry_data.py")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--parts", type=int, default=2, help="pack: how many folders (default: 2, for 64 MiB calls)")
    parser.add_argument("--method", type=int, default=4, choices=range(7),
                        help="pack: WebP's effort, 0 (fastest) to 6 (default: 4; 6 is barely smaller, and slower)")
    args = parser.parse_args(argv)
    if args.action == "pack":
        pack(args.folder, args.parts, args.method)
    else:
        print(f"wrote {unpack(args.folder)}")


if __name__ == "__main__":
    main()
