"""`Classifier`: a release (or any cifarkit weights) behind predict(image), for images of any size and kind.

    from cifarkit import Classifier
    clf = Classifier.pretrained()          # the shipped version A, offline
    clf.predict("cat.jpg")                 # 3
    clf.predict_label("cat.jpg")           # 'cat'

Three backends compute the logits: PyTorch eager in fp32, PyTorch with bf16 autocast (AMX/AVX512-BF16 CPUs; fp16
on CUDA), and ONNX Runtime on the release's exported model.onnx. `backend="auto"` takes the one the release's
metrics.json recommends: the fastest measured there whose top-1 predictions agree with fp32's on >= 99.9% of the
test images.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from cifarkit import checkpoint, preprocess
from cifarkit.data import CLASSES
from cifarkit.device import PRECISIONS, autocast, pick_device
from cifarkit.errors import CifarkitError

BACKENDS = ("torch-fp32", "torch-bf16", "onnxruntime")
SHIPPED = Path(__file__).resolve().parent / "pretrained"  # the releases that ship with the package
DEFAULT_VERSION = "A"
ONNX_NAME = "model.onnx"


def release_dir(name_or_path: str | Path, root: str | Path | None = None) -> Path:
    """'A' -> <root or the shipped releases>/version_A; anything else is a path."""
    text = str(name_or_path)
    if Path(text).exists() or "/" in text or text.endswith(".safetensors"):
        return Path(text)
    return Path(root or SHIPPED) / f"version_{text}"


class Classifier:
    def __init__(self, model: torch.nn.Module, mean, std, backend: str = "torch-fp32", device: str = "cpu",
                 onnx_path: Path | None = None, info: dict | None = None):
        if backend not in BACKENDS:
            raise CifarkitError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.device = pick_device(device)
        self.model = model.eval().to(self.device).to(memory_format=torch.channels_last)
        self.mean, self.std, self.backend, self.info = tuple(mean), tuple(std), backend, info or {}
        self.classes = CLASSES
        self._run_onnx = None
        if backend == "onnxruntime":
            if onnx_path is None or not Path(onnx_path).exists():
                raise CifarkitError(f"backend onnxruntime needs {onnx_path or ONNX_NAME}; write it with "
                                    f"`cifarkit export RELEASE --format onnx` or choose another backend")
            from cifarkit.export import run_artifact
            self._run_onnx = run_artifact("onnx", Path(onnx_path))
        self._precision = PRECISIONS["bf16" if backend == "torch-bf16" else "fp32"]

    @classmethod
    def load(cls, path: str | Path, backend: str = "auto", device: str = "cpu") -> "Classifier":
        """A release folder, a run folder or a .safetensors file written by cifarkit."""
        path = Path(path)
        if not path.exists():
            raise CifarkitError(f"no release or weights at {path}; give a release folder (cifarkit release) or "
                                f"a .safetensors file")
        model, meta = checkpoint.load_weights(path)
        folder = path if path.is_dir() else path.parent
        metrics_path = folder / "metrics.json"
        info = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        if backend == "auto":
            backend = info.get("inference", {}).get("default_backend", "torch-fp32")
        onnx_path = folder / ONNX_NAME
        if backend == "onnxruntime" and not onnx_path.exists():
            onnx_path = _cached_onnx(model, path if path.is_file() else folder / "model.safetensors")
        return cls(model, meta["mean"], meta["std"], backend=backend, device=device, onnx_path=onnx_path,
                   info=info)

    @classmethod
    def pretrained(cls, version: str = DEFAULT_VERSION, backend: str = "auto") -> "Classifier":
        """A release shipped inside the package (no download): version A by default."""
        folder = SHIPPED / f"version_{version}"
        if not folder.is_dir():
            shipped = sorted(p.name.removeprefix("version_") for p in SHIPPED.glob("version_*"))
            raise CifarkitError(f"no shipped release {version!r}; shipped: {', '.join(shipped) or 'none'}")
        return cls.load(folder, backend=backend)

    def logits(self, pixels: np.ndarray) -> torch.Tensor:
        """N x 32 x 32 x 3 uint8 -> N x 10 float32 logits on the CPU."""
        inputs = preprocess.normalize(pixels, self.mean, self.std)
        if self._run_onnx is not None:
            return torch.from_numpy(self._run_onnx(inputs)).float()
        x = torch.from_numpy(inputs).to(self.device).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), autocast(self.device, self._precision):
            return self.model(x).float().cpu()

    def predict_proba_batch(self, images, batch_size: int = 256) -> np.ndarray:
        images = list(images)
        chunks = []
        for start in range(0, len(images), batch_size):
            pixels = np.stack([preprocess.to_uint8(image) for image in images[start:start + batch_size]])
            chunks.append(self.logits(pixels).softmax(1).numpy())
        return np.concatenate(chunks) if chunks else np.zeros((0, len(self.classes)), np.float32)

    def predict_batch(self, images, batch_size: int = 256) -> list[int]:
        return [int(i) for i in self.predict_proba_batch(images, batch_size).argmax(1)]

    def predict_proba(self, image) -> np.ndarray:
        return self.predict_proba_batch([image])[0]

    def predict(self, image) -> int:
        """The class index (0-9), as the seed's CIFAR10Classifier returned it."""
        return int(self.predict_proba(image).argmax())

    def predict_label(self, image) -> str:
        return self.classes[self.predict(image)]

    def topk(self, image, k: int = 5) -> list[tuple[str, float]]:
        if not 1 <= k <= len(self.classes):
            raise ValueError(f"k must be between 1 and {len(self.classes)}, got {k}")
        proba = self.predict_proba(image)
        order = np.argsort(-proba)[:k]
        return [(self.classes[i], float(proba[i])) for i in order]


def _cached_onnx(model: torch.nn.Module, weights: Path) -> Path:
    """Releases ship without model.onnx (it would double their size): the first onnxruntime load exports one into
    the cache, keyed by the weights' hash, and later loads reuse it."""
    from cifarkit import data, export
    from cifarkit.files import atomic_path
    path = data.home() / "onnx" / f"{hashlib.sha256(weights.read_bytes()).hexdigest()[:32]}.onnx"
    if not path.exists():
        with atomic_path(path) as tmp:
            export.write_onnx(model, tmp)
    return path


class CIFAR10Classifier(Classifier):
    """The seed's interface: CIFAR10Classifier(version='A', root='cifar10_models').predict(image) -> class index."""

    def __init__(self, version: str = DEFAULT_VERSION, root: str | Path = "cifar10_models", backend: str = "auto"):
        loaded = Classifier.load(Path(root) / f"version_{version}", backend=backend)
        self.__dict__.update(loaded.__dict__)
