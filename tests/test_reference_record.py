"""The 2025 record's driver (reference_drivers.RECORD_DRIVER and RECORD_VIEWS), run as `cifarkit reference` runs it,
on the committed sample of CIFAR-10. The record itself is not in the repository (it is the user's copy), so a fake
stands in for it: a small file with its entry points, that makes the calls its CPU adaptation has to answer (its
torch.compile decorators at import, `.half()`, a pinned buffer, a CUDA index buffer, a CUDA map_location, CUDA timing
events, its batched Newton-Schulz through the module's global, TTA level 2 inside its timer and level 0 after it).
cifarkit's side is a fake row here: its runs are tested where `cifarkit train` is."""
from __future__ import annotations

import math

from cifarkit.tools import reference
from conftest import sample_home

FAKE_RECORD = '''
import os
import sys
with open(sys.argv[0]) as f:
    code = f.read()
import torch
from torch import nn
import torch.nn.functional as F
import torchvision.transforms as T

CIFAR_MEAN = torch.tensor((0.4914, 0.4822, 0.4465), dtype=torch.half)
CIFAR_STD = torch.tensor((0.247, 0.2435, 0.2616), dtype=torch.half)
CALLS = {"newton_schulz": 0}

@torch.compile(fullgraph=True)
def _zeropower_via_newtonschulz5(gradients, meta, max_D, max_K, step, total):
    assert all(g.dtype in (torch.bfloat16, torch.float32) for g in gradients), "the driver's dtype"
    CALLS["newton_schulz"] += 1
    return [g / (g.norm() + 1e-7) for g in gradients]

@torch.compile()
def batch_flip_lr(inputs):
    return inputs.flip(-1)

class Muon(torch.optim.Optimizer):
    pass

class CifarLoader:
    def __init__(self, path, train=True, batch_size=500, aug=None):
        data = torch.load(os.path.join(path, "train.pt" if train else "test.pt"), map_location=torch.device("cuda"),
                          weights_only=True)
        self.images = (data["images"].half() / 255).permute(0, 3, 1, 2)
        assert self.images.dtype == torch.float32, "half() is fp32 on the CPU"
        self.labels = data["labels"]
        self.normalize = T.Normalize(CIFAR_MEAN, CIFAR_STD)
        self.batch_size = batch_size
        self._buffer = torch.zeros(4, dtype=torch.half).pin_memory()
        self._indices = torch.empty(len(self.images), dtype=torch.long, device="cuda")

    def __iter__(self):
        images = batch_flip_lr(self.normalize(self.images))
        torch.randperm(len(self._indices), out=self._indices)
        for i in range(len(self.images) // self.batch_size):
            chosen = self._indices[i * self.batch_size:(i + 1) * self.batch_size]
            yield images[chosen], self.labels[chosen]

class CifarNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8, 10, bias=False)
        for module in self.modules():
            module.half()

    def reset(self):
        self.conv.reset_parameters()
        self.head.reset_parameters()

    def forward(self, x, whiten_bias_grad=True):
        x = F.relu(self.conv(x.to(memory_format=torch.channels_last))).amax((2, 3))
        return self.head(x)

def print_training_details(variables, is_final_entry):
    print("printed details")

def evaluate(model, loader, tta_level=0):
    with torch.no_grad():
        logits = model(loader.normalize(loader.images))
    return (logits.argmax(1) == loader.labels).float().mean().item()

def main(run, model):
    test_loader = CifarLoader("cifar10", train=False, batch_size=500)
    train_loader = CifarLoader("cifar10", train=True, batch_size=500)
    model.reset()
    filters = [model.conv.weight]
    starter, ender = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    starter.record()
    for step, (inputs, labels) in enumerate(train_loader):
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        with torch.no_grad():
            updates = _zeropower_via_newtonschulz5([p.grad for p in filters], [], 8, 27, step, 4)
            for p, u in zip(filters, updates):
                assert u.dtype == torch.float32, "updates applied in fp32"
                p.sub_(0.1 * u)
            model.head.weight.sub_(0.1 * model.head.weight.grad)
        model.zero_grad(set_to_none=True)
    assert CALLS["newton_schulz"] == 4, "the driver's function replaced the module's global"
    tta_val_acc = evaluate(model, test_loader, tta_level=2)
    ender.record()
    torch.cuda.synchronize()
    time_seconds = 1e-3 * starter.elapsed_time(ender)
    train_acc = evaluate(model, train_loader, tta_level=0)
    val_acc = evaluate(model, test_loader, tta_level=0)
    print_training_details(locals(), is_final_entry=True)
    return val_acc, tta_val_acc, time_seconds
'''


def fake_cifarkit(recipe, overrides, seed, subset, folder, env):
    return {"seed": seed, "wall_time_s": 10.0, "train_time_s": 8.0, "test_acc": 0.5, "test_acc_6_views": 0.5}


def test_the_record_runs_on_the_cpu_through_its_driver_and_is_evaluated_with_6_views(tmp_path, monkeypatch):
    record_file = tmp_path / "cifar10_speedrun.py"
    record_file.write_text(FAKE_RECORD)
    (tmp_path / "home").mkdir()
    with sample_home(tmp_path / "home"):
        monkeypatch.setattr(reference, "cifarkit_run", fake_cifarkit)
        result = reference.compare(files={reference.RECORD: record_file}, references=[reference.RECORD], runs=1,
                                   first_seed=3, recipe="fast", overrides=[], brackets=[], subset=None,
                                   json_path=None, command="cifarkit reference --record cifar10_speedrun.py")
    row = result["rounds"][0]["runs"][reference.RECORD]
    assert row["seed"] == 3 and 0.0 <= row["test_acc"] <= 1.0 and 0.0 <= row["test_acc_6_views"] <= 1.0
    # Its training time stops where its TTA starts; its own timer also covers that TTA.
    assert 0.0 < row["train_time_s"] <= row["timer_s"] < row["wall_time_s"]
    assert row["newton_schulz_dtype"] == result["newton_schulz_dtype"]
    assert row["logits_dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[result["precision_policy"]]
    assert row["threads"] >= 1 and row["allocator"]
    assert not math.isnan(row["test_acc"])  # its TTA's accuracy, not the skipped level-0 ones
    side = result["references"][reference.RECORD]
    assert side["source"].startswith("cifar10_speedrun.py, sha256 ")
    assert result["settings"]["record_sha256"] == side["source"].split()[-1]
    assert "accuracy_6_views" in side and "equal_accuracy" not in side  # no bracket: no figure at equal accuracy
