"""Atomic save and load of the full training state, for exact resume.

Checkpoints hold state_dicts and plain data only, so they load with `weights_only=True`: no pickled objects.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import write_bytes
from cifarkit.training.engine import TrainState


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_training(path: Path, state: TrainState, epoch: int, extra: dict) -> None:
    # Serialized in memory, then written by Python: a full disk then raises OSError(ENOSPC), which the CLI reports
    # in one line, instead of torch's C++ writer's RuntimeError.
    write_bytes(path, _serialized({"epoch": epoch, **_training_state(state), **extra}))


def snapshot(state: TrainState) -> dict:
    """The training state as a checkpoint holds it, copied apart from the live tensors: steps taken after it leave
    it as it was, and restore_training puts it back (the warm-up before a timed run)."""
    return torch.load(io.BytesIO(_serialized(_training_state(state))), map_location="cpu", weights_only=True)


def _training_state(state: TrainState) -> dict:
    return {
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict(),
        "ema": state.ema.state_dict() if state.ema is not None else None,
        "lookahead": state.lookahead.state_dict() if state.lookahead is not None else None,
        "selector": state.selector.state_dict() if state.selector is not None else None,
        "rng": rng_states(),
    }


def _serialized(payload: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def load_training(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CifarkitError(f"no checkpoint at {path}; the run was stopped before its first epoch ended") from e
    except Exception as e:
        raise CifarkitError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e})") from e


def restore_training(state: TrainState, payload: dict) -> None:
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.scheduler.load_state_dict(payload["scheduler"])
    state.scaler.load_state_dict(payload["scaler"])
    if state.ema is not None:
        state.ema.load_state_dict(payload["ema"])
    if state.lookahead is not None:
        state.lookahead.load_state_dict(payload["lookahead"])
    if state.selector is not None:
        state.selector.load_state_dict(payload["selector"])
    restore_rng(payload["rng"])
