"""torch.hub entry points: the shipped releases as ready classifiers, and every architecture as a plain module.

    import torch
    classifier = torch.hub.load("path/to/cifarkit", "version_a", source="local")   # then classifier.predict(image)
    model = torch.hub.load("path/to/cifarkit", "fastnet", source="local")            # untrained
    model = torch.hub.load("path/to/cifarkit", "fastnet_deep_half", source="local", release="B")  # B's weights

A clone works without installing the package: its `src` folder goes on the import path. Each release holds the
weights of one architecture (`torch.hub.help(..., "version_a")` names it).
"""
import sys as _sys
from pathlib import Path as _Path

dependencies = ["torch", "numpy", "safetensors", "PIL"]  # what importing cifarkit.inference.classifier needs

_SRC = _Path(__file__).resolve().parent / "src"
if _SRC.is_dir() and str(_SRC) not in _sys.path:
    _sys.path.insert(0, str(_SRC))

from cifarkit import models as _models  # noqa: E402  (after the path is set)
from cifarkit.core.errors import CifarkitError as _CifarkitError  # noqa: E402
from cifarkit.inference.classifier import Classifier as _Classifier  # noqa: E402


def version_a(backend: str = "auto", device: str = "auto"):
    """Release A, shipped with the package, as a `cifarkit.Classifier`: `predict(image)` takes an HxWx3 uint8 picture
    and returns a class index. backend: auto (the fastest of those that meet the release's accuracy rule on this
    device), torch-fp32, torch-bf16, torch-fp16 (GPUs only), onnxruntime. device: auto (CUDA, then MPS, then the
    CPU), cuda, mps, cpu."""
    return _Classifier.pretrained("A", backend=backend, device=device)


def version_b(backend: str = "auto", device: str = "auto"):
    """Release B, shipped with the package, as a `cifarkit.Classifier` (see version_a)."""
    return _Classifier.pretrained("B", backend=backend, device=device)


def _architecture(name: str):
    def entry(release: str | None = None):
        if release is None:
            return _models.create(name)
        # On the CPU, as torch.hub's modules come: the caller moves it. Loading checks the weights' sha256 first.
        classifier = _Classifier.load(release, backend="torch-fp32", device="cpu")
        held = classifier.info.get("model")  # what the release's metrics.json says it holds
        if held is None:
            raise _CifarkitError(f"{release} is not a release (it has no metrics.json); give a version name or a "
                                 "folder written by `cifarkit release`")
        if held != name:
            raise _CifarkitError(f"release {release} holds {held} weights, not {name}; load {held!r} with it")
        return classifier.model

    entry.__name__ = name
    entry.__doc__ = (f"The {name} architecture as a torch.nn.Module taking normalized 3x32x32 images: untrained, or "
                     f"with a release's weights (release='A', a version name or a release folder). It expects the "
                     f"release's normalization; a cifarkit.Classifier (version_a, version_b) applies it for you.")
    return entry


for _name in _models.names():
    globals()[_name] = _architecture(_name)
