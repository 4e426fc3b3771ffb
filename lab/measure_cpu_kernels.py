"""torch's max-pool against cifarkit's C kernel (`models/pooling.py`) on the tensors a `fast` step gives it: each
pool of fastnet, forward and backward, in the precision training takes here (bf16 where it is native, else fp32),
and write results/cpu-kernels-KIND.json (KIND: the CPU kind, as in
backends.CPU_KINDS).

    python lab/measure_cpu_kernels.py
    python lab/measure_cpu_kernels.py --batch-size 1536 --rounds 7
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python lab/measure_cpu_kernels.py \
        --json results/cpu-kernels-avx2-imitated.json

The shapes are read from one training forward pass of fastnet at the batch size (the kernel plan of this CPU decides
which convolutions crop their outputs before a pool). Both sides take turns within each round, so drift on a shared
machine falls on both alike; the median over rounds is kept. Run it alone, on the allocator training uses (tcmalloc
preloaded, as `cifarkit train` does). The whole step's gain is `cifarkit profile --before COMMIT`'s to measure.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from cifarkit import models
from cifarkit.core import device
from cifarkit.core.files import write_json
from cifarkit.inference import backends
from cifarkit.models import pooling
from cifarkit.training.tracking import git_source

ROOT = Path(__file__).resolve().parent.parent


def pool_inputs(batch_size: int, dtype: torch.dtype) -> list[torch.Size]:
    """The input shape of each of fastnet's pools in a training step in `dtype`, in order."""
    model = models.create("fastnet").train().to(memory_format=torch.channels_last)
    shapes = []
    hooks = [group[1].register_forward_pre_hook(lambda module, inputs: shapes.append(inputs[0].shape))
             for group in model.conv_groups]
    images = torch.randn(batch_size, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        model(images)
    for hook in hooks:
        hook.remove()
    return shapes


def milliseconds(pool, x: torch.Tensor) -> float:
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    y = pool(leaf)
    y.backward(torch.ones_like(y))
    return 1e3 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="where to write (default: results/cpu-kernels-KIND.json)")
    args = parser.parse_args(argv)
    if pooling.kernel() is None:
        raise SystemExit("the C kernel could not be built here (no C compiler?): nothing to compare")
    dtype = torch.bfloat16 if device.cpu_has_bf16() else torch.float32  # as pick_precision's auto chooses
    generator = torch.Generator().manual_seed(0)
    sides = {"torch": lambda x: F.max_pool2d(x, 2), "cifarkit": pooling.MaxPool2x2Function.apply}
    rows = []
    for shape in pool_inputs(args.batch_size, dtype):
        x = torch.randn(shape, generator=generator).to(dtype).contiguous(memory_format=torch.channels_last)
        for pool in sides.values():  # warm-up
            milliseconds(pool, x)
        samples = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, pool in sides.items():
                samples[side].append(milliseconds(pool, x))
        medians = {side: statistics.median(values) for side, values in samples.items()}
        rows.append({"operation": "max-pool", "shape": list(shape), "torch_ms": round(medians["torch"], 2),
                     "cifarkit_ms": round(medians["cifarkit"], 2),
                     "speedup": round(medians["torch"] / medians["cifarkit"], 2),
                     "samples_ms": {side: [round(v, 2) for v in values] for side, values in samples.items()}})
        print(f"max-pool {'x'.join(map(str, shape)):18s} torch {medians['torch']:7.1f} ms, cifarkit "
              f"{medians['cifarkit']:7.1f} ms: {medians['torch'] / medians['cifarkit']:.2f}x", flush=True)
    kind = backends.cpu_kind()
    out = args.json or ROOT / "results" / f"cpu-kernels-{kind}.json"
    write_json(out, {
        "what": f"forward + backward of each max-pool in a fastnet training step, {str(dtype)[6:]}, channels-last: "
                f"torch's kernel against cifarkit's, medians of {args.rounds} interleaved rounds",
        "command": " ".join([*(f"{name}={value}" for name, value in device.isa_caps().items()),
                             "python lab/measure_cpu_kernels.py",
                             *([f"--batch-size {args.batch_size}"] if args.batch_size != 1536 else []),
                             *([f"--json {args.json}"] if args.json else [])]),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": git_source(),
        "cpu_kind": kind, "isa_caps": device.isa_caps(), "processor": device.report()["processor"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(), "batch_size": args.batch_size, "rows": rows,
    })
    print(f"written to {out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
