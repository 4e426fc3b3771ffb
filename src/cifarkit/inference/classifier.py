"""`Classifier`: a release (or any cifarkit weights) behind predict(image), for images of any size and kind.

    from cifarkit import Classifier
    clf = Classifier.pretrained()          # the shipped version A, offline
    clf.predict("cat.jpg")                 # 3
    clf.predict_label("cat.jpg")           # 'cat'

Four backends compute the logits: PyTorch in fp32, PyTorch with bf16 autocast (AMX/AVX512-BF16 CPUs, CUDA GPUs of
compute capability 8.0 or later), PyTorch with fp16 autocast (GPUs only), and ONNX Runtime on the release's exported
model.onnx (or one exported into the cache on first use), through its CUDA or TensorRT provider on a CUDA device.
`device="auto"` (the default) is CUDA, then Apple MPS, then the CPU, as `cifarkit train` picks it: on a machine
without a GPU that is the CPU, as before there was a choice. `backend="auto"` is decided on the machine that runs,
from the release's recorded accuracies and speeds and the device's features (`cifarkit.inference.backends.choose`);
`Classifier.backend_choice` says which backend and why.

A release is used only as it was written: its weights, and its model.onnx, must have the sha256s its metrics.json
records, or loading stops with the file and both hashes named (verify=False, or `predict --no-verify`, skips that).

Every command and the API name a release the same way (`release_dir`): a path as it is, else a version name, looked
up as ./cifar10_models/version_NAME (where `cifarkit release` writes) and then among the shipped releases.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import warnings
from contextlib import suppress
from pathlib import Path

import numpy as np
import torch

from cifarkit.artifacts import preprocess
from cifarkit.artifacts.releases import (
    DEFAULT_VERSION,
    METRICS_NAME,
    ONNX_NAME,
    SHIPPED,
    UNVERIFIED,
    WEIGHTS_NAME,
    read_metrics,
    release_dir,
    versions,
    weights_sha256,
)
from cifarkit.artifacts.weights import load_weights
from cifarkit.core.constants import CLASSES
from cifarkit.core.device import PRECISIONS, autocast, pick_device
from cifarkit.core.errors import CifarkitError, describe_os_error
from cifarkit.core.files import file_digest, home, write_bytes
from cifarkit.inference import backends, runtime
from cifarkit.inference.backends import GPU_BACKENDS

log = logging.getLogger(__name__)

class Classifier:
    def __init__(self, model: torch.nn.Module, mean, std, backend: str = "torch-fp32", device: str = "auto",
                 onnx: Path | bytes | None = None, info: dict | None = None, traced: bool = False):
        """`device`: auto (CUDA, then MPS, then the CPU), cuda, mps or cpu. `onnx`: the ONNX model the onnxruntime
        backend runs, as a file or as the serialized model itself. `traced`: a torch backend runs the model as a
        traced graph (see `_traced`): the same logits, bit for bit."""
        if backend not in GPU_BACKENDS:
            raise CifarkitError(f"unknown backend {backend!r}; choose from {', '.join(GPU_BACKENDS)}")
        self.device = pick_device(device)
        if problem := backends.unavailable(backend, self.device.type):
            raise CifarkitError(problem)
        self.model = model.eval().to(self.device).to(memory_format=torch.channels_last)
        self.mean, self.std, self.backend, self.info = tuple(mean), tuple(std), backend, info or {}
        self.weights_sha256 = self.info.get("weights_sha256")  # `load` sets it for weights without a metrics.json
        # `load` sets auto's choice
        self.backend_choice = backends.Choice(backend, "asked for", backends.device_kind(self.device.type))
        self.classes = CLASSES
        self._session = None
        self.provider = None  # the onnxruntime backend's execution provider, the one that runs it
        if backend == "onnxruntime":
            if onnx is None or (isinstance(onnx, Path) and not onnx.exists()):
                raise CifarkitError(f"backend onnxruntime needs {onnx or ONNX_NAME}; write it with "
                                    f"`cifarkit export RELEASE --format onnx` or choose another backend")
            self._session = runtime.onnx_session(onnx, self.device)
            self.provider = self._session.get_providers()[0]
        self._precision = PRECISIONS[backends.PRECISION.get(backend, "fp32")]
        if self._precision.autocast_dtype is not None:
            # Autocast casts every fp32 weight to bf16 (or fp16) again on every forward pass (it caches the casts only
            # of weights that require grad): cast the layers it would cast, once. Autocast then meets the same
            # weights it would have made, so the logits are the same bit for bit (tests/test_inference.py), and
            # sooner (docs/serving.md). BatchNorm keeps fp32 weights, as autocast keeps them. On a copy: the
            # caller's model keeps its fp32 weights (`cifarkit release` measures every backend on one).
            self.model = copy.deepcopy(self.model)
            for module in self.model.modules():
                if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                    module.to(self._precision.autocast_dtype)
        self.traced = traced and self._session is None
        if self.traced:
            self.model = _traced(_Standardized(self.model, self.mean, self.std), self.device, self._precision)

    @classmethod
    def load(cls, path: str | Path, backend: str = "auto", device: str = "auto", verify: bool = True,
             traced: bool = False) -> "Classifier":
        """A version name ("A", or "C" for ./cifar10_models/version_C), a release folder, a run folder or a
        .safetensors file written by cifarkit (see `release_dir`).

        A release's weights, and the model.onnx it may hold, are used only if their sha256s are the ones its
        metrics.json records (checked before anything is loaded); verify=False skips that check. Weights without a
        metrics.json load unverified, with a warning, and `auto` means torch-fp32 for them. `device` auto is CUDA,
        then MPS, then the CPU (`device="cpu"` keeps a process off its GPU). `auto` is decided for that device on this
        machine (see `cifarkit.inference.backends`), and logged with its reason.
        """
        path = release_dir(path)
        folder, weights = (path, path / WEIGHTS_NAME) if path.is_dir() else (path.parent, path)
        # metrics.json describes its folder's model.safetensors and nothing else
        info = read_metrics(folder) if weights == folder / WEIGHTS_NAME else None
        if info is None:
            log.warning("%s is not verified: no %s records its sha256 (backend auto means torch-fp32)", weights,
                        METRICS_NAME)
        sha = weights_sha256(weights, info, verify)
        model, meta = load_weights(weights)
        info = info or {}
        choice = None
        if backend == "auto":
            where = pick_device(device)
            choice = backends.choose(info, where.type)
            backend = choice.backend
            log.info("backend auto on %s: %s for %s (%s)", where, backend, folder.name, choice.reason)
        onnx = None
        if backend == "onnxruntime":
            onnx = _release_onnx(folder, info, sha, verify) or _cached_onnx(model, sha)
        classifier = cls(model, meta["mean"], meta["std"], backend=backend, device=device, onnx=onnx, info=info,
                         traced=traced)
        classifier.weights_sha256 = sha
        classifier.backend_choice = choice or classifier.backend_choice
        return classifier

    @classmethod
    def pretrained(cls, version: str = DEFAULT_VERSION, backend: str = "auto", verify: bool = True,
                   device: str = "auto") -> "Classifier":
        """A release shipped inside the package (no download): version A by default, on `device` as `load` takes it."""
        folder = SHIPPED / f"version_{version}"
        if not folder.is_dir():
            raise CifarkitError(f"no shipped release {version!r}; shipped: {', '.join(versions(SHIPPED)) or 'none'}")
        return cls.load(folder, backend=backend, device=device, verify=verify)

    def logits(self, pixels: np.ndarray) -> torch.Tensor:
        """N x 32 x 32 x 3 uint8 -> N x 10 float32 logits on the CPU."""
        if self.traced:  # one call into the graph, which standardizes too: each torch call from here waits for the GIL
            x = torch.from_numpy(pixels)
            with torch.inference_mode():
                logits = self.model(x if self.device.type == "cpu" else x.to(self.device))
            return logits if self.device.type == "cpu" else logits.cpu()
        inputs = preprocess.normalize(pixels, self.mean, self.std)
        if self._session is not None:
            return torch.from_numpy(self._session.run(None, {"image": inputs})[0]).float()
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

    def prediction(self, image, k: int = 5) -> dict:
        """The answer `cifarkit predict --json` and the HTTP API give for one image (see `prediction`)."""
        if not 1 <= k <= len(self.classes):
            raise ValueError(f"k must be between 1 and {len(self.classes)}, got {k}")
        probabilities = self.predict_proba(image)
        return prediction(probabilities, np.argsort(-probabilities, kind="stable"), self.classes, k)

    def topk(self, image, k: int = 5) -> list[tuple[str, float]]:
        return [(best["label"], best["confidence"]) for best in self.prediction(image, k)["topk"]]


def prediction(probabilities, ranked, classes, k: int) -> dict:
    """One image's answer, the same in the Python API, `cifarkit predict --json` and HTTP: the best class's `label`,
    `class_index` (0-9) and `confidence`, and as `topk` the `k` best classes with the same three keys, best first.
    `ranked`: the class indices by falling probability."""
    best = [{"label": classes[i], "class_index": int(i), "confidence": float(probabilities[i])} for i in ranked[:k]]
    return {**best[0], "topk": best}


class _Standardized(torch.nn.Module):
    """N x 32 x 32 x 3 uint8 pixels -> float32 logits: preprocess.normalize's arithmetic in torch, then the model."""

    def __init__(self, model: torch.nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # The permuted view is channels-last in memory, the layout the model runs in.
        return self.model((pixels.permute(0, 3, 1, 2).float() / 255 - self.mean) / self.std).float()


def _traced(model: torch.nn.Module, device: torch.device, precision) -> torch.jit.ScriptModule:
    """The model as a TorchScript graph, traced on a sample batch: the same operations on the same weights (autocast's
    casts included), so the same logits bit for bit, for any batch size (tests/test_inference.py). What it buys is
    the GIL: eager mode takes it back after every layer, and waits for it whenever another Python thread is busy,
    as a server's event loop is (results/gil-stall.json). TorchScript is deprecated in favour of torch.export with
    AOTInductor, whose C++ compilation delays a server's start and whose frozen graph changed the logits in their
    last bits (docs/serving.md). On a GPU too: the traced graph runs cuDNN's convolutions, as eager mode does, with
    nothing to compile, while torch.compile would compile each batch shape the server pads to before it could
    answer, for a gain nothing here has measured."""
    sample = torch.zeros(2, preprocess.SIZE, preprocess.SIZE, 3, dtype=torch.uint8, device=device)
    with warnings.catch_warnings(), torch.inference_mode(), autocast(device, precision, cache=False):
        warnings.filterwarnings("ignore", "`torch.jit.trace", FutureWarning)
        return torch.jit.trace(model.to(device), sample, check_trace=False)


def _release_onnx(folder: Path, info: dict, weights_sha: str, verify: bool) -> Path | None:
    """The release's own model.onnx, if it has one; verified, it must be the export recorded for these weights."""
    path = folder / ONNX_NAME
    if not path.exists():
        return None
    if verify and info:
        record = info.get("exports", {}).get("onnx", {})
        if record.get("weights_sha256") != weights_sha or record.get("sha256") != file_digest(path, "sha256"):
            raise CifarkitError(f"{path} is not the ONNX export {METRICS_NAME} records for these weights; write it "
                                f"again with `cifarkit export {folder} --format onnx`, or delete it, or {UNVERIFIED}")
    return path


def _cached_onnx(model: torch.nn.Module, weights_sha: str) -> Path | bytes:
    """Releases ship without model.onnx (it would double their size): the first onnxruntime load exports one into
    the cache and later loads reuse it. The name holds the weights' sha256 (which model) and the file's own (so a
    damaged copy is recognised, and exported again). A cache that cannot be written (read-only or missing home,
    full disk) costs the reuse, never the prediction: the export then runs from memory."""
    folder = home() / "onnx"
    key = weights_sha[:32]
    for path in folder.glob(f"{key}.*.onnx"):
        with suppress(OSError):
            if path.name == f"{key}.{file_digest(path, 'sha256')[:16]}.onnx":
                return path
        log.warning("the cached ONNX model %s is damaged or unreadable; exporting it again", path)
        with suppress(OSError):
            path.unlink()
    log.info("exporting the ONNX model once into the cache %s (later loads reuse it)...", folder)
    serialized = runtime.onnx_bytes(model)
    path = folder / f"{key}.{hashlib.sha256(serialized).hexdigest()[:16]}.onnx"
    try:
        write_bytes(path, serialized)
    except OSError as e:
        log.warning("cannot cache the ONNX model (%s); running it from memory", describe_os_error(e))
        return serialized
    return path


class CIFAR10Classifier(Classifier):
    """The seed's interface: CIFAR10Classifier(version='A').predict(image) -> class index. `root` is the folder of
    the user's version_* releases (./cifar10_models, where the seed kept them, by default); a version it lacks is
    taken from the shipped releases, as `cifarkit predict --model NAME` does."""

    def __init__(self, version: str = DEFAULT_VERSION, root: str | Path | None = None, backend: str = "auto",
                 verify: bool = True, device: str = "auto"):
        loaded = Classifier.load(release_dir(version, root, accepts="a release folder"), backend=backend,
                                 device=device, verify=verify)
        self.__dict__.update(loaded.__dict__)
