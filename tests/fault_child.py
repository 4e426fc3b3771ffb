"""Run the `cifarkit` command in a child process and SIGKILL it at a chosen point: `killed_at(POINT, ARGS, LOG)`.

The kill is a real SIGKILL of the child, delivered from inside at a precise moment, so a test can say exactly where
a run, a release or an import died. The children come from multiprocessing's fork server, which imports torch and
cifarkit once: a fresh interpreter would spend seconds importing them again for every point of the matrix (the
command's own start-up is tested where it matters, in test_cli_train and test_allocator). They are not forked from
the test's own process: once that has trained, autograd refuses to run in a fork of it. Each point wraps one
function of cifarkit (or os.replace, through which every atomic write lands) and kills the child when it is reached:

    epoch-1, mid-epoch        in epoch 1 (before any checkpoint) or midway through epoch 2's batches
    checkpoint-write          the epoch-2 checkpoint is half written to its temporary file
    last-epoch-eval           during the last epoch's first pass with TTA, on validation (before the last checkpoint)
    after-last-checkpoint     the loop is over: while the curves are drawn
    final-eval                during the final TTA measurement of the checkpoint chosen on validation
    weights-write             model.safetensors is half written
    summary-write             summary.json is half written
    release-measure           `cifarkit release` midway: the staged release is being measured
    cache-write               `cifarkit data import`: the new cache is half written
"""
import multiprocessing
import os
import signal
import sys
from pathlib import Path


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_nth_replace(file_name: str, nth: int):
    """Kill when the nth atomic write of `file_name` is about to be renamed into place, its temp file half written."""
    real_replace, seen = os.replace, [0]

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == file_name:
            seen[0] += 1
            if seen[0] == nth:
                os.truncate(src, os.path.getsize(src) // 2)
                die()
        return real_replace(src, dst, *args, **kwargs)
    os.replace = replace


def kill_in_epoch(epoch_to_kill: int, after_steps: int):
    from cifarkit.data import loader
    real_epoch = loader.TrainLoader.epoch

    def epoch(self, number, steps=None):
        for step, batch in enumerate(real_epoch(self, number, steps)):
            if number == epoch_to_kill and step == after_steps:
                die()
            yield batch
    loader.TrainLoader.epoch = epoch


def kill_on_nth_tta_evaluation(nth: int):
    from cifarkit.training import train
    real_evaluate, seen = train.evaluate, [0]

    def evaluate(*args, **kwargs):
        if kwargs.get("tta"):
            seen[0] += 1
            if seen[0] == nth:
                die()
        return real_evaluate(*args, **kwargs)
    train.evaluate = evaluate


def kill_when_called(module_name: str, function: str):
    import importlib
    setattr(importlib.import_module(module_name), function, lambda *args, **kwargs: die())


POINTS = {
    "epoch-1": lambda: kill_in_epoch(1, 2),
    "mid-epoch": lambda: kill_in_epoch(2, 2),
    "checkpoint-write": lambda: kill_on_nth_replace("last.pt", 2),
    "last-epoch-eval": lambda: kill_on_nth_tta_evaluation(1),
    "after-last-checkpoint": lambda: kill_when_called("cifarkit.training.plots", "curves"),
    "final-eval": lambda: kill_on_nth_tta_evaluation(3),  # after the last epoch's validation and test passes
    "weights-write": lambda: kill_on_nth_replace("model.safetensors", 1),
    "summary-write": lambda: kill_on_nth_replace("summary.json", 1),
    "release-measure": lambda: kill_when_called("cifarkit.tools.benchmark", "inference_throughput"),
    "cache-write": lambda: kill_on_nth_replace("cifar10.safetensors", 1),
}


# What every killed command needs, imported once by the fork server rather than by each child.
PRELOAD = ["torch", "torch._dynamo", "cifarkit.cli.main", "cifarkit.training.train", "cifarkit.release.build"]


def _run_and_die(point: str, args: list[str], env: dict[str, str], threads: int, log: str) -> None:
    os.environ.clear()
    os.environ.update(env)  # the test's environment now, not the fork server's when it started
    with open(log, "w", buffering=1) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        import torch
        torch.set_num_threads(threads)  # the test's kernels, for byte-identical resumes
        POINTS[point]()
        from cifarkit.cli import main
        sys.exit(main(args))


def killed_at(point: str, args: list[str], log: Path) -> int:
    """Run `cifarkit ARGS` in a child that dies at `point`; its exit code as subprocess gives it (-9 for a SIGKILL,
    1 for an exception, whose traceback is in `log` with everything else the child printed)."""
    import torch
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    child = context.Process(target=_run_and_die, args=(point, args, dict(os.environ), torch.get_num_threads(),
                                                        str(log)))
    child.start()
    child.join(300)
    if child.exitcode is None:
        child.kill()
        child.join()
    return child.exitcode
