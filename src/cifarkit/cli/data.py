"""`cifarkit data import`, `info` and `show`: the data set, verified and cached."""
from __future__ import annotations

from pathlib import Path

from cifarkit.cli.common import bounded, command, plural, print_json

GRID_MAX = 256  # images in a `data show` grid: 32 rows of 8 still make a page; 100,000 once took 13 GB


def cmd_data_import(args) -> None:
    from cifarkit.data import cifar10
    dataset = cifar10.import_data(args.path)
    print(f"imported {len(dataset.train_y):,} train and {len(dataset.test_y):,} test images into "
          f"{cifar10.cache_path()}")
    print(f"content sha256 {dataset.sha256}")


def cmd_data_info(args) -> None:
    import torch

    from cifarkit.data import cifar10
    dataset = cifar10.load()
    info = {"source": dataset.source, "cache": str(cifar10.cache_path()), "sha256": dataset.sha256, "splits": {}}
    for split, x, y in (("train", dataset.train_x, dataset.train_y), ("test", dataset.test_x, dataset.test_y)):
        counts = torch.bincount(y, minlength=10).tolist()
        info["splits"][split] = {"images": len(y), "per_class": dict(zip(cifar10.CLASSES, counts)),
                                 "images_sha256": cifar10.content_sha256(x), "labels_sha256": cifar10.content_sha256(y)}
    if args.json:
        print_json(info)
        return
    print(f"source: {info['source']}\ncache: {info['cache']}\ncontent sha256: {info['sha256']}")
    for split, s in info["splits"].items():
        print(f"{split}: {s['images']:,} images; images sha256 {s['images_sha256']}, "
              f"labels sha256 {s['labels_sha256']}")
        print("  " + ", ".join(f"{name} {count}" for name, count in s["per_class"].items()))


def cmd_data_show(args) -> None:
    import torch

    from cifarkit.data import cifar10
    from cifarkit.training import plots
    from cifarkit.training.config import check_seed
    check_seed(args.seed, "--seed")
    plots.figure_format(Path(args.out))  # a suffix it cannot write fails before the data is loaded
    dataset = cifar10.load()
    x, y = (dataset.train_x, dataset.train_y) if args.split == "train" else (dataset.test_x, dataset.test_y)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))[:args.count]
    plots.sample_grid(x[idx], y[idx], cifar10.CLASSES, Path(args.out))
    print(f"wrote {args.out} ({plural(len(idx), args.split + ' image')})")


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    data_sub = command(sub, "data", "import, inspect and show CIFAR-10").add_subparsers(required=True,
                                                                                         title="commands")
    p = command(data_sub, "import", "verify an archive or folder in the python layout and cache it")
    p.add_argument("path", help="cifar-10-python.tar.gz or the folder it unpacks to (a local path, not a URL)")
    p.set_defaults(func=cmd_data_import)
    p = command(data_sub, "info", "counts per split and class, content sha256")
    p.add_argument("--json", action="store_true", help="print the counts and checksums as JSON")
    p.set_defaults(func=cmd_data_info)
    p = command(data_sub, "show", "write a labelled grid of sample images")
    p.add_argument("--out", required=True, help="figure file to write: .png, .jpg/.jpeg, .pdf or .svg")
    p.add_argument("--split", choices=("train", "test"), default="train", help="images to draw from (default: train)")
    p.add_argument("--count", type=bounded(1, GRID_MAX, why="a bigger grid is no longer a picture"), default=64,
                   help=f"images in the grid, 1 to {GRID_MAX} (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pick (default: 0)")
    p.set_defaults(func=cmd_data_show)
