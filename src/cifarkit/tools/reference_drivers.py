"""The references `cifarkit reference` times: where each comes from, how a user's copy is checked, and the small
driver program that runs it on the CPU. Each driver is the PRELUDE (the CPU for CUDA, the machine's precision) and
a few lines that call the reference's own entry point; none of a reference's code is in this repository.

Each driver is a standalone program (run by the python that runs cifarkit), so the patches it makes to torch stay in
its own process."""
from __future__ import annotations

from pathlib import Path

from cifarkit.core.errors import CifarkitError

MUON = "airbench94_muon"
RECORD = "cifar10_speedrun"
AIRBENCH94 = "airbench94"
REFERENCES = (MUON, RECORD, AIRBENCH94)  # the strongest in the goal first; airbench94 is the 2023 package
AIRBENCH94_PACKAGE = "airbench==0.1.8"


class UserCopy:
    """A reference that is one file of a public repository, not a package: the user downloads it and names it."""

    def __init__(self, name: str, option: str, url: str, names: tuple[str, ...], what: str):
        self.name, self.option, self.url, self.names, self.what = name, option, url, names, what

    def check(self, path: str | None) -> Path:
        """The user's copy, or an error that says how to get it."""
        fetch = f"download it with `curl -LO {self.url}` and pass {self.option} {self.name}.py"
        if path is None:
            raise CifarkitError(f"{self.name} ({self.what}) is not a package: {fetch} (or leave it out of "
                                f"--references)")
        file = Path(path)
        if not file.is_file():
            raise CifarkitError(f"{self.option} {path}: no such file; {fetch}")
        text = file.read_text(errors="replace")
        missing = [name for name in self.names if f"def {name}" not in text and f"class {name}" not in text]
        if missing:
            raise CifarkitError(f"{self.option} {path} does not look like {self.name}.py (no {', '.join(missing)}); "
                                f"{fetch}")
        return file


USER_COPIES = {
    MUON: UserCopy(MUON, "--muon", "https://raw.githubusercontent.com/KellerJordan/cifar10-airbench/master/"
                   "airbench94_muon.py", ("CifarNet", "CifarLoader", "Muon", "main", "evaluate",
                                          "zeropower_via_newtonschulz5"), "Jordan's 2024 record"),
    RECORD: UserCopy(RECORD, "--record", "https://raw.githubusercontent.com/hiverge/cifar10-speedrun/main/"
                     "cifar10_speedrun.py", ("CifarNet", "CifarLoader", "Muon", "main", "evaluate",
                                             "_zeropower_via_newtonschulz5"), "the Hive's 2025 record"),
}

# What every reference process does first: the CPU in place of CUDA, the machine's precision policy, and a record of
# what the process really ran. argv: seed, data folder, precision (bf16 | fp32), Newton-Schulz dtype, then the
# driver's own arguments.
PRELUDE = r"""
import json, sys, time
import torch
from torch import nn

seed, data_dir, precision, newton_schulz = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.manual_seed(seed)
observed = {"threads": torch.get_num_threads()}
nn.Module.cuda = lambda self, *args, **kwargs: self
nn.Module.half = lambda self: self
torch.Tensor.half = lambda self, *args, **kwargs: self.float()
load = torch.load
torch.load = lambda *args, **kwargs: load(*args, **{**kwargs, "map_location": "cpu"})
if newton_schulz == "float32":  # the one bf16 cast of airbench94_muon is its Newton-Schulz input
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self.to(torch.float32, copy=True)

timed_s = 0.0  # the reference's own timer: the sum of its CUDA-event intervals

class HostEvent:  # torch.cuda.Event(enable_timing=True) on the host clock
    def __init__(self, *args, **kwargs):
        self.at = None
    def record(self, *args):
        self.at = HostEvent.last = time.perf_counter()
    def elapsed_time(self, end):
        global timed_s
        timed_s += end.at - self.at
        return 1e3 * (end.at - self.at)

torch.cuda.Event, torch.cuda.synchronize = HostEvent, lambda *args: None

def in_precision(net):
    # The forward passes in the machine's precision, returning fp32 logits as cifarkit's do.
    forward = net.forward
    def forward_in_precision(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = forward(*args, **kwargs)
        observed.setdefault("logits_dtype", str(logits.dtype).removeprefix("torch."))
        return logits.float()
    net.forward = forward_in_precision
    return net

def report(test_acc, train_time_s, **more):
    maps = open("/proc/self/maps").read()
    observed["allocator"] = next((name for library, name in ALLOCATORS.items() if library in maps), "glibc")
    print(json.dumps({"test_acc": test_acc, "train_time_s": train_time_s, **more, **observed}))
"""

# airbench94_muon, loaded from the user's copy (argv[5]) and run once through its own main(), in its data folder.
MUON_DRIVER = r"""
import importlib.util, os
spec = importlib.util.spec_from_file_location("airbench94_muon", sys.argv[5])
muon = importlib.util.module_from_spec(spec)
spec.loader.exec_module(muon)
compiled = muon.zeropower_via_newtonschulz5
plain = getattr(compiled, "_torchdynamo_orig_callable", None) or compiled.__wrapped__

def newton_schulz(*args, **kwargs):
    update = plain(*args, **kwargs)
    observed.setdefault("newton_schulz_dtype", str(update.dtype).removeprefix("torch."))
    return update

muon.zeropower_via_newtonschulz5 = newton_schulz
muon.print_training_details = lambda variables, is_final_entry: None
evaluate, trained = muon.evaluate, {}

def evaluate_at_end(model, loader, tta_level=0):
    if tta_level == 0:  # the per-epoch evaluation, printed only: skipped
        return float("nan")
    trained.setdefault("train_time_s", timed_s)  # its timer so far: whitening init and every training epoch
    return evaluate(model, loader, tta_level)

muon.evaluate = evaluate_at_end
os.chdir(data_dir)  # its loaders read cifar10/train.pt and cifar10/test.pt
model = in_precision(muon.CifarNet().to(memory_format=torch.channels_last))
test_acc = muon.main(seed, model)
report(test_acc, trained["train_time_s"], test_acc_6_views=test_acc)  # its TTA level 2 is the 6 views
"""

# The 2025 record's module, loaded from the user's copy (argv[5]) with nothing compiled: its torch.compile decorators
# run at import, so the patch comes first. Its pinned staging buffer and its index buffer are CUDA-only calls.
RECORD_IMPORT = r"""
import importlib.util, os
torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda function: function)
torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
empty = torch.empty
torch.empty = lambda *args, device=None, **kwargs: empty(*args, **kwargs)
spec = importlib.util.spec_from_file_location("cifar10_speedrun", sys.argv[5])
record = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record)
"""

# The record run once through its own main(), in its data folder; its weights go to argv[6] for the 6-view
# evaluation, which RECORD_VIEWS makes after this process ends. Its momentum buffers stay in fp16, as it sets them;
# its batched Newton-Schulz iteration runs in the machine's dtype (fp16 on its GPU), its updates applied in fp32.
RECORD_DRIVER = RECORD_IMPORT + r"""
newton_schulz_dtype = getattr(torch, newton_schulz)
plain = record._zeropower_via_newtonschulz5

def batched_newton_schulz(gradients, *args):
    updates = plain([g.to(newton_schulz_dtype) for g in gradients], *args)
    observed.setdefault("newton_schulz_dtype", str(updates[0].dtype).removeprefix("torch."))
    return [u.float() for u in updates]

record._zeropower_via_newtonschulz5 = batched_newton_schulz
record.print_training_details = lambda variables, is_final_entry: None
evaluate, trained = record.evaluate, {}

def evaluate_at_end(model, loader, tta_level=0):
    if tta_level == 0:  # the train and test accuracy without TTA, after its timer stops, only printed: skipped
        return float("nan")
    trained.setdefault("train_time_s", time.perf_counter() - HostEvent.last)  # its timer, less this evaluation
    return evaluate(model, loader, tta_level)

record.evaluate = evaluate_at_end
os.chdir(data_dir)  # its loaders read cifar10/train.pt and cifar10/test.pt
model = in_precision(record.CifarNet().to(memory_format=torch.channels_last))
val_acc, test_acc, timed = record.main(seed, model)
torch.save(model.state_dict(), sys.argv[6])
report(test_acc, trained["train_time_s"], timer_s=timed)
"""

# The record's saved weights (argv[6]) evaluated with 6 views of every image, by cifarkit's own evaluation in the
# machine's precision, as `fast`'s weights are; normalized with the record's own mean and std.
RECORD_VIEWS = RECORD_IMPORT + r"""
from cifarkit.core import device
from cifarkit.data import cifar10
from cifarkit.training.engine import evaluate
model = record.CifarNet()
model.load_state_dict(torch.load(sys.argv[6], weights_only=True))
dataset = cifar10.load()
result = evaluate(model.float().to(memory_format=torch.channels_last), dataset.test_x, dataset.test_y,
                  record.CIFAR_MEAN.tolist(), record.CIFAR_STD.tolist(), torch.device("cpu"),
                  device.PRECISIONS[precision], tta=True, tta_share=1.0)
print(json.dumps({"test_acc_6_views": result["acc"]}))
"""

# airbench94 from the package: train94 without printing (so without per-epoch evaluation), then its TTA level 2.
AIRBENCH94_DRIVER = r"""
import os
import airbench
from airbench import lib_airbench94, utils

class CpuLoader(utils.CifarLoader):  # its data on the CPU, from the train.pt / test.pt written for it
    def __init__(self, path, *args, **kwargs):
        kwargs["gpu"] = "cpu"
        super().__init__(os.path.join(data_dir, "cifar10"), *args, **kwargs)

utils.CifarLoader = lib_airbench94.CifarLoader = CpuLoader
model = lib_airbench94.train94(make_net=lambda: in_precision(lib_airbench94.make_net94()), verbose=False)
train_time_s = timed_s
test_acc = airbench.evaluate(model, CpuLoader(None, train=False, batch_size=2000), tta_level=2)
report(test_acc, train_time_s)
"""
