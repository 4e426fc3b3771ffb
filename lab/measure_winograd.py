"""Each 3x3 convolution of a model, forward and backward on the CPU in fp32 or bf16: oneDNN's direct kernel against
Winograd's F(2x2, 3x3) and F(4x4, 3x3) (cifarkit.models.winograd; F(2x2) alone in bf16) at several slice sizes, and
the path training takes. Writes results/winograd-layers-KIND.json (KIND: the CPU kind, as in backends.CPU_KINDS;
results/winograd-layers-bf16-KIND.json in bf16), or --json PATH.

    python lab/measure_winograd.py
    python lab/measure_winograd.py --model fastnet_deep --tile-rows 1536 --rounds 5 --model-rounds 4
    python lab/measure_winograd.py --precision bf16 --tile-rows 1536 --rounds 5

The variants take turns within each round, so drift on a shared machine falls on each alike; the median over rounds
is kept. Winograd computes whole blocks of outputs: a pooled layer's cropped ones, otherwise its outputs rounded up
to whole blocks (the extra rows and columns are waste). The first convolution gets no input gradient, as in training
once the whitening bias freezes. Last, whole forward and backward passes of the model under each choice of layers
(`model_plans`), also taking turns: a layer's gain in the table need not survive in the whole network, where the
layers share the caches. In bf16 each layer is also timed as bf16 training computes it (its kernel plan, "as_trained").
It runs on the allocator training runs on (core/allocator.py). layers.WINOGRAD_MAX_WIDTH,
layers.WINOGRAD_UNPOOLED_WIDTHS, layers.WINOGRAD_MAX_TILE, the plans' winograd_cropped_max_width and winograd.TILE_ROWS
are chosen from these tables. Run it alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from cifarkit import models
from cifarkit.core import allocator, device
from cifarkit.core.files import write_json
from cifarkit.inference import backends
from cifarkit.models import layers, winograd

ROOT = Path(__file__).resolve().parent.parent


def convolution_inputs(model: torch.nn.Module) -> list[tuple[layers.Conv3x3, tuple[int, ...]]]:
    """Each Conv3x3 of `model` with the shape of its input for one 32x32 image, in the order of the forward pass."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda module, args: seen.append((module, tuple(args[0].shape[1:]))))
             for m in model.modules() if isinstance(m, layers.Conv3x3)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    return seen


def seconds(compute, x: torch.Tensor, weight: torch.Tensor) -> float:
    start = time.perf_counter()
    out = compute(x, weight)
    wanted = (x, weight) if x.requires_grad else (weight,)
    torch.autograd.grad(out, wanted, torch.ones_like(out))
    return time.perf_counter() - start


def winograd_variant(outputs_per_tile: int, tile_rows: int, kept: int):
    def compute(x, weight):
        winograd.TILE_ROWS = winograd.TILE_ROWS | {outputs_per_tile: tile_rows}
        return winograd.WinogradConv3x3.apply(x, weight, kept, kept, outputs_per_tile)
    return compute


def as_trained(conv: layers.Conv3x3):
    """The layer as bf16 training computes it: its own weight, under autocast, on its kernel plan's path."""
    def compute(x, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return conv(x)
    return compute


def variant_name(outputs_per_tile: int, tile_rows: int) -> str:
    return f"winograd{outputs_per_tile}_{tile_rows}"


def model_plans(precision: str) -> dict[str, dict[str, object]]:
    """The layer choices compared on whole forward + backward passes: the layers.py settings of each."""
    if precision == "bf16":  # this CPU's kernel plan, without Winograd, and every layer on oneDNN
        shipped = layers.cpu_plan()
        plans = {"onednn": layers.KernelPlan(0, 0, 0),
                 "without_winograd": dataclasses.replace(shipped, winograd_cropped_max_width=0),
                 "as_trained": shipped}
        return {name: {"KERNEL_PLANS": dict.fromkeys(layers.KERNEL_PLANS, plan)} for name, plan in plans.items()}
    shipped = {key: getattr(layers, key)
               for key in ("WINOGRAD_MAX_WIDTH", "WINOGRAD_UNPOOLED_WIDTHS", "WINOGRAD_MAX_TILE")}
    return {"onednn": {"WINOGRAD_MAX_WIDTH": 0, "WINOGRAD_UNPOOLED_WIDTHS": (), "WINOGRAD_MAX_TILE": 2},
            # The plan before F(4x4, 3x3): F(2x2) on the pooled layers and the unpooled 7x7 one.
            "f2_only": {**shipped, "WINOGRAD_UNPOOLED_WIDTHS": (7,), "WINOGRAD_MAX_TILE": 2},
            # The pooled 15x15 layer gains from F(4x4) on a Zen 3 but not on a Zen 2, of the same kind: does
            # putting it back on oneDNN matter in the whole model, where the layers share the caches?
            "pooled_up_to_8": {**shipped, "WINOGRAD_MAX_WIDTH": 8},
            "as_trained": shipped}


def whole_model(name: str, batch_size: int, rounds: int, precision: str) -> dict:
    """The model's forward and backward pass in training under each plan of `model_plans`, taking turns (ABC, CBA,
    ...) so that drift falls on each alike, with the first convolution's input gradient skipped as after the
    whitening bias freezes."""
    model = models.create(name).train()
    for parameter in getattr(model, "whiten", torch.nn.Identity()).parameters():
        parameter.requires_grad_(False)
    x = torch.randn(batch_size, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    plans = model_plans(precision)

    def settle(settings: dict) -> None:
        for key, value in settings.items():
            setattr(layers, key, value)
        layers.cpu_plan.cache_clear()  # it reads KERNEL_PLANS once

    def step(plan: str) -> float:
        saved = {key: getattr(layers, key) for key in plans[plan]}
        settle(plans[plan])
        try:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(x).float().square().mean()
            loss.backward()
            return time.perf_counter() - start
        finally:
            settle(saved)
            model.zero_grad(set_to_none=True)

    for plan in plans:  # warm-up
        step(plan)
    samples = {plan: [] for plan in plans}
    for round_index in range(rounds):
        for plan in (list(plans) if round_index % 2 == 0 else list(reversed(plans))):
            samples[plan].append(step(plan))
    medians = {plan: statistics.median(s) for plan, s in samples.items()}
    print("whole model, forward + backward: " + ", ".join(f"{plan} {1e3 * s:.0f} ms" for plan, s in medians.items()),
          flush=True)
    described = {plan: plain_settings(settings) for plan, settings in plans.items()}
    return {"plans": described, "median_s": medians, "samples_s": samples}


def plain_settings(settings: dict) -> dict:
    """A plan's layers.py settings as JSON holds them: each KernelPlan as a mapping."""
    return {key: {kind: dataclasses.asdict(plan) for kind, plan in value.items()} if key == "KERNEL_PLANS" else value
            for key, value in settings.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fastnet")
    parser.add_argument("--batch-size", type=int, default=2000, help="images per step (fast's batch)")
    parser.add_argument("--tile-rows", nargs="+", type=int, default=[768, 1536, 3072],
                        help="tiles a slice to time, besides winograd.TILE_ROWS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-rounds", type=int, default=6, help="rounds of the whole-model comparison")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: in training's autocast, F(2x2, 3x3) alone, and each layer as training takes it")
    parser.add_argument("--json", type=Path, help="where to write the result; relative to the project")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    bf16 = args.precision == "bf16"
    blocks = (2,) if bf16 else tuple(winograd.TRANSFORMS)
    chosen_rows = winograd.TILE_ROWS
    torch.manual_seed(0)
    rows = []
    for index, (conv, (c_in, h, w)) in enumerate(convolution_inputs(models.create(args.model))):
        x = torch.randn(args.batch_size, c_in, h, w).contiguous(memory_format=torch.channels_last)
        x = x.to(torch.bfloat16 if bf16 else torch.float32).requires_grad_(index > 0)
        weight = conv.weight
        path = conv.train().path(x)
        kept = w - 1 if conv.pooled and w % 2 else w
        tile = layers.BF16_WINOGRAD_TILE if bf16 else layers.winograd_tile(kept)
        variants = {"onednn": lambda x, weight: F.conv2d(x, weight.to(x.dtype), padding=1)}
        if bf16:
            variants["as_trained"] = as_trained(conv)
        # Each block size at the slice sizes asked for and at the one it ships with.
        variants |= {variant_name(m, r): winograd_variant(m, r, kept) for m in blocks
                     for r in sorted({*args.tile_rows, chosen_rows[m]})}
        for compute in variants.values():  # warm-up: oneDNN picks its kernels, the allocator fills its caches
            seconds(compute, x, weight)
        samples = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, compute in variants.items():
                samples[name].append(seconds(compute, x, weight))
        medians = {name: statistics.median(s) for name, s in samples.items()}
        rows.append({"c_in": c_in, "c_out": conv.out_channels, "width": w, "pooled": conv.pooled,
                     "input_gradient": index > 0, "kept_outputs": kept, "winograd_tile": tile,
                     f"{args.precision}_training_path": path,
                     "median_s": medians, "samples_s": samples})
        takes = f"{path}, F({tile}x{tile})" if path.startswith("winograd") else path  # a block only where one is taken
        print(f"{c_in:4d} -> {conv.out_channels:4d} at {w:2d}x{w:<2d} {'pooled' if conv.pooled else '      '} "
              f"({takes}): " + ", ".join(f"{name} {1e3 * s:.0f} ms" for name, s in medians.items()), flush=True)
    winograd.TILE_ROWS = chosen_rows
    model = whole_model(args.model, args.batch_size, args.model_rounds, args.precision)
    kind = backends.cpu_kind()
    out = ROOT / (args.json or Path("results") / f"winograd-layers-{'bf16-' if bf16 else ''}{kind}.json")
    write_json(out, {
        "command": "python lab/measure_winograd.py" + (" " + " ".join(argv) if argv else ""),
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_kind": kind,
        "environment": device.report(torch.device("cpu")), "model": args.model, "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "precision": args.precision, "rounds": args.rounds,
        "tile_rows_chosen": chosen_rows, "layers": rows,
        "whole_model": model,
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    # Under training's allocator: with glibc's, each slice's new tensors page-fault, and the table would time that.
    allocator.restart_on_tcmalloc(sys.argv[1:], program=(__file__,))
    main()
