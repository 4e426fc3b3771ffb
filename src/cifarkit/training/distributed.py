"""Data-parallel training on several processes: torch.distributed and DistributedDataParallel, started by torchrun.

    torchrun --nproc-per-node 2 -m cifarkit train --recipe fast      # or: cifarkit train --nproc 2 --recipe fast

torchrun starts the processes and sets RANK, LOCAL_RANK and WORLD_SIZE in each; `init` joins them into one group
(NCCL on CUDA, gloo on the CPU; `train.dist_backend` overrides it). Without those variables a run is one process and
nothing here changes it. What a distributed run means (batches, randomness, BatchNorm, who writes) is in
docs/training.md.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from cifarkit.core.errors import LOG_FORMAT, CifarkitError

log = logging.getLogger("cifarkit")

# A rank evaluating alone, or writing a checkpoint, keeps the others waiting at their next all-reduce: the timeout
# must outlast the slowest of those (a TTA pass of the test set on a slow CPU), not only a step.
TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Group:
    """This process's place in the run: rank 0 of 1 when not distributed."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def writes(self) -> bool:
        """Rank 0 alone writes the run folder, the logs and every file of the run."""
        return self.rank == 0


def launched() -> Group:
    """The group torchrun describes in this process's environment (one process when it does not)."""
    try:
        return Group(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                     int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise CifarkitError(f"RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers ({e}); start the processes with "
                            f"torchrun, or unset them") from None


def restarted() -> bool:
    """Whether torchrun restarted this group after a failure (its elastic restarts): the run is then resumed."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def may_restart() -> bool:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def init(group: Group, device: torch.device, backend: str | None) -> torch.device:
    """Join the process group; returns the device of this rank (its own GPU on CUDA, from LOCAL_RANK)."""
    if not group.distributed:
        return device
    # A rank that native code kills (an abort, a segfault) leaves in torchrun's summary only the signal's number, and
    # its peers time out or abort in turn: each rank prints the Python stack of its threads first.
    faulthandler.enable()
    if device.type == "cuda":
        device = torch.device("cuda", group.local_rank)
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise CifarkitError(f"train.dist_backend nccl needs CUDA, and this run trains on {device.type}; use gloo")
    # The ranks meet through torchrun's store (env://). Each attempt gets keys of its own: after an elastic restart,
    # a rank reading the store found the dead attempt's addresses of its peers, and its connections were refused.
    store, rank, world_size = next(dist.rendezvous("env://", group.rank, group.world_size, timeout=TIMEOUT))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"cifarkit/attempt-{attempt}", store), rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    _quiet_other_ranks(group)
    return device


def _quiet_other_ranks(group: Group) -> None:
    """Ranks other than 0 log warnings and errors only, each line prefixed with the rank."""
    if group.writes:
        return
    log.setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"[rank {group.rank}] {LOG_FORMAT}"))


def finish(group: Group) -> None:
    if group.distributed and dist.is_initialized():
        dist.destroy_process_group()


def agree(group: Group, value):
    """Rank 0's `value` on every rank (e.g. the run folder, whose default name holds rank 0's clock)."""
    if not group.distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def wrap(model: nn.Module, group: Group, device: torch.device, find_unused_parameters: bool = False) -> nn.Module:
    """The module whose forward passes average the gradients over the ranks. BatchNorm buffers are not broadcast at
    each forward: `average_buffers` keeps them equal instead, from every rank's statistics, not rank 0's alone."""
    if not group.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   forward_sync_buffers=False, find_unused_parameters=find_unused_parameters)


def average_buffers(model: nn.Module, group: Group) -> None:
    """Average the floating-point buffers (BatchNorm running statistics) over the ranks after a step, so that every
    rank holds the same model, and the EMA and lookahead copies made from it stay the same on every rank."""
    if not group.distributed:
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.all_reduce(flat)
    flat /= group.world_size  # the sum, then the division: the order one process accumulating uses too
    for buffer, chunk in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(chunk.view_as(buffer))


def sum_over_ranks(*values: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor summed over the ranks (an epoch's loss and counts, to report the whole epoch's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    flat = torch.stack([v.double() for v in values])
    dist.all_reduce(flat)
    return list(flat.unbind())


def sync_batchnorm(model: nn.Module, group: Group, device: torch.device) -> nn.Module:
    """BatchNorm layers replaced by SyncBatchNorm, whose statistics cover the global batch; PyTorch runs it on GPUs
    only (of the devices cifarkit trains on: CUDA, not MPS or the CPU)."""
    if not group.distributed:
        return model
    if device.type != "cuda":
        raise CifarkitError(f"train.sync_bn needs CUDA (PyTorch's SyncBatchNorm does not run on the CPU or MPS), and "
                            f"this run trains on {device.type}; leave it off: each rank then normalizes its own shard")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command `torchrun --standalone --nproc-per-node N -m cifarkit ARGS`, to run in a process of its own: torchrun
    sets OMP_NUM_THREADS in its own environment, which a caller's later processes would otherwise inherit."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "cifarkit", *args]


def launch(nproc: int, argv: list[str]) -> None:
    """`cifarkit train --nproc N ARGS`: `cifarkit train ARGS` on N processes of this machine, through torchrun."""
    command = torchrun(nproc, "train", *argv)
    log.info("launching: torchrun %s", " ".join(command[3:]))
    code = subprocess.run(command).returncode
    if code:
        raise CifarkitError(f"the {nproc}-process run failed (torchrun exited with {code}); the failing rank's error "
                            f"is above")
