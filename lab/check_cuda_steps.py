"""Checks that a recipe's training steps never wait for the GPU: the host queues step after step while the GPU works.

    python lab/check_cuda_steps.py --recipe fast --steps 20 --json device-check/cuda-steps.json

The recipe's run is set up as `cifarkit train` sets it up (its compile and precision choices for CUDA), warmed up at
the run's shapes, then `--steps` steps, batches included, run under torch.cuda.set_sync_debug_mode("error"): an
operation that synchronizes with the GPU (a tensor read on the host, a blocking copy) raises there, and its line is
reported. The divergence check that reads the loss every engine.DIVERGENCE_CHECK_EVERY steps is outside the steps,
on purpose. `--device cpu` runs the same steps with nothing to check, as the smoke test does on a machine without a
GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="fast")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--steps", type=int, default=20, help="steps checked after the warm-up (default: 20)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()

    import torch

    from cifarkit.core import device
    from cifarkit.core.files import write_json
    from cifarkit.training import distributed, train
    from cifarkit.training.config import load_recipe
    from cifarkit.training.engine import train_step
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("check_cuda_steps: torch sees no CUDA device here; run it on a GPU, or give --device cpu")
    recipe = load_recipe(args.recipe, [*args.set, f"train.device={args.device}"])
    cfg = recipe.train
    run_device = device.pick_device(args.device)
    setup = train.prepare(recipe, distributed.Group(), run_device)
    warmup_s = train.warm_up(recipe, setup) if train.warms_up(cfg, run_device) else 0.0
    state = setup.state
    state.model.train()
    train.freeze_for_epoch(state, cfg, 1)
    failure = None
    started = time.perf_counter()
    checking = run_device.type == "cuda"
    if checking:
        torch.cuda.set_sync_debug_mode("error")
    loss_sum = torch.zeros((), device=run_device)
    correct = torch.zeros((), device=run_device, dtype=torch.long)
    try:
        for micro_batches in setup.loader.epoch(1, args.steps):
            train_step(state, micro_batches, setup.loss_fn, run_device, setup.precision, cfg.grad_clip, loss_sum,
                       correct)
    except RuntimeError as e:  # the sync debug mode's error, with the line of cifarkit that synchronized
        failure = {"error": str(e).splitlines()[0], "where": [
            f"{frame.filename.rsplit('/cifarkit/', 1)[-1]}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_tb(e.__traceback__) if "/cifarkit/" in frame.filename]}
    finally:
        if checking:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    result = {"command": " ".join(["python lab/check_cuda_steps.py", *sys.argv[1:]]), "recipe": args.recipe,
              "overrides": args.set, "steps": args.steps, "precision": setup.precision.name,
              "compiled": cfg.compiles(run_device.type), "warmup_s": warmup_s, "checked": checking,
              "synchronizes": failure, "seconds": seconds, "environment": device.report(run_device)}
    verdict = ("not checked: no GPU" if not checking else
               f"a step synchronizes: {failure['error']} at {', '.join(failure['where'])}" if failure else
               f"no step synchronizes with the GPU ({args.steps} steps)")
    print(f"check_cuda_steps: {args.recipe}, {setup.precision.name}, compiled: {result['compiled']}: {verdict}")
    if args.json:
        write_json(args.json, result)
    if failure:
        sys.exit(1)


if __name__ == "__main__":
    main()
