"""hubconf.py through torch.hub itself (source="local"): the releases as classifiers, the architectures as modules."""
import importlib.util
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from cifarkit import Classifier, models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10
from conftest import FIXTURE, ROOT


def hub(entry: str, **kwargs):
    return torch.hub.load(str(ROOT), entry, source="local", **kwargs)


@pytest.mark.unit
def test_the_entry_points_are_the_releases_and_every_architecture():
    # torch.hub.list takes GitHub repos only; this is its rule for what a hubconf offers: public callables
    spec = importlib.util.spec_from_file_location("hubconf", ROOT / "hubconf.py")
    hubconf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hubconf)
    entries = [name for name in dir(hubconf) if callable(getattr(hubconf, name)) and not name.startswith("_")]
    assert sorted(entries) == sorted(["version_a", "version_b", *models.names()])
    assert "release='A'" in hubconf.fastnet.__doc__ and hubconf.fastnet.__name__ == "fastnet"


def test_a_release_entry_point_is_the_shipped_classifier():
    pixels = cifar10.load_cache(FIXTURE).test_x[:64].permute(0, 2, 3, 1).numpy()
    loaded = hub("version_b", device="cpu")
    assert isinstance(loaded, Classifier) and loaded.info["release"] == "B" and loaded.device == torch.device("cpu")
    assert loaded.predict_batch(pixels) == Classifier.pretrained("B").predict_batch(pixels)
    if not torch.cuda.is_available():
        with pytest.raises(CifarkitError, match="device .cuda. is not available here"):
            hub("version_b", device="cuda")


@pytest.mark.unit
def test_an_architecture_comes_untrained_or_with_its_release_weights():
    untrained = hub("fastnet")
    assert untrained.training and untrained(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    held_by_b = yaml.safe_load((SHIPPED / "version_B" / "config.yaml").read_text())["model"]["name"]
    trained = hub(held_by_b, release="B")
    shipped = Classifier.pretrained("B", backend="torch-fp32").model.state_dict()
    assert not trained.training and trained.state_dict().keys() == shipped.keys()
    assert all(torch.equal(trained.state_dict()[k], shipped[k]) for k in shipped)
    held = yaml.safe_load((SHIPPED / "version_A" / "config.yaml").read_text())["model"]["name"]
    assert held != "resnet18"
    with pytest.raises(CifarkitError, match=f"release A holds {held} weights, not resnet18; load '{held}'"):
        hub("resnet18", release="A")


def test_a_clone_loads_its_own_package_without_installing_it(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "hubconf.py", clone)
    script = (f"import torch; c = torch.hub.load({str(clone)!r}, 'version_a', source='local'); "
              "import cifarkit; print(cifarkit.__file__); print(c.info['release'])")
    # The installed (editable) cifarkit is importable here too: the clone's own must win.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout.split()
    assert out == [str(clone / "src" / "cifarkit" / "__init__.py"), "A"]
