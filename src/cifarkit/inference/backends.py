"""What `backend="auto"` means on the machine that runs the model, not on the one that made the release.

Two questions, answered apart:
1. Which backends give the release's answers? A release records, per backend, its test accuracy and its top-1
   agreement with fp32 (`cifarkit release` measures both on the 10,000 test images); `ACCURACY_RULE` admits a
   backend whose accuracy is within 0.1 points of fp32's and whose predictions agree with fp32's on 99.5% of them.
   bf16 kernels round differently on each CPU kind, so the figures measured on this CPU's kind
   (`accuracy_by_cpu_kind`) are judged where a release holds them, else those of the machine that made it.
   On a GPU, fp16 and bf16 are admitted only by figures measured on that kind of device (`accuracy_by_cpu_kind`
   under "cuda" or "mps", which `lab/measure_release_backends.py --device cuda` writes): figures from a CPU say
   nothing of how cuDNN's kernels round, so without them a GPU runs fp32, and the reason says why.
2. Which admitted backend is fastest here? bf16 only where this CPU computes it natively (AVX512-BF16 or AMX, the
   BF16 extension on Arm), or where the GPU does (CUDA compute capability 8.0 or later): elsewhere it is emulated,
   many times slower than fp32. Then the release's own speed table for this kind of device (`speed_by_cpu_kind`),
   when one was measured on such a device; else the capability order `FALLBACK_ORDER`.
Each choice carries its reason, which `Classifier` logs and the server shows.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cifarkit.core import device
from cifarkit.core.device import CPU_KINDS, cpu_kind  # noqa: F401  (in core: the training side records it too)

# The backends of a CPU, each of which `cifarkit release` measures on the CPU that makes the release.
BACKENDS = ("torch-fp32", "torch-bf16", "onnxruntime")
# fp16 runs on GPUs alone: CPUs without AVX512-FP16 or AMX-FP16 emulate it, slower still than emulated bf16.
GPU_BACKENDS = ("torch-fp32", "torch-bf16", "torch-fp16", "onnxruntime")
PRECISION = {"torch-fp32": "fp32", "torch-bf16": "bf16", "torch-fp16": "fp16"}  # onnxruntime: the ONNX model's fp32
REFERENCE = "torch-fp32"  # the model as trained: every other backend is judged against its predictions
ACCURACY_RULE = {"max_accuracy_gap": 0.001, "min_top1_agreement": 0.995}
# A release made before accuracies were recorded per backend: 99.9% agreement bounds the accuracy gap by 0.1 points
# on its own, so such a backend meets the rule without a recorded accuracy.
AGREEMENT_ALONE = 0.999
# Where no speed was measured on this CPU kind: native bf16 first, then ONNX Runtime, which was at least as fast as
# torch-fp32 on every CPU kind measured (each release's speed_by_cpu_kind).
FALLBACK_ORDER = ("torch-bf16", "onnxruntime", "torch-fp32")
# On a GPU with no speed measured: fp16 first (the same tensor-core speed as bf16 with 3 more bits of mantissa). ONNX
# Runtime is never `auto` there: whether it reaches the GPU depends on the onnxruntime package installed
# (onnxruntime-gpu), which no release's figures can promise; asked for by name, it says which provider runs it.
GPU_FALLBACK_ORDER = ("torch-fp16", "torch-bf16", "torch-fp32")
# Backends are ranked by the geometric mean of their img/s over the batch sizes measured (1 and 256): a server
# answers lone requests and full batches, and a backend fast at one and slow at the other serves neither well.


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    cpu_kind: str  # the kind of device whose figures were judged: a CPU kind (backends.CPU_KINDS), "cuda" or "mps"

    def as_dict(self) -> dict:
        return asdict(self)


def device_kind(device_type: str = "cpu", features: list[str] | None = None) -> str:
    """The kind of device a release's figures are kept by: a CPU's kind (`cpu_kind`), else the device's type."""
    return cpu_kind(features) if device_type == "cpu" else device_type


def unavailable(backend: str, device_type: str) -> str | None:
    """Why `backend` cannot run on a device of `device_type`, with the way out, or None."""
    if device_type == "cpu" and backend not in BACKENDS:
        return (f"backend {backend} runs on a GPU only: CPUs emulate fp16, many times slower than fp32; on the CPU "
                f"choose torch-bf16 (where it is native), torch-fp32 or onnxruntime")
    return None


def accuracy_figures(inference: dict, kind: str) -> tuple[dict, str]:
    """The accuracy rule's figures to judge on a device of `kind`: (the inference table holding test_acc_by_backend
    and top1_agreement_with_fp32, where they were measured)."""
    if kind in inference.get("accuracy_by_cpu_kind", {}):
        return inference["accuracy_by_cpu_kind"][kind], f"measured on {kind}"
    # The release's own figures: measured where it was made, or where they were last measured again.
    measured = inference.get("test_acc_by_backend_measured", {}).get("cpu_kind") or inference.get("cpu_kind")
    return inference, f"measured on {measured}" if measured else "measured where the release was made"


def refusals(figures: dict, candidates: tuple[str, ...] = BACKENDS) -> dict[str, str]:
    """backend -> why ACCURACY_RULE refuses it, for each of `candidates` that fails the rule on `figures` (from
    `accuracy_figures`)."""
    agreement = figures.get("top1_agreement_with_fp32", {})
    accuracy = figures.get("test_acc_by_backend", {})
    refused = {}
    for backend in candidates:
        if backend == REFERENCE:
            continue
        if backend not in agreement:
            refused[backend] = "its agreement with fp32 is not recorded"
            continue
        if agreement[backend] < ACCURACY_RULE["min_top1_agreement"]:
            refused[backend] = (f"it agrees with fp32 on {100 * agreement[backend]:.2f}% of the test images "
                                f"(rule: {100 * ACCURACY_RULE['min_top1_agreement']:g}%)")
        elif backend in accuracy and REFERENCE in accuracy:
            gap = abs(accuracy[backend] - accuracy[REFERENCE])
            if gap > ACCURACY_RULE["max_accuracy_gap"] + 1e-9:
                refused[backend] = (f"its test accuracy is {100 * gap:.2f} points from fp32's "
                                    f"(rule: {100 * ACCURACY_RULE['max_accuracy_gap']:g})")
        elif agreement[backend] < AGREEMENT_ALONE:
            refused[backend] = "its test accuracy is not recorded, and its agreement alone does not bound the gap"
    return refused


def speed_tables(inference: dict) -> dict[str, list[dict]]:
    """kind -> the throughput rows measured on a device of that kind, from every speed table the release holds."""
    tables = {kind: table["throughput"] for kind, table in inference.get("speed_by_cpu_kind", {}).items()}
    if "throughput" in inference and inference.get("cpu_kind"):
        tables.setdefault(inference["cpu_kind"], inference["throughput"])
    return tables


def measured_speeds(inference: dict) -> dict[str, dict[str, float]]:
    """kind -> backend -> the geometric mean of its img/s over the batch sizes measured."""
    speeds = {}
    for kind, table in speed_tables(inference).items():
        by_backend: dict[str, list[float]] = {}
        for row in table:
            by_backend.setdefault(row["backend"], []).append(row["images_per_s"])
        speeds[kind] = {backend: math.prod(values) ** (1 / len(values)) for backend, values in by_backend.items()}
    return speeds


def choose(info: dict | None, device_type: str = "cpu", features: list[str] | None = None) -> Choice:
    """The backend `auto` means for the release described by `info` (its metrics.json; None for bare weights) on
    this machine's device of `device_type`. `features`: an x86 CPU's, default this CPU's (tests give others')."""
    kind = device_kind(device_type, features)
    inference = (info or {}).get("inference")
    if not inference:
        return Choice(REFERENCE, "no metrics.json records how other backends compare with fp32", kind)
    figures, measured_where = accuracy_figures(inference, kind)
    if device_type == "cpu":
        candidates, fallback, place = BACKENDS, FALLBACK_ORDER, f"a CPU of this kind ({kind})"
        refused = refusals(figures, candidates)
        if not device.cpu_has_bf16(features):
            refused.setdefault("torch-bf16", "this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 is emulated")
    elif kind not in inference.get("accuracy_by_cpu_kind", {}):
        return Choice(REFERENCE, f"fp32: the release's accuracy figures were {measured_where}, none on {kind}, and "
                                 f"fp16 and bf16 round differently there, so only figures measured on {kind} admit "
                                 f"them (lab/measure_release_backends.py --device {kind})", kind)
    else:
        candidates, fallback, place = GPU_FALLBACK_ORDER, GPU_FALLBACK_ORDER, kind
        refused = refusals(figures, candidates)
        if not (device_type == "cuda" and device.cuda_has_bf16()):
            refused.setdefault("torch-bf16", "this GPU has no native bf16 (CUDA compute capability 8.0 or later), "
                                             "so bf16 is emulated")
    admitted = [b for b in candidates if b not in refused]
    speeds = measured_speeds(inference).get(kind, {})
    ranked = [b for b in admitted if b in speeds]
    if ranked:
        best = max(ranked, key=speeds.get)
        reason = f"fastest on {place}: {speeds[best]:,.0f} img/s, the geometric mean over the batch sizes measured"
    else:
        best = next(b for b in fallback if b in admitted)
        reason = f"no speed measured on {place}; first of {', '.join(fallback)} that is admitted"
    if refused:
        reason += "; not " + "; not ".join(f"{b}: {why}" for b, why in refused.items())
    return Choice(best, f"{reason}; accuracy rule on the figures {measured_where}", kind)
