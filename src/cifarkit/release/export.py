"""`cifarkit export`: ONNX, torch.export, TorchScript and TensorRT artifacts of a release, each checked against
PyTorch.

An artifact lands only after it matches the eager fp32 model on real test images: max abs logit difference <= 1e-3
and top-1 agreement >= 99.9% (the fp16 TensorRT engine: within its own `limits`). Into a release of the user's, it
is recorded in the release's metrics.json: the check, the artifact's sha256 and the sha256 of the weights it was
made from, so a stale or swapped artifact is recognised later. A release shipped inside the package is never
written to (an installed package may be read-only, and is not the user's to change): its artifact goes to `out`,
the current folder by default, with the record beside it.
"""
from __future__ import annotations

import copy
import logging
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from cifarkit.artifacts import preprocess, weights
from cifarkit.artifacts.releases import (
    METRICS_NAME,
    ONNX_NAME,
    SHIPPED,
    WEIGHTS_NAME,
    read_metrics,
    release_dir,
    weights_sha256,
)
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import atomic_path, file_digest, write_json
from cifarkit.inference import runtime
from cifarkit.inference.backends import ACCURACY_RULE
from cifarkit.inference.runtime import CPU, DYNAMIC_BATCH, example_input, onnx_bytes, run_artifact

log = logging.getLogger(__name__)

FILES = {"onnx": ONNX_NAME, "exported": "model.pt2", "torchscript": "model.torchscript.pt", "tensorrt": "model.plan"}
PARITY_IMAGES = 512
MAX_ABS_DIFF = 1e-3  # fp32 against fp32: only kernel-order rounding may differ
MIN_TOP1_AGREEMENT = 0.999
# The TensorRT engine computes in fp16, whose 11 significant bits move every logit: the bound is loose enough for
# fp16's rounding through the whole network and far below what a broken engine gives, and the agreement is the one
# that admits a half-precision backend (backends.ACCURACY_RULE).
FP16_MAX_ABS_DIFF = 0.05
# The engine's one batch size (a smaller batch runs padded): the chunk `Classifier.predict_batch` sends, and the
# batch at which releases record their throughput.
TENSORRT_BATCH = 256


def write_onnx(model: torch.nn.Module, path: Path) -> None:
    Path(path).write_bytes(onnx_bytes(model))


def _write_exported(model: torch.nn.Module, path: Path) -> None:
    torch.export.save(torch.export.export(model, example_input(), dynamic_shapes=DYNAMIC_BATCH), str(path))


def _write_torchscript(model: torch.nn.Module, path: Path) -> None:
    torch.jit.save(torch.jit.trace(model, example_input()), str(path))


class _Fp16(torch.nn.Module):
    """The model in fp16 between fp32 input and output. TensorRT builds a strongly typed network, computing in the
    ONNX graph's own types (TensorRT 11 removed the FP16 builder flag with which 10 chose per layer), so the casts
    are written into the graph."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = copy.deepcopy(model).half()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.half()).float()


def _write_tensorrt(model: torch.nn.Module, path: Path) -> None:
    """A serialized fp16 TensorRT engine for this machine's kind of GPU, of batch TENSORRT_BATCH: what
    `trtexec --onnx=model.onnx --fp16` makes of the ONNX export."""
    trt = runtime.tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # TensorRT 10; 11: always
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes(_Fp16(model).eval(), batch=TENSORRT_BATCH)):
        problems = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise CifarkitError(f"TensorRT cannot read the ONNX export ({problems}); nothing was written")
    engine = builder.build_serialized_network(network, builder.create_builder_config())
    if engine is None:
        raise CifarkitError("TensorRT could not build the engine (its messages above say why); nothing was written")
    Path(path).write_bytes(engine)


def _gpu() -> torch.device:
    """This machine's CUDA GPU, or the refusal that says where to build an engine instead."""
    if not torch.cuda.is_available():
        raise CifarkitError("a TensorRT engine is built on the kind of GPU that will run it, and torch sees no CUDA "
                            "GPU here; export it on that machine, or use --format onnx here")
    return torch.device("cuda", torch.cuda.current_device())


def _engine_target() -> tuple[torch.device, dict]:
    """The GPU a TensorRT engine is built and checked on, and what its record says of the engine, which runs only
    with the TensorRT version and on the kind of GPU that built it. A missing GPU or TensorRT is refused here,
    before any work."""
    gpu = _gpu()
    return gpu, {"precision": "fp16", "batch_size": TENSORRT_BATCH, "gpu": torch.cuda.get_device_name(gpu),
                 "tensorrt": runtime.tensorrt().__version__}


def limits(fmt: str) -> dict:
    """The parity check's limits for an artifact of `fmt`, against the eager fp32 model."""
    if fmt == "tensorrt":
        return {"max_abs_logit_diff": FP16_MAX_ABS_DIFF, "top1_agreement": ACCURACY_RULE["min_top1_agreement"]}
    return {"max_abs_logit_diff": MAX_ABS_DIFF, "top1_agreement": MIN_TOP1_AGREEMENT}


def parity(model: torch.nn.Module, run, images: np.ndarray) -> dict:
    """Compare `run` with the eager fp32 model on normalized images (N x 3 x 32 x 32 float32)."""
    with torch.inference_mode():
        expected = model(torch.from_numpy(images)).numpy()
    got = run(images)
    return {"images": len(images), "max_abs_logit_diff": float(np.abs(got - expected).max()),
            "top1_agreement": float((got.argmax(1) == expected.argmax(1)).mean())}


def parity_images(count: int, mean, std) -> np.ndarray:
    """The first `count` real test images, normalized."""
    from cifarkit.data import (
        cifar10,  # the training side's data set, imported here alone: serving never needs it
        )
    dataset = cifar10.load()
    pixels = dataset.test_x[:count].permute(0, 2, 3, 1).numpy()
    return preprocess.normalize(pixels, mean, std)


def record(fmt: str, path: Path, weights_sha: str) -> dict:
    """What a release's metrics.json keeps about an artifact: its file, its sha256 and the weights it was made from."""
    return {"format": fmt, "file": path.name, "size_bytes": path.stat().st_size,
            "sha256": file_digest(path, "sha256"), "weights_sha256": weights_sha, "torch": str(torch.__version__)}


def export(release: str | Path, fmt: str, out: str | Path | None = None) -> dict:
    """Write the `fmt` artifact of a release (a version name or a release folder), checked against PyTorch: into the
    release, recorded in its metrics.json; or, with `out` and for a shipped release, into the folder `out` (default:
    the current folder), recorded beside it in `<artifact>.json`. The report says where (`path`)."""
    if fmt not in FILES:
        raise CifarkitError(f"unknown export format {fmt!r}; choose from {', '.join(FILES)}")
    release = release_dir(release, accepts="a release folder")
    # The artifact is recorded in the release's metrics.json, so a run folder or a bare weights file will not do.
    metrics = read_metrics(release) if release.is_dir() else None
    if metrics is None:
        raise CifarkitError(f"{release} is not a release folder (no {METRICS_NAME}); make one with `cifarkit release "
                            f"RUN_DIR --name NAME` and export that")
    weights_sha = weights_sha256(release / WEIGHTS_NAME, metrics)  # never export (and bless) damaged weights
    where, built = _engine_target() if fmt == "tensorrt" else (CPU, {})
    bounds = limits(fmt)
    model, meta = weights.load_weights(release)
    if out is None:
        out = Path() if release.resolve().is_relative_to(SHIPPED.resolve()) else release
    out = Path(out)
    into_release = out.resolve() == release.resolve()
    target = out / FILES[fmt]
    writer = {"onnx": write_onnx, "exported": _write_exported, "torchscript": _write_torchscript,
              "tensorrt": _write_tensorrt}[fmt]
    images = parity_images(PARITY_IMAGES, meta["mean"], meta["std"])
    log.info("exporting %s as %s and checking it against PyTorch on %d test images...", release, fmt, len(images))
    created = [folder for folder in (out, *out.parents) if not folder.exists()]
    try:
        with atomic_path(target) as tmp, _torchscript_deprecation():
            writer(model, tmp)
            check = parity(model, run_artifact(fmt, tmp, where), images)
            if check["max_abs_logit_diff"] > bounds["max_abs_logit_diff"] or \
                    check["top1_agreement"] < bounds["top1_agreement"]:
                raise CifarkitError(f"{fmt} export failed its parity check ({_describe(check, bounds)}); nothing was "
                                    f"written")
    except BaseException:
        # "Nothing was written" holds for the folders too: those this export made go, innermost first.
        for folder in created:
            with suppress(OSError):
                folder.rmdir()
        raise
    report = {**record(fmt, target, weights_sha), **built, **check, "limits": bounds}
    if into_release:
        metrics.setdefault("exports", {})[fmt] = report
        if "files" in metrics:  # releases written before the manifest existed have none to update
            metrics["files"][target.name] = report["sha256"]
        write_json(release / METRICS_NAME, metrics)
    else:
        write_json(out / f"{target.name}.json", {"release": metrics.get("release", release.name), **report})
    return {**report, "path": str(target)}


@contextmanager
def _torchscript_deprecation():
    """torch warns that TorchScript is deprecated at each of jit.trace, trace_method, save and load, in words about
    its own functions: say it once, in ours, and pass any other warning on."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # also resets the "once" registries: every export says it
            yield
    finally:  # outside catch_warnings, where showwarning shows again instead of recording
        deprecated = [w for w in caught if issubclass(w.category, FutureWarning) and "torch.jit" in str(w.message)]
        if deprecated:
            log.warning("TorchScript is deprecated in the installed torch %s; prefer --format exported "
                        "(torch.export)", torch.__version__)
        for w in caught:
            if w not in deprecated:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _describe(check: dict, bounds: dict) -> str:
    return (f"max abs logit difference {check['max_abs_logit_diff']:.2e} (limit {bounds['max_abs_logit_diff']:g}), "
            f"top-1 agreement {100 * check['top1_agreement']:.2f}% (limit {100 * bounds['top1_agreement']:g}%) on "
            f"{check['images']} images")
