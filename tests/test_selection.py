"""train.select_fraction: the model trains on the images of each batch that a small proxy model finds hardest."""
import copy

import pytest
import torch
import torch.nn.functional as F

from cifarkit import models
from cifarkit.core.device import PRECISIONS
from cifarkit.core.errors import CifarkitError
from cifarkit.training import train
from cifarkit.training.config import OptimConfig, ScheduleConfig, load_recipe
from cifarkit.training.engine import HardestSelector, TrainState
from cifarkit.training.optim import build_optimizer, build_schedule
from conftest import interrupt_as_epoch_starts


def proxy_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = models.create("fastnet_proxy")
    optimizer = build_optimizer(model, OptimConfig(lr=0.05, momentum=0.9))
    return TrainState(model=model, forward=model, optimizer=optimizer,
                      scheduler=build_schedule(optimizer, ScheduleConfig(), total=10, steps_per_epoch=10),
                      scaler=torch.amp.GradScaler("cpu", enabled=False), ema=None)


def test_the_hardest_images_in_batch_order_and_the_proxy_learns_one_step_in_n():
    selector = HardestSelector(proxy_state(0), fraction=0.25, train_every=2, label_smoothing=0.2,
                               device=torch.device("cpu"), precision=PRECISIONS["fp32"])
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        inputs, labels = torch.randn(40, 3, 32, 32, generator=generator), torch.randint(10, (40,), generator=generator)
        before = copy.deepcopy(selector.proxy.model)
        with torch.no_grad():
            losses = F.cross_entropy(before.train()(inputs), labels, reduction="none", label_smoothing=0.2)
        expected = losses.argsort(descending=True)[:10].sort().values
        kept_inputs, kept_labels, kept_targets = selector(inputs, labels, 2 * labels)  # per-image targets follow
        assert torch.equal(kept_inputs, inputs[expected]) and torch.equal(kept_labels, labels[expected])
        assert torch.equal(kept_targets, 2 * labels[expected])
        assert (losses[expected].min() >= losses[~torch.isin(torch.arange(40), expected)].max())
        changed = [not torch.equal(a, b) for a, b in zip(before.parameters(), selector.proxy.model.parameters())]
        assert any(changed) == (step % 2 == 0), f"step {step}: the proxy learns on steps 0 and 2 only"
    assert selector.steps == 3 and selector.proxy.scheduler.last_epoch == 3


def test_a_selecting_run_trains_on_half_of_each_batch_and_resumes_exactly(cifar_home, tmp_path, monkeypatch):
    overrides = ["train.epochs=2", "train.batch_size=100", "data.subset=400", "train.tta=false",
                 "train.select_fraction=0.5", "train.select_proxy_every=3"]
    kept = []
    real_select = HardestSelector.__call__

    def recording(self, inputs, labels):
        chosen = real_select(self, inputs, labels)
        kept.append((len(labels), len(chosen[1])))
        return chosen
    monkeypatch.setattr(HardestSelector, "__call__", recording)
    whole = train.run(load_recipe("fast", overrides), out=tmp_path / "whole")
    assert kept == [(100, 50)] * 8, "4 steps of 100 images an epoch, of which the model trains on 50"

    # Interrupted as epoch 2 starts, then resumed: the proxy's weights, momentum, schedule and step count come back
    # with the checkpoint, so epoch 2 picks the same images and ends on the same weights.
    real_epoch = interrupt_as_epoch_starts(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train.run(load_recipe("fast", overrides), out=tmp_path / "broken")
    monkeypatch.setattr(train, "train_one_epoch", real_epoch)
    resumed = train.run(resume=tmp_path / "broken")
    assert resumed["test_acc"] == whole["test_acc"]
    for name in ("whole", "broken"):
        assert (tmp_path / name / "model.safetensors").exists()
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == \
        (tmp_path / "broken" / "model.safetensors").read_bytes()


def test_selection_refuses_a_split_batch_and_a_fraction_outside_0_to_1(cifar_home, tmp_path):
    with pytest.raises(CifarkitError, match="train.select_fraction ranks whole batches in one process"):
        train.run(load_recipe("fast", ["train.select_fraction=0.5", "train.accumulate_steps=2"]), out=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    for bad in ("0", "1.5"):
        with pytest.raises(CifarkitError, match=r"bad value for train.select_fraction: .* \(must be in \(0, 1\]\)"):
            load_recipe("fast", [f"train.select_fraction={bad}"])
