"""Quality gate for the shipped releases: each must still score what its metrics.json records."""
import json
import os

import pytest

from cifarkit import Classifier
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.data import cifar10
from conftest import FIXTURE, FLOORS, ROOT

pytestmark = pytest.mark.e2e

RELEASES = sorted(p.name.removeprefix("version_") for p in SHIPPED.glob("version_*"))
MAX_WEIGHTS_BYTES = 10 * 10**6
# config, preprocessing, card and metrics.json, which gains a speed table for each CPU kind measured (about 2 KB each)
MAX_METADATA_BYTES = 64 * 2**10
SHIPPED_FILES = {"model.safetensors", "config.yaml", "preprocess.py", "metrics.json", "MODEL_CARD.md"}
REAL_DATA_TOLERANCE = 0.003  # the gate set when the releases shipped: the recorded test accuracy minus 0.3 points


def test_releases_a_and_b_ship_and_a_is_the_default():
    assert RELEASES == ["A", "B"]
    assert Classifier.pretrained().info["release"] == "A"


@pytest.mark.parametrize("version", RELEASES)
def test_shipped_release_is_small_and_complete(version):
    folder = SHIPPED / f"version_{version}"
    assert {path.name for path in folder.iterdir() if path.is_file()} == SHIPPED_FILES  # exports are rebuilt
    assert (folder / "model.safetensors").stat().st_size <= MAX_WEIGHTS_BYTES
    metadata = SHIPPED_FILES - {"model.safetensors"}
    assert sum((folder / name).stat().st_size for name in metadata) <= MAX_METADATA_BYTES


@pytest.mark.parametrize("version", RELEASES)
def test_shipped_release_cites_the_speed_run_its_figures_come_from(version):
    """metrics.json's speed-run figures are the committed report's: a later speed run of the same recipe writes a
    file of its own name, and the release keeps citing the one its figures came from."""
    metrics = json.loads((SHIPPED / f"version_{version}" / "metrics.json").read_text())
    cited = metrics["speedrun"]
    report = json.loads((ROOT / cited["file"]).read_text())
    assert report["recipe"] == metrics["recipe"]
    statistics = ("n", "mean", "std", "ci95")
    assert {k: cited[k] for k in statistics} == {k: report["accuracy"][k] for k in statistics}
    assert cited["wall_time_s_mean"] == report["wall_time_s"]["mean"]


@pytest.fixture(scope="module")
def gate_data():
    """(test images, labels, real?): the real test set when CIFARKIT_DATA names the archive, else the fixture's."""
    if os.environ.get("CIFARKIT_DATA"):
        dataset = cifar10.load()
        return dataset.test_x, dataset.test_y, True
    dataset = cifar10.load_cache(FIXTURE)
    return dataset.test_x, dataset.test_y, False


@pytest.mark.parametrize("version", RELEASES)
def test_gate_shipped_release_scores_its_recorded_accuracy(version, gate_data):
    """Through the backend `auto` picks on this CPU (never an emulated precision), every test image read."""
    images, labels, real = gate_data
    classifier = Classifier.pretrained(version)
    backend = classifier.backend
    predictions = classifier.predict_batch(images.permute(0, 2, 3, 1).numpy())
    accuracy = sum(int(p == y) for p, y in zip(predictions, labels.tolist())) / len(labels)
    print(f"release {version} through {backend}: {100 * accuracy:.2f}% on {len(labels)} "
          f"{'real' if real else 'fixture'} test images")
    if real:
        recorded = classifier.info["inference"].get("test_acc_by_backend", {}).get(backend, classifier.info["test_acc"])
        assert accuracy >= recorded - REAL_DATA_TOLERANCE
    else:
        # measured through each backend on the sample (lab/measure_test_floors.py), minus one point
        assert accuracy >= FLOORS["releases"][version]["backends"][backend]["floor"]
