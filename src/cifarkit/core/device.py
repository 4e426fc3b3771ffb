"""Device and precision choice, and the environment report printed at the start of every run."""
from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from cifarkit.core import allocator
from cifarkit.core.errors import CifarkitError


def pick_device(preference: str = "auto") -> torch.device:
    """auto: CUDA, then Apple MPS, then the CPU. An explicit choice that is not available is an error."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if preference == "auto":
        return torch.device(next(name for name, ok in available.items() if ok))
    if preference not in available:
        raise CifarkitError(f"unknown device {preference!r}; choose from auto, cuda, mps, cpu")
    if not available[preference]:
        raise CifarkitError(f"device {preference!r} is not available here; use --device auto or --device cpu")
    return torch.device(preference)


# x86 instruction sets that set a CPU's training speed, as torch's CPU probe reports them (cifarkit env prints them):
# a speed figure is read against them, and the model name ("Intel(R) Xeon(R) Processor") often does not tell.
X86_FEATURES = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
                "avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported"}


# oneDNN computes with no instruction set above ONEDNN_MAX_CPU_ISA (its documented cap, which also imitates an older
# CPU on a newer one): the X86_FEATURES it may still use under each cap, by the cap's prefix, longest first.
ONEDNN_ISA_CAPS = {
    "AVX512_CORE_AMX": ("avx2", "avx512", "avx512_bf16", "amx"),
    "AVX512_CORE_FP16": ("avx2", "avx512", "avx512_bf16"),
    "AVX512_CORE_BF16": ("avx2", "avx512", "avx512_bf16"),
    "AVX512": ("avx2", "avx512"),
    "AVX2": ("avx2",),
    "AVX": (),
    "SSE": (),
}


# The variables that cap the instruction sets torch computes with, to imitate an older CPU on a newer one: oneDNN's
# (which cpu_features also honours) and ATen's vectorized kernels'. A figure taken under them is not this CPU's.
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def isa_caps() -> dict[str, str]:
    """The ISA_CAP_VARIABLES set in this process's environment, by name."""
    return {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}


def caps_text(caps: dict[str, str]) -> list[str]:
    """`isa_caps()` as the words a report or a table shows beside the CPU's features."""
    return [f"capped by {name}={value}" for name, value in caps.items()]


def cpu_features() -> list[str]:
    """The X86_FEATURES this CPU has, less those above ONEDNN_MAX_CPU_ISA where it is set; [] elsewhere (an Arm CPU's
    bf16 shows in cpu_has_bf16 alone)."""
    if not is_x86():
        return []
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    allowed = next((features for prefix, features in ONEDNN_ISA_CAPS.items() if cap.startswith(prefix)), None)
    return [name for name, probe in X86_FEATURES.items()
            if getattr(torch.cpu, probe)() and (allowed is None or name in allowed)]


def cpu_has_bf16(features: list[str] | None = None) -> bool:
    """True when the CPU computes bf16 natively: AVX512-BF16 or AMX on x86, the BF16 extension on Arm. `features`:
    an x86 CPU's, as cpu_features() gives them (default: this CPU's).

    oneDNN's own check (`_is_mkldnn_bf16_supported`) also says yes on x86 CPUs with plain AVX-512, where it emulates
    bf16 and trains at a fraction of fp32's speed (an Ice Lake Xeon, AVX-512 without BF16, ran bf16+cl at about a
    third of fp32+cl's img/s in `cifarkit bench --modes fp32+cl bf16+cl`).
    """
    if features is not None or is_x86():
        return bool({"avx512_bf16", "amx"} & set(cpu_features() if features is None else features))
    with contextlib.suppress(Exception):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def cuda_has_bf16(index: int | None = None) -> bool:
    """True when CUDA device `index` (default the current one) computes bf16 natively: compute capability 8.0
    (Ampere) or later. `torch.cuda.is_bf16_supported()` also says yes on older cards (T4, V100, RTX 20), where bf16
    runs emulated, far slower than fp16; the same fault cpu_has_bf16 avoids on CPUs without AVX512-BF16."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).major >= 8


def machine_name() -> str:
    return platform.machine().lower()


def is_x86() -> bool:
    return machine_name() in ("x86_64", "amd64", "i686", "i386")


# Most capable first: the first feature a CPU has names its kind (speed figures are comparable within a kind).
CPU_KINDS = ("amx", "avx512_bf16", "avx512", "avx2")


def cpu_kind(features: list[str] | None = None) -> str:
    """The CPU's kind for speed tables: its most capable x86 feature of CPU_KINDS; else the machine's name."""
    features = cpu_features() if features is None else features
    return next((kind for kind in CPU_KINDS if kind in features), machine_name())


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    autocast_dtype: torch.dtype | None
    grad_scaler: bool  # fp16's narrow exponent needs loss scaling; bf16 has fp32's range and does not


PRECISIONS = {
    "fp32": Precision("fp32", None, False),
    "bf16": Precision("bf16", torch.bfloat16, False),
    "fp16": Precision("fp16", torch.float16, True),
}


def pick_precision(preference: str, device: torch.device) -> Precision:
    """auto: bf16 where the device computes it natively (CUDA from Ampere on, CPUs with AVX512-BF16 or AMX), fp16 +
    GradScaler on older GPUs, else fp32 (MPS included, the safe choice). On a GPU with both, bf16 is as fast on the
    tensor cores and needs no loss scaling, whose overflow check waits for the GPU in every step; and it is the
    precision the CPUs train in, so accuracy measured on one carries to the other."""
    if preference == "auto":
        if device.type == "cuda":
            return PRECISIONS["bf16" if cuda_has_bf16(device.index) else "fp16"]
        if device.type == "cpu" and cpu_has_bf16():
            return PRECISIONS["bf16"]
        return PRECISIONS["fp32"]
    if preference not in PRECISIONS:
        raise CifarkitError(f"unknown precision {preference!r}; choose from auto, fp32, bf16, fp16")
    problem = precision_problem(preference, device)
    if problem:
        raise CifarkitError(f"{problem}; use --precision bf16 or fp32")
    return PRECISIONS[preference]


def precision_problem(name: str, device: torch.device) -> str | None:
    """Why precision `name` cannot train on `device`, or None; each command adds the way out its options offer."""
    if name == "fp16" and device.type == "cpu":
        return "fp16 autocast is not supported for training on the CPU"
    return None


def autocast(device: torch.device, precision: Precision, cache: bool = True):
    """`cache=False` while tracing: a cast that autocast caches would be missing from the traced graph."""
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.autocast_dtype, cache_enabled=cache)


def configure(device: torch.device, cudnn_benchmark: bool = True) -> None:
    """`cudnn_benchmark=False` only to measure what the autotuning gains (`cifarkit bench --no-cudnn-benchmark`)."""
    if device.type == "cuda":
        # Fixed input shapes make cuDNN's autotuner pay off after the first few steps.
        torch.backends.cudnn.benchmark = cudnn_benchmark


def report(device: torch.device | None = None) -> dict:
    """What a bug report or a benchmark needs to be read: hardware, library versions and the numeric settings."""
    cpu = first_cpu_info()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": _cpu_name(cpu),
        "cpu_model": cpu_model(cpu),
        "threads": torch.get_num_threads(),
        "memory_gib": _system_memory_gib(),
        "allocator": allocator.in_use(),
        "cpu_bf16": cpu_has_bf16(),
        "cpu_features": cpu_features(),
        "isa_caps": isa_caps(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "mps_available": torch.backends.mps.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    if device is not None:
        info["device"] = str(device)
    return info


def _system_memory_gib() -> float | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return None


def first_cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of Linux's /proc/cpuinfo; empty elsewhere."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_name(cpu: dict[str, str]) -> str:
    return cpu.get("model name") or platform.processor() or platform.machine()


def cpu_model(cpu: dict[str, str]) -> str | None:
    """An x86 CPU's family and model numbers, from its `first_cpu_info`. Virtual machines often name every AMD EPYC
    alike, while Zen 3, 4 and 5 (families 25 and 26) differ in speed within one CPU kind: Zen 4 runs AVX-512 on
    256-bit units, Zen 5 on 512-bit."""
    if "cpu family" not in cpu or "model" not in cpu:
        return None
    return f"family {cpu['cpu family']} model {cpu['model']}"


def cudnn_text(version: int | None) -> str:
    """torch's cuDNN version number as people write it: 90100 -> 9.1.0 (cuDNN 9), 8902 -> 8.9.2 (cuDNN 8)."""
    if version is None:
        return "none"
    if version >= 90000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def describe(info: dict) -> list[str]:
    """The report as short human-readable lines."""
    details = [info["cpu_model"]] if info.get("cpu_model") else []
    details += info.get("cpu_features") or []
    details += caps_text(info.get("isa_caps") or {})
    cpu_details = f" ({', '.join(details)})" if details else ""
    lines = [f"torch {info['torch']} on Python {info['python']}, {info['platform']}",
             f"CPU: {info['processor']}{cpu_details}, {info['threads']} threads, {info['memory_gib']} GiB RAM, "
             f"native bf16: {'yes' if info['cpu_bf16'] else 'no'}, memory allocator: {info['allocator']}"]
    cudnn = cudnn_text(info["cudnn_version"])
    if info["gpus"]:
        gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in info["gpus"])
        lines.append(f"CUDA {info['cuda_version']}, cuDNN {cudnn} "
                     f"(enabled: {info['cudnn_enabled']}), {len(info['gpus'])} GPU(s): {gpus}")
    else:
        lines.append(f"CUDA: none available (torch built with CUDA {info['cuda_version']}, cuDNN {cudnn}); "
                     f"MPS: {'yes' if info['mps_available'] else 'no'}")
    if "device" in info:
        lines.append(f"device: {info['device']}")
    return lines
