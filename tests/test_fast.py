"""The fast recipe's parts: whitening, alternating flip, lookahead, triangular schedule, TTA, speedrun statistics."""
import json
import math

import pytest
import torch

from cifarkit import models
from cifarkit.cli import main
from cifarkit.core.device import PRECISIONS
from cifarkit.core.errors import CifarkitError
from cifarkit.data import cifar10, loader
from cifarkit.data.config import CIFAR10_MEAN, CIFAR10_STD, AugmentConfig, DataConfig
from cifarkit.models.layers import Conv3x3
from cifarkit.tools import profiling
from cifarkit.tools.speedrun import difference_of_means, statistics_against
from cifarkit.training import train
from cifarkit.training.config import OptimConfig, ScheduleConfig, load_recipe
from cifarkit.training.engine import evaluate, tta_views
from cifarkit.training.optim import Lookahead, build_optimizer, build_schedule, orthogonalized, split_by_train_steps
from conftest import FLOORS


def test_whitening_filters_decorrelate_patches(cifar_home):
    cached = cifar10.load()
    model = models.create("fastnet")
    images = loader.normalize(cached.train_x[:1000], CIFAR10_MEAN, CIFAR10_STD)
    model.init_from_data(images)
    with torch.no_grad():
        out = model.whiten(images) - model.whiten.bias.view(1, -1, 1, 1)
    half = out[:, :12].permute(0, 2, 3, 1).reshape(-1, 12)  # the other 12 channels are the negations
    covariance = torch.cov(half.T)
    # Whitened: no correlation between directions, and unit variance along each of them except the faintest,
    # where WHITEN_EPS (5e-4, the size of their eigenvalue) deliberately holds the gain back.
    assert (covariance.diagonal() <= 1.001).all() and (covariance.diagonal() > 0.5).all()
    assert (covariance.diagonal() > 0.95).sum() >= 8
    assert (covariance - torch.diag(covariance.diagonal())).abs().max() < 0.05
    assert torch.equal(model.whiten.weight[:12], -model.whiten.weight[12:])
    assert not model.whiten.weight.requires_grad


def test_alternating_flip_mirrors_each_image_the_other_way_every_epoch():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(64)  # labels identify the images through the shuffle
    cfg = DataConfig(augment=AugmentConfig(flip=True, alternate_flip=True), mean=(0, 0, 0), std=(1 / 255,) * 3)
    batches = loader.TrainLoader(images, labels, 16, cfg, seed=3)

    def flipped_in(epoch):
        state = {}
        for [(x, y)] in batches.epoch(epoch):
            for img, label in zip(x, y):
                original = images[label].float()
                assert torch.equal(img, original) or torch.equal(img, original.flip(2))
                state[int(label)] = torch.equal(img, original.flip(2)) and not torch.equal(original, original.flip(2))
        return state
    first, second, third = flipped_in(1), flipped_in(2), flipped_in(3)
    assert all(first[i] != second[i] for i in first) and first == third
    assert 16 < sum(first.values()) < 48  # random, not all one way, in the first epoch


def test_lookahead_pulls_back_toward_the_slow_weights_and_ends_on_them():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    lookahead = Lookahead(model, every=2, decay=0.5, total_steps=4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    lookahead.step(model)  # step 1: no sync
    assert model.weight.eq(1.0).all()
    lookahead.step(model)  # step 2: keep = 0.5**2 * (2/4)**3 = 1/32 of the slow (zero) weights
    assert torch.allclose(model.weight, torch.full((1, 2), 31 / 32))
    saved = lookahead.state_dict()
    with torch.no_grad():
        model.weight.fill_(5.0)
    lookahead.step(model)
    lookahead.step(model)  # the last step: the model becomes the slow weights
    assert torch.allclose(model.weight, torch.full((1, 2), 31 / 32))
    restored = Lookahead(model, every=2, decay=0.5, total_steps=4)
    restored.load_state_dict(saved)
    assert restored.steps == 2 and torch.allclose(restored.slow["weight"], torch.full((1, 2), 31 / 32))


def test_triangular_schedule_and_vector_groups():
    recipe = load_recipe("fast", ["optim.name=sgd", "optim.lr=0.75", "schedule.warmup_epochs=2.3",
                                  "train.whiten_bias_anneal_epochs=null",
                                  "schedule.warmup_start_factor=0.2", "schedule.final_factor=0.07"])
    model = models.create("fastnet")
    optimizer = build_optimizer(model, recipe.optim)
    weights, vectors = optimizer.param_groups
    assert vectors["lr"] == pytest.approx(recipe.optim.vector_lr_scale * weights["lr"])
    # fast's decays shrink the head and the BatchNorm shifts alike at each step, whatever the lr
    assert vectors["lr"] * vectors["weight_decay"] == pytest.approx(weights["lr"] * weights["weight_decay"], rel=1e-3)
    assert all(p.requires_grad for g in optimizer.param_groups for p in g["params"])  # frozen ones left out
    schedule = build_schedule(optimizer, recipe.schedule, total=1000, steps_per_epoch=100)
    lrs = []
    for _ in range(1000):
        lrs.append(optimizer.param_groups[0]["lr"] / recipe.optim.lr)
        optimizer.step()
        schedule.step()
    peak = max(range(1000), key=lambda i: lrs[i])
    assert lrs[0] == pytest.approx(0.2) and 225 <= peak <= 235 and lrs[peak] == pytest.approx(1.0, abs=0.01)
    assert lrs[-1] == pytest.approx(0.07, abs=0.01)


def test_warmup_epochs_become_whole_steps_without_float_error():
    # 0.07 x 100 is 7.000000000000001 in floating point: a bare ceil would warm up for 8 steps.
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    schedule = build_schedule(optimizer, ScheduleConfig(warmup_epochs=0.07, warmup_start_factor=0.1), total=20,
                              steps_per_epoch=100)
    lrs = []
    for _ in range(9):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:8] == pytest.approx([0.1 + 0.9 * t / 7 for t in range(8)]) and lrs[8] == 1.0


def test_a_group_that_freezes_early_anneals_its_lr_over_its_own_steps():
    model = models.create("fastnet")
    recipe = load_recipe("fast", ["train.group_train_epochs=[1, 2]", "train.group_lr_anneal=true"])
    optimizer = build_optimizer(model, recipe.optim)
    before = [(g["lr"], len(g["params"])) for g in optimizer.param_groups]
    first, second = ({id(p): epochs * 10 for p in model.conv_groups[g].parameters()} for g, epochs in ((0, 1), (1, 2)))
    split_by_train_steps(optimizer, {**first, **second})
    # Each group split by the parameters' steps, options kept: no parameter lost or repeated.
    assert sum(len(g["params"]) for g in optimizer.param_groups) == sum(n for _, n in before)
    assert sorted({g["train_steps"] for g in optimizer.param_groups}, key=str) == [10, 20, None]
    schedule = build_schedule(optimizer, recipe.schedule, total=30, steps_per_epoch=10)
    factors = {steps: [] for steps in (10, 20, None)}
    for _ in range(30):
        for group in optimizer.param_groups:
            factors[group["train_steps"]].append(group["lr"] / group["initial_lr"])
        optimizer.step()
        schedule.step()
    # The first group reaches the end of the linear schedule after its 10 steps, the second after 20, the rest
    # after the run's 30, as the plain schedule (LinearLR) does without a split.
    for steps, seen in factors.items():
        n = steps or 30
        assert seen[::len(seen) // 30] == pytest.approx([1 - min(t, n) / n for t in range(30)])


@pytest.mark.parametrize("overrides", [["train.group_lr_anneal=true"],
                                       ["train.group_lr_anneal=true", "train.group_train_epochs=[4]",
                                        "schedule.name=cosine"],
                                       ["train.group_lr_anneal=true", "train.group_train_epochs=[4]",
                                        "schedule.warmup_epochs=1"]])
def test_group_lr_anneal_needs_freezing_groups_and_a_plain_linear_schedule(overrides):
    with pytest.raises(CifarkitError, match=r"^train.group_lr_anneal needs train.group_train_epochs and the linear "):
        load_recipe("fast", overrides)


def test_tta_views_are_mirrors_and_one_pixel_shifts():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    weights, views = zip(*tta_views(x, True))
    assert len(views) == 6 and all(v.shape == x.shape for v in views)
    assert sum(weights) == pytest.approx(1.0) and weights[0] == weights[3] == 0.25
    assert torch.equal(views[0], x) and torch.equal(views[3], x.flip(3))
    assert torch.equal(views[1][..., 1:, 1:], x[..., :-1, :-1])  # content moved one pixel down-right
    assert torch.equal(views[2][..., :-1, :-1], x[..., 1:, 1:])
    assert torch.equal(views[4], views[1].flip(3))
    assert tta_views(x, False) == [(1.0, x)]
    assert [w for w, _ in tta_views(x, True, plain=False)] == list(weights[1:])


def test_selective_tta_gives_the_extra_views_to_the_least_confident_images_only():
    torch.manual_seed(0)
    model = models.create("simplecnn")
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (40,))
    args = dict(mean=CIFAR10_MEAN, std=CIFAR10_STD, device=torch.device("cpu"), precision=PRECISIONS["fp32"],
                batch_size=16)
    with torch.no_grad():
        x = loader.normalize(images, CIFAR10_MEAN, CIFAR10_STD)
        plain = model.eval()(x)
        full = sum(weight * model(view) for weight, view in tta_views(x, True))
    uncertain = plain.softmax(1).amax(1).argsort()[:10]
    expected = plain.clone()
    expected[uncertain] = full[uncertain]
    result = evaluate(model, images, labels, tta=True, tta_share=0.25, **args)
    assert torch.equal(result["predictions"], expected.argmax(1))
    assert result["loss"] == pytest.approx(torch.nn.functional.cross_entropy(expected, labels).item(), rel=1e-5)
    # The share's ends: every image (plain TTA) and none (the single view).
    assert torch.equal(evaluate(model, images, labels, tta=True, tta_share=1.0, **args)["predictions"], full.argmax(1))
    assert torch.equal(evaluate(model, images, labels, tta=True, tta_share=0.0, **args)["predictions"], plain.argmax(1))
    # The loss tells the mixture from either end, so a share applied to the wrong images (or none) fails above.
    losses = [torch.nn.functional.cross_entropy(logits, labels).item() for logits in (plain, full, expected)]
    assert len({round(loss, 5) for loss in losses}) == 3


def test_statistics_against_a_target():
    result = statistics_against([0.941, 0.943, 0.939, 0.942, 0.940], 0.94)
    assert result["mean"] == pytest.approx(0.941) and result["std"] == pytest.approx(0.0015811, rel=1e-4)
    # t = (0.941 - 0.94) / (0.0015811 / sqrt 5) = 1.4142 with 4 degrees of freedom: p = 0.1151, CI half-width 0.001963
    assert result["p_value_mean_above_target"] == pytest.approx(0.1151, abs=2e-4)
    assert result["ci95"] == pytest.approx([0.941 - 0.001963, 0.941 + 0.001963], abs=2e-6)
    assert statistics_against([0.95], 0.94)["std"] is None


def test_difference_of_means_has_the_welch_interval():
    result = difference_of_means([0.941, 0.943, 0.939], [0.938, 0.936, 0.935, 0.939])
    # Standard errors squared 4e-6 / 3 and 3.333e-6 / 4: Welch-Satterthwaite gives 4.19 degrees of freedom, t = 2.727,
    # half-width 2.727 * sqrt(2.1667e-6) = 0.004015 around 0.004; a pooled-variance one would be 0.003725.
    assert result["difference"] == pytest.approx(0.004)
    assert result["ci95"] == pytest.approx([0.004 - 0.004015, 0.004 + 0.004015], abs=2e-6)
    assert difference_of_means([0.94], [0.93, 0.95]) == {"difference": pytest.approx(0.0), "ci95": None}


def test_fast_recipe_smoke_one_epoch(cifar_home, tmp_path):
    """One epoch of the real fast recipe on the sample, TTA evaluation included, learns as much as it was measured
    to: at least the floor under its worst of five seeds (results/test-floors.json)."""
    check = FLOORS["training"]["fast-1-epoch-sample"]
    summary = train.run(load_recipe(check["recipe"], check["overrides"]), out=tmp_path / "fast")
    assert summary["model"] == "fastnet" and summary["test_acc"] >= check["floor"]


def test_whitening_bias_trains_for_its_epochs_then_freezes(cifar_home, tmp_path, monkeypatch):
    after_epoch = []

    def recording(state, *args, **kwargs):
        stats = real_epoch(state, *args, **kwargs)
        after_epoch.append({k: v.clone() for k, v in state.model.state_dict().items()})
        return stats
    real_epoch = train.train_one_epoch
    monkeypatch.setattr(train, "train_one_epoch", recording)
    train.run(load_recipe("fast", ["train.epochs=3", "train.whiten_bias_epochs=1", "train.batch_size=100",
                                   "data.subset=300", "train.tta=false"]), out=tmp_path / "run")
    initial = torch.zeros_like(after_epoch[0]["whiten.bias"])  # init_from_data zeroes it
    assert not torch.equal(after_epoch[0]["whiten.bias"], initial)
    assert torch.equal(after_epoch[2]["whiten.bias"], after_epoch[0]["whiten.bias"])
    assert not torch.equal(after_epoch[2]["head.2.weight"], after_epoch[1]["head.2.weight"])  # the rest trains on


def test_an_annealed_whitening_bias_stops_moving_when_its_own_schedule_ends(cifar_home, tmp_path, monkeypatch):
    """The record's whitening bias: its lr runs the linear schedule to zero in 0.5 epochs (3 steps an epoch: 1.5,
    rounded up to 2 steps), while the rest keeps the run's schedule; it is still computed in epoch 2, unmoved."""
    after_epoch, lrs = [], []

    def recording(state, *args, **kwargs):
        stats = real_epoch(state, *args, **kwargs)
        after_epoch.append({k: v.clone() for k, v in state.model.state_dict().items()})
        bias = next(g for g in state.optimizer.param_groups if any(p is state.model.whiten.bias for p in g["params"]))
        lrs.append((bias["lr"], bias["train_steps"], state.model.whiten.bias.requires_grad))
        return stats
    real_epoch = train.train_one_epoch
    monkeypatch.setattr(train, "train_one_epoch", recording)
    settings = ["train.epochs=3", "train.whiten_bias_epochs=2", "train.whiten_bias_anneal_epochs=0.5",
                "train.batch_size=100", "data.subset=300", "train.tta=false"]
    train.run(load_recipe("fast", settings), out=tmp_path / "run")
    assert lrs == [(0.0, 2, True), (0.0, 2, True), (0.0, 2, False)]
    assert not torch.equal(after_epoch[0]["whiten.bias"], torch.zeros_like(after_epoch[0]["whiten.bias"]))
    assert torch.equal(after_epoch[1]["whiten.bias"], after_epoch[0]["whiten.bias"])
    assert not torch.equal(after_epoch[1]["head.2.weight"], after_epoch[0]["head.2.weight"])  # the rest trains on


@pytest.mark.parametrize("settings", [
    ["train.whiten_bias_epochs=null", "train.whiten_bias_anneal_epochs=0.5"],  # a bias that never freezes
    ["train.whiten_bias_anneal_epochs=1.5"],  # longer than fast's 1 epoch of the bias
    ["train.whiten_bias_anneal_epochs=0"],
    ["train.whiten_bias_anneal_epochs=0.5", "schedule.name=cosine"],
])
def test_a_whitening_bias_anneal_that_cannot_run_its_course_is_refused(settings):
    with pytest.raises(CifarkitError, match="bad value for train.whiten_bias_anneal_epochs"):
        load_recipe("fast", settings)


def test_a_fraction_of_an_epoch_cuts_the_last_one_short_and_the_schedule_ends_with_it(cifar_home, tmp_path,
                                                                                     monkeypatch):
    trained = []

    def recording(state, batches, steps, *args, **kwargs):
        batches = list(batches)
        stats = real_epoch(state, batches, steps, *args, **kwargs)
        trained.append((steps, len(batches), state.optimizer.param_groups[0]["lr"]))
        return stats
    real_epoch = train.train_one_epoch
    monkeypatch.setattr(train, "train_one_epoch", recording)
    out = tmp_path / "run"
    assert main(["train", "--recipe", "fast", "--epochs", "1.5", "--set", "train.batch_size=100", "--subset", "300",
                 "--out", str(out)]) == 0
    # 3 steps an epoch: 1.5 epochs are 4.5 steps, rounded up to 5, and the linear schedule reaches 0 at the 5th
    assert [(steps, drawn) for steps, drawn, _ in trained] == [(3, 3), (2, 2)]
    assert trained[0][2] == pytest.approx(load_recipe("fast").optim.filter_lr * 2 / 5) and trained[1][2] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 1.5 and summary["selected_epoch"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and "test_acc" in records[-1]
    assert "epochs 1.5" in (out / "train.log").read_text()


def test_conv_groups_train_for_their_epochs_then_freeze_without_a_backward_pass(cifar_home, tmp_path, monkeypatch):
    after_epoch, graded = [], []

    def recording(state, *args, **kwargs):
        stats = real_epoch(state, *args, **kwargs)
        after_epoch.append({k: v.clone() for k, v in state.model.state_dict().items()})
        graded.append([group[0].weight.grad is not None for group in state.model.conv_groups])
        return stats
    real_epoch = train.train_one_epoch
    monkeypatch.setattr(train, "train_one_epoch", recording)
    train.run(load_recipe("fast", ["train.epochs=3", "train.group_train_epochs=[1, 2]", "train.batch_size=100",
                                   "data.subset=300", "train.tta=false"]), out=tmp_path / "run")
    # body.1 is the first conv group, body.2 the second: each stops where its epochs end, body.3 trains on.
    changed = [[not torch.equal(after_epoch[e][f"body.{g}.0.weight"], after_epoch[e - 1][f"body.{g}.0.weight"])
                for g in (1, 2, 3)] for e in (1, 2)]
    assert changed == [[False, True, True], [False, False, True]]
    assert torch.equal(after_epoch[2]["body.1.2.bias"], after_epoch[0]["body.1.2.bias"])  # its BatchNorm shift too
    assert graded == [[True, True, True], [False, True, True], [False, False, True]]
    assert all(torch.equal(after_epoch[2][f"body.{g}.2.weight"], torch.ones(w)) for g, w in ((1, 64), (2, 256)))


def test_speedrun_command(cifar_home, tmp_path, capsys):
    out = tmp_path / "speed"
    assert main(["speedrun", "--recipe", "simplecnn", "--runs", "2", "--target", "0.1", "--set", "train.epochs=2",
                 "--set", "data.subset=500", "--out", str(out), "--json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert "| 0 |" in printed and "| 1 |" in printed and "one-sided t-test" in printed
    report = json.loads((tmp_path / "s.json").read_text())
    assert [r["seed"] for r in report["runs"]] == [0, 1]
    assert all(len(r["curve"]) == 2 and r["curve"][1]["elapsed_s"] <= r["wall_time_s"] for r in report["runs"])
    assert report["accuracy"]["n"] == 2 and "wall_time_s" in report["timer_covers"]
    assert (out / "speedrun.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "speedrun.json").read_text())["runs"] == report["runs"]
    # The command as typed, its paths outside the working folder cut to their names.
    typed = ("cifarkit speedrun --recipe simplecnn --runs 2 --target 0.1 --set train.epochs=2 --set data.subset=500 "
             "--out speed --json s.json")
    assert report["command"] == json.loads((out / "speedrun.json").read_text())["command"] == typed


def test_fastnet_convolutions_start_as_partial_identities():
    model = models.create("fastnet")
    convs = [m for m in model.body.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 6
    for conv in convs:
        x = torch.randn(2, conv.in_channels, 8, 8)
        with torch.no_grad():
            out = conv(x)
        assert torch.allclose(out[:, :conv.in_channels], x, atol=1e-6)


def test_newton_schulz_brings_every_singular_value_near_one():
    torch.manual_seed(0)
    # A badly conditioned update, as a gradient dominated by a few directions is: singular values from 1e-3 to 1e3.
    u, _ = torch.linalg.qr(torch.randn(64, 64))
    v, _ = torch.linalg.qr(torch.randn(576, 64))
    given = torch.logspace(3, -3, 64)
    update = u @ torch.diag(given) @ v.T
    relative = given / given.norm()  # the iteration starts from the update over its Frobenius norm
    jordans = OptimConfig().newton_schulz
    for matrix in (update, update.T):
        singular = torch.linalg.svdvals(orthogonalized(matrix, jordans).float())
        # Three quintic iterations put every direction above 1.3% of the norm into Muon's band, about [0.5, 1.5], and
        # multiply the fainter ones by 3.4445^3 = 40.9 (the slope at zero, cubed), down to where bf16's rounding
        # (about 0.01 here) takes over.
        band, faint = relative >= 0.013, (relative < 0.013) & (relative >= 0.003)
        assert singular[band].min() > 0.5 and singular.max() < 1.5
        assert faint.sum() >= 5
        assert torch.allclose(singular[faint] / relative[faint], torch.tensor(40.9), rtol=0.15)
        assert orthogonalized(matrix, jordans).shape == matrix.shape


def test_muon_orthogonalizes_filters_and_steps_the_rest_as_torch_sgd():
    recipe = load_recipe("fast")
    assert recipe.optim.name == "muon"
    torch.manual_seed(0)
    model = models.create("fastnet")
    twin = models.create("fastnet")
    twin.load_state_dict(model.state_dict())
    optimizer = build_optimizer(model, recipe.optim)
    filters, head, vectors = optimizer.param_groups
    assert filters["orthogonalize"] and all(p.ndim == 4 for p in filters["params"]) and filters["weight_decay"] == 0
    assert [p.ndim for p in head["params"]] == [2] and all(p.ndim == 1 for p in vectors["params"])
    # Everything but the filters: torch.optim.SGD with Nesterov momentum and coupled weight decay, to the bit.
    reference = torch.optim.SGD([{"params": [twin.head[2].weight], "lr": head["lr"],
                                  "weight_decay": head["weight_decay"]},
                                 {"params": [p for p in twin.parameters() if p.requires_grad and p.ndim == 1],
                                  "lr": vectors["lr"], "weight_decay": vectors["weight_decay"]}],
                                lr=recipe.optim.lr, momentum=recipe.optim.momentum, nesterov=True)
    twin_filters = [p for p in twin.parameters() if p.requires_grad and p.ndim == 4]
    started = [p.clone() for p in filters["params"]]
    x = torch.randn(8, 3, 32, 32)
    for _ in range(3):
        for net, opt in ((model, optimizer), (twin, reference)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        with torch.no_grad():  # the twin's filters follow Muon's, so both nets see the same gradients next step
            for mine, its in zip(filters["params"], twin_filters):
                its.copy_(mine)
    assert torch.equal(model.head[2].weight, twin.head[2].weight)
    assert all(torch.equal(a, b) for a, b in zip(vectors["params"], reference.param_groups[1]["params"]))
    for p, before in zip(filters["params"], started):
        # Renormalized to sqrt(output channels) before each step, then moved by lr times an update whose singular
        # values are at most about 1.5: its Frobenius norm is at most 1.5 sqrt(rank).
        assert abs(p.norm().item() - len(p) ** 0.5) <= filters["lr"] * 1.5 * min(p[0].numel(), len(p)) ** 0.5
        assert not torch.equal(p, before)


def test_the_recipes_newton_schulz_coefficients_reach_muons_step():
    record = (3.4576, -4.7391, 2.0843)  # the 2025 record's, in place of Jordan's
    torch.manual_seed(0)
    model = models.create("fastnet")
    optimizer = build_optimizer(model, load_recipe("fast", [f"optim.newton_schulz={list(record)}"]).optim)
    filters = optimizer.param_groups[0]
    assert filters["orthogonalize"] and filters["newton_schulz"] == record
    weights = filters["params"][-1]
    before = weights.detach().clone()
    model(torch.randn(8, 3, 32, 32)).square().mean().backward()
    grad = weights.grad.reshape(len(weights), -1).clone()
    optimizer.step()
    renormalized = before * len(before) ** 0.5 / before.norm()
    # A first Nesterov step: the buffer is the gradient, so the update is (1 + momentum) x it.
    update = grad.add(grad, alpha=filters["momentum"])

    def stepped(coefficients):
        orthogonal = orthogonalized(update, coefficients, optimizer.orthogonalize_dtype)
        return renormalized - filters["lr"] * orthogonal.view_as(before)
    assert torch.allclose(weights.detach(), stepped(record), atol=1e-6)
    assert not torch.allclose(weights.detach(), stepped(OptimConfig().newton_schulz), atol=1e-4)


def test_muon_resumes_a_checkpoint_from_before_the_coefficients_were_a_setting():
    model = models.create("fastnet")
    optimizer = build_optimizer(model, load_recipe("fast").optim)
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        del group["newton_schulz"]
    resumed = build_optimizer(model, load_recipe("fast", ["optim.newton_schulz=[3.4576, -4.7391, 2.0843]"]).optim)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["newton_schulz"] == OptimConfig().newton_schulz
    model(torch.randn(4, 3, 32, 32)).square().mean().backward()
    resumed.step()


def test_profile_command_splits_a_step_into_its_parts(cifar_home, tmp_path, capsys):
    out = tmp_path / "profile-fast-test.json"
    assert main(["profile", "--recipe", "fast", "--set", "train.batch_size=100", "--epochs", "2.5", "--steps", "2",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "where a step's time goes" in printed and "minor page faults" in printed and "final evaluation" in printed
    result = json.loads(out.read_text())
    parts = result["parts_s"]
    for part in ("convolution", "convolution backward", "BatchNorm", "activation", "pooling", "augmentation",
                 "optimizer"):
        assert parts[part] > 0, part
    # The parts are disjoint slices of the profiled steps: together they account for the whole step.
    assert sum(parts.values()) == pytest.approx(result["profiled_step_s"], rel=0.05)
    assert result["process_per_step"]["user_s"] > 0 and result["evaluation"]["test_pass_s"] > 0
    assert result["command"].startswith("cifarkit profile")
    convolutions = parts["convolution"] + parts["convolution backward"]
    # 2.5 epochs: two whole ones and half of the third, its steps rounded up
    run_steps = 2 * result["steps_per_epoch"] + math.ceil(result["steps_per_epoch"] / 2)
    assert result["convolutions_s_per_run"] == pytest.approx(convolutions * run_steps)
    assert f"the convolutions alone, forward and backward: {result['convolutions_s_per_run']:.0f} s" in printed
    # Each stretch of epochs that trains the same parameters has its own step time: the whitening bias and the conv
    # groups freeze as the recipe says, and the run's steps add up from them.
    fast = load_recipe("fast", ["train.epochs=2.5"]).train
    stretches = result["step_s_by_epochs"]
    assert stretches[0] == {"epochs": [1, 1], "frozen": [], "step_s": result["step_s"],
                            "run_steps": result["steps_per_epoch"]}
    assert stretches[1]["epochs"][0] == 2 and stretches[1]["frozen"] == ["whiten.bias"]
    assert [s["epochs"][0] for s in stretches[1:]] == [s["epochs"][1] + 1 for s in stretches[:-1]]
    assert stretches[-1]["epochs"][1] == 3 and all(s["step_s"] > 0 for s in stretches)
    assert sum(s["run_steps"] for s in stretches) == run_steps
    frozen_groups = [f"body.{g}" for g, epochs in enumerate(fast.group_train_epochs or (), 1) if epochs < fast.epochs]
    assert set(frozen_groups) <= set(stretches[-1]["frozen"])
    assert result["training_steps_s_per_run"] == pytest.approx(sum(s["step_s"] * s["run_steps"] for s in stretches))
    assert f"a step as each stretch of epochs trains: epoch 1 {1000 * result['step_s']:.1f} ms; epochs 2-" in printed
    # Their FLOP rate (forward, input and weight gradients: 3 x 2 FLOPs per multiply-add) beside a matmul's peak
    macs = profiling.convolution_macs(models.create("fastnet"), result["image_size"])
    assert result["convolution_flop_per_s"] == pytest.approx(6 * macs * 100 / convolutions)
    # ... and as the products the step computes: fewer (cropped outputs, Winograd, the frozen whitening filters)
    assert 0 < result["convolution_computed_flop_per_s"] < result["convolution_flop_per_s"]
    peak = result["matmul_peak"]
    assert peak["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[result["precision"]] and peak["flop_per_s"] > 0
    share = 100 * result["convolution_computed_flop_per_s"] / peak["flop_per_s"]
    assert f"{share:.0f}% of a 2048^3 {peak['dtype']} matmul's" in printed
    # The timed steps are the first epoch's, at its crop size when the recipe starts on low-resolution crops.
    augment = load_recipe("fast").data.augment
    side = augment.early_crop if augment.early_crop_epochs else 32
    assert result["image_size"] == [side, side] and f"of {side}x{side} images" in printed


def test_convolution_macs_are_counted_per_image():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(8, 4, 1, groups=2))
    assert profiling.convolution_macs(net, [32, 32]) == 32 * 32 * 8 * 3 * 9 + 16 * 16 * 4 * 4


def test_computed_convolution_products_follow_each_layers_training_path():
    # fp32 training on the CPU: the pooled 7x7 layer computes its kept 6x6 outputs by F(2x2) (9 blocks of 16
    # products) and has no input gradient (its input needs none); the unpooled 3x3 layer takes F(4x4) on 4x4 (one
    # block of 36), with both gradients. Whatever the CPU: fp32's paths do not depend on its kernel plan.
    net = torch.nn.Sequential(Conv3x3(3, 8, pooled=True), torch.nn.MaxPool2d(2), Conv3x3(8, 8))
    assert profiling.computed_convolution_macs(net, [7, 7], None) == 2 * 9 * 16 * 3 * 8 + 3 * 36 * 8 * 8
    assert profiling.convolution_macs(net, [7, 7]) == 49 * 9 * 3 * 8 + 9 * 9 * 8 * 8  # as direct, every output
    assert net.training  # counted on a copy: the model is as it was
    # A frozen first layer: the plain path (all 49 outputs) and its forward alone; the next input needs no gradient.
    net[0].weight.requires_grad_(False)
    assert profiling.computed_convolution_macs(net, [7, 7], None) == 49 * 9 * 3 * 8 + 2 * 36 * 8 * 8
    # Under torch.compile every Conv3x3 takes the plain path: all outputs, 9 products each.
    assert profiling.computed_convolution_macs(net, [7, 7], None, compiled=True) == 49 * 9 * 3 * 8 + 2 * 9 * 9 * 8 * 8


def test_profile_counts_conv3x3_s_matmul_weight_gradient_as_the_convolution_s():
    """In bf16 on the CPU, Conv3x3's backward runs as pads, copies and matmuls, which aten names as such."""
    conv = Conv3x3(16, 16).train()
    x = torch.randn(8, 16, 3, 3).to(memory_format=torch.channels_last)
    with torch.profiler.profile() as profiled:
        with torch.profiler.record_function("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        with torch.profiler.record_function("backward"):
            y.float().sum().backward()
    matmuls = [e for e in profiled.events() if e.name == "aten::mm"]
    assert matmuls and {profiling.part_of(e) for e in matmuls} == {"convolution backward"}
