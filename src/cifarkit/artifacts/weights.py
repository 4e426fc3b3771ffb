"""Atomic save and load of bare weights, for use: safetensors files whose metadata names the model and its
preprocessing, so they rebuild alone."""
from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cifarkit import models
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import write_bytes

METADATA_KEY = "cifarkit"
WEIGHT_DTYPES = ("fp32", "fp16", "int8")
# Beside each int8 tensor, its per-output-channel scales under this suffix; load_weights multiplies them back.
INT8_SCALE_SUFFIX = ".int8_scale"


def save_weights(path: Path, model: torch.nn.Module, model_name: str, mean, std, weights_dtype: str = "fp32",
                 **info) -> None:
    """Weights plus what inference needs to rebuild and feed the model, in the file's own metadata.

    The metadata is one key holding sorted JSON: safetensors writes a metadata map in no fixed order, so several
    keys would make equal weights give files (and sha256s) that differ from run to run.
    """
    tensors = _stored({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, weights_dtype)
    described = {"model": model_name, "mean": list(mean), "std": list(std), **info}
    if weights_dtype == "int8":
        described["quantized"] = "int8, symmetric, one scale per output channel, for every tensor of 2+ dimensions"
    # In memory first, as training.checkpoint.save_training does: a full disk must raise OSError, not a
    # SafetensorError.
    write_bytes(path, safetensors.torch.save(tensors, metadata={METADATA_KEY: json.dumps(described, sort_keys=True)}))


def _stored(tensors: dict[str, torch.Tensor], weights_dtype: str) -> dict[str, torch.Tensor]:
    """The state_dict as the file keeps it. int8 applies to filters and the head, which are nearly all the bytes:
    each rounds to 1/254 of its output channel's largest magnitude. Vectors (BatchNorm statistics and shifts,
    biases) are a few KB and stay fp32; integer buffers are kept as they are."""
    if weights_dtype not in WEIGHT_DTYPES:
        raise CifarkitError(f"weights dtype {weights_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    stored = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            stored[name] = tensor
        elif weights_dtype == "fp16":
            stored[name] = tensor.half()
        elif weights_dtype == "int8" and tensor.ndim >= 2:
            tensor = tensor.float()
            largest = tensor.abs().amax(dim=tuple(range(1, tensor.ndim)))
            scale = largest.clamp_min(torch.finfo(torch.float32).tiny) / 127
            stored[name] = (tensor / _per_channel(scale, tensor.ndim)).round().clamp(-127, 127).to(torch.int8)
            stored[name + INT8_SCALE_SUFFIX] = scale
        else:
            stored[name] = tensor.float()
    return stored


def _per_channel(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    return scale.view(-1, *[1] * (ndim - 1))


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scaled = [name for name in tensors if name.endswith(INT8_SCALE_SUFFIX)]
    for scale_name in scaled:
        name, scale = scale_name[:-len(INT8_SCALE_SUFFIX)], tensors.pop(scale_name)
        tensors[name] = tensors[name].float() * _per_channel(scale, tensors[name].ndim)
    return tensors


def load_weights(path: Path) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode on the CPU, metadata with mean/std decoded)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
        tensors = _dequantized(load_file(str(path)))
    except FileNotFoundError as e:
        raise CifarkitError(f"no weights at {path}; give a run folder or a .safetensors file") from e
    except Exception as e:
        raise CifarkitError(f"{path} is not a readable safetensors file ({e})") from e
    if METADATA_KEY in meta:
        meta = json.loads(meta[METADATA_KEY])
    elif "model" in meta:  # files of cifarkit 0.1: one JSON value per key, the model name as plain text
        meta = {k: (v if k == "model" else json.loads(v)) for k, v in meta.items()}
    else:
        raise CifarkitError(f"{path} does not name its model in its metadata; it was not written by cifarkit")
    model = models.create(meta["model"])
    model.load_state_dict(tensors)
    return model.eval(), meta
