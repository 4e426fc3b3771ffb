"""Measure which downscaling filter preprocess.py should use, and write results/resize-filters.json.

    python lab/measure_resize_filters.py --real-data PATH_TO/cifar-10-python.tar.gz

A picture handed to `cifarkit predict` is often a CIFAR-10-sized image made bigger (upscaled for display, saved as
JPEG). The filter that brings it back to 32 x 32 decides whether the model sees the pixels it was trained on. Each
candidate (Pillow's BOX, BILINEAR and BICUBIC; all antialias when reducing) is run through preprocess.to_uint8 on
upscaled and JPEG-compressed copies of a held-out, class-balanced part of the training set (the test set is never
used to choose anything), and judged three ways:

- mean abs pixel error against the original 32 x 32 pixels (0 to 255 levels): needs no model;
- agreement of each shipped release's prediction with its prediction on the original 32 x 32 image;
- accuracy against the labels.

The shipped releases were trained on all 50,000 training images, these included, so their accuracy here measures
memorisation as much as anything; the pixel error is the measure that chooses (see RULE).
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "results" / "resize-filters.json"
FILTERS = {"box": Image.Resampling.BOX, "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
UPSCALERS = {"nearest": Image.Resampling.NEAREST, "bicubic": Image.Resampling.BICUBIC}
# Integer factors, which a box filter can undo exactly, and one that is not (3.5x: 112 px), which no filter can.
FACTORS = (2, 3, 3.5, 4, 7)
JPEG_FACTOR = 4  # JPEG copies are of the 4x upscales: the size of the README's example images
RULE = ("the filter with the lowest mean abs pixel error against the original 32 x 32 image, averaged over the "
        "transforms: it measures the preprocessing's goal (hand the model the pixels the picture was made from) "
        "without a model, so it is not biased by the releases having been trained on these images; the models' "
        "agreement and accuracy are reported as a check")


def held_out(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` training indices, the same number from each class, drawn with `seed`; sorted."""
    rng = np.random.default_rng(seed)
    per_class = count // 10
    return np.sort(np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
                                   for c in range(10)]))


def transforms(quality: int) -> dict:
    """name -> (description, function from a 32 x 32 x 3 uint8 array to the PIL image a user would hand over)."""
    def upscale(method, factor):
        size = round(32 * factor)
        return lambda pixels: Image.fromarray(pixels).resize((size, size), UPSCALERS[method])

    def jpeg(method):
        enlarge = upscale(method, JPEG_FACTOR)

        def save_and_open(pixels):
            buffer = io.BytesIO()
            enlarge(pixels).save(buffer, "JPEG", quality=quality)
            return Image.open(buffer)
        return save_and_open

    table = {f"{method} {factor:g}x": (f"{method} upscale to {round(32 * factor)} px", upscale(method, factor))
             for method in UPSCALERS for factor in FACTORS}
    for method in UPSCALERS:
        table[f"{method} {JPEG_FACTOR}x + JPEG q{quality}"] = (
            f"{method} upscale to {32 * JPEG_FACTOR} px, saved as JPEG at quality {quality} and decoded by Pillow",
            jpeg(method))
    return table


def measure(pixels: np.ndarray, labels: np.ndarray, quality: int) -> dict:
    from cifarkit import Classifier
    from cifarkit.artifacts import preprocess
    from cifarkit.artifacts.releases import SHIPPED
    versions = sorted(p.name.removeprefix("version_") for p in SHIPPED.glob("version_*"))
    classifiers = {v: Classifier.pretrained(v) for v in versions}

    def predict(classifier, images):
        return np.concatenate([classifier.logits(images[i:i + 500]).argmax(1).numpy()
                               for i in range(0, len(images), 500)])

    original = {v: predict(c, pixels) for v, c in classifiers.items()}
    releases = {v: {"model": c.info["model"], "backend": c.backend,
                    "accuracy_on_original": float((original[v] == labels).mean())} for v, c in classifiers.items()}
    table = transforms(quality)
    rows = []
    for name, (_, make) in table.items():
        handed_over = [make(p) for p in pixels]
        for filter_name, resample in FILTERS.items():
            recovered = np.stack([preprocess.to_uint8(image, resample) for image in handed_over])
            row = {"transform": name, "filter": filter_name,
                   "mean_abs_pixel_error": float(np.abs(recovered.astype(np.int16) - pixels).mean())}
            for v, classifier in classifiers.items():
                predicted = predict(classifier, recovered)
                row[v] = {"accuracy": float((predicted == labels).mean()),
                          "agreement_with_original": float((predicted == original[v]).mean())}
            rows.append(row)
            print(f"measured {name}, {filter_name}", flush=True)
    return {"releases": releases, "transforms": {n: d for n, (d, _) in table.items()}, "rows": rows}


def summarize(rows: list[dict], versions: list[str]) -> dict:
    """Per filter: each measure averaged over the transforms."""
    summary = {}
    for filter_name in FILTERS:
        mine = [r for r in rows if r["filter"] == filter_name]
        summary[filter_name] = {"mean_abs_pixel_error": statistics.fmean(r["mean_abs_pixel_error"] for r in mine)}
        for v in versions:
            summary[filter_name][v] = {key: statistics.fmean(r[v][key] for r in mine)
                                       for key in ("accuracy", "agreement_with_original")}
    return summary


def print_table(result: dict) -> None:
    versions = sorted(result["releases"])
    header = "".join(f" | {v} accuracy | {v} agrees" for v in versions)
    print(f"\n| transform | filter | mean abs pixel error{header} |")
    print("|---|---|---:" + "|---:|---:" * len(versions) + "|")
    for r in result["rows"]:
        cells = "".join(f" | {100 * r[v]['accuracy']:.2f}% | {100 * r[v]['agreement_with_original']:.2f}%"
                        for v in versions)
        print(f"| {r['transform']} | {r['filter']} | {r['mean_abs_pixel_error']:.2f}{cells} |")
    for filter_name, s in result["summary"].items():
        cells = "".join(f" | {100 * s[v]['accuracy']:.2f}% | {100 * s[v]['agreement_with_original']:.2f}%"
                        for v in versions)
        print(f"| **mean** | {filter_name} | {s['mean_abs_pixel_error']:.2f}{cells} |")
    originals = ", ".join(f"{v} {100 * r['accuracy_on_original']:.2f}%" for v, r in result["releases"].items())
    print(f"\naccuracy on the original 32 x 32 images: {originals}")
    print(f"choice: {result['choice']} ({result['rule']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-data", required=True, help="the real cifar-10-python.tar.gz")
    parser.add_argument("--images", type=int, default=2000, help="held-out training images, a multiple of 10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", type=int, default=75, help="JPEG quality of the compressed copies")
    args = parser.parse_args()
    if args.images <= 0 or args.images % 10:
        parser.error("--images must be a positive multiple of 10 (the same number from each class)")
    scratch = Path(tempfile.mkdtemp(prefix="resize-filters-"))
    try:
        os.environ["CIFARKIT_HOME"] = str(scratch)
        os.environ["CIFARKIT_DATA"] = args.real_data
        import PIL

        from cifarkit.core.files import write_json
        from cifarkit.data import cifar10
        dataset = cifar10.load()
        labels = dataset.train_y.numpy()
        chosen = held_out(labels, args.images, args.seed)
        result = measure(dataset.train_x[chosen].permute(0, 2, 3, 1).numpy(), labels[chosen], args.quality)
        result["summary"] = summarize(result["rows"], sorted(result["releases"]))
        result["choice"] = min(FILTERS, key=lambda f: result["summary"][f]["mean_abs_pixel_error"])
        result["rule"] = RULE
        report = {
            "command": "python lab/measure_resize_filters.py --real-data PATH_TO/cifar-10-python.tar.gz"
                       f" --images {args.images} --seed {args.seed} --quality {args.quality}",
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "pillow": PIL.__version__, "dataset_sha256": dataset.sha256,
            "images": {"split": "train", "count": len(chosen), "per_class": args.images // 10, "seed": args.seed,
                       "note": "drawn from the training set, never the test set; the shipped releases were "
                               "trained on all 50,000 training images, these included, so accuracy and "
                               "agreement here are higher than on unseen images"},
            "filters": {name: f"Image.Resampling.{f.name}, reducing_gap=None (antialiased), through "
                              f"preprocess.to_uint8" for name, f in FILTERS.items()},
            **result,
        }
        write_json(TARGET, report)
        print_table(report)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
