"""What a CUDA run does differently, driven on the CPU (CI has no GPU): the precision and compile choices, native bf16
that never counts emulation, a warm-up before the clock that leaves no trace in the run, speed runs without
checkpoints, and batches that build no tensor from Python values per step. The GPU itself is checked by
lab/device_check.sh, which runs lab/check_cuda_steps.py under torch.cuda's sync debug mode."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from cifarkit.cli import main
from cifarkit.core import device
from cifarkit.core.errors import CifarkitError
from cifarkit.data import loader
from cifarkit.tools import speedrun
from cifarkit.training import engine, optim, train
from cifarkit.training.config import load_recipe


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """A CUDA device of a given compute capability, as far as torch.cuda's queries go."""
    def fake(major: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(major=major, minor=0))
    return fake


@pytest.mark.unit
@pytest.mark.parametrize("major, native", [(7, False), (8, True), (9, True)])
def test_bf16_counts_as_native_on_cuda_from_ampere_on(gpu_of_capability, major, native):
    """A V100 or T4 (7.x) runs bf16 emulated, though torch.cuda.is_bf16_supported() says yes there: auto training
    takes fp16 with its GradScaler instead, and Muon's Newton-Schulz fp32."""
    gpu_of_capability(major)
    cuda = torch.device("cuda")
    assert device.cuda_has_bf16() is native
    assert device.pick_precision("auto", cuda).name == ("bf16" if native else "fp16")
    assert optim.newton_schulz_dtype(cuda) == (torch.bfloat16 if native else torch.float32)


@pytest.mark.unit
def test_no_cuda_means_no_cuda_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.cuda_has_bf16() is False


@pytest.mark.unit
def test_compile_auto_compiles_on_cuda_only():
    cfg = load_recipe("fast").train
    assert cfg.compile == "auto" and cfg.compiles("cuda") and not cfg.compiles("cpu") and not cfg.compiles("mps")
    assert not load_recipe("fast", ["train.compile=false"]).train.compiles("cuda")
    assert load_recipe("fast", ["train.compile=true"]).train.compiles("cpu")
    with pytest.raises(CifarkitError, match=r"bad value for train.compile: 'always' \(choose from auto, True, False\)"):
        load_recipe("fast", ["train.compile=always"])


def test_no_compile_and_a_set_of_the_same_field_is_refused(capsys):
    assert main(["train", "--no-compile", "--set", "train.compile=true"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--set train.compile=true and --no-compile both set train.compile; give it once")


@pytest.mark.unit
def test_normalization_builds_its_statistics_once_per_device():
    """Built from Python lists for every batch, the mean and std were a blocking host-to-device copy per step."""
    loader._channel_statistics.cache_clear()
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    first, second = (loader.normalize(images, mean, std) for _ in range(2))
    expected = (images.float() - torch.tensor(mean).view(1, 3, 1, 1) * 255) / (torch.tensor(std).view(1, 3, 1, 1) * 255)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert loader._channel_statistics.cache_info().misses == 1


def test_the_warm_up_leaves_no_trace_in_the_run(cifar_home, tmp_path, monkeypatch):
    """A run warmed up before its clock (torch.compile is on: here an identity, as the CPU's compiler would take
    minutes) ends on the weights of the same run without one, bit for bit: the model, Muon's momentum, the schedule,
    the EMA, lookahead's slow weights and the random streams all come back. Its warm-up steps each freeze state the
    run goes through: the whitening bias trains in epoch 1 only."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    warm_epochs = []
    real_epoch = train.train_one_epoch

    def spy(state, batches, steps, *args, **kwargs):
        if not kwargs.get("progress", True):  # the warm-up's steps show no progress bar
            warm_epochs.append((steps, state.model.whiten.bias.requires_grad))
        return real_epoch(state, batches, steps, *args, **kwargs)
    monkeypatch.setattr(train, "train_one_epoch", spy)
    quick = ["train.epochs=3", "train.batch_size=100", "data.subset=500", "train.ema_decay=0.9",
             "train.lookahead_every=3", "train.device=cpu"]
    warmed = train.run(load_recipe("fast", [*quick, "train.compile=true"]), out=tmp_path / "warmed")
    assert warm_epochs == [(train.WARMUP_STEPS, True), (train.WARMUP_STEPS, False)]
    plain = train.run(load_recipe("fast", [*quick, "train.compile=false"]), out=tmp_path / "plain")
    assert warmed["warmup_s"] > 0 and plain["warmup_s"] == 0
    ours, theirs = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("warmed", "plain"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert warmed["test_acc"] == plain["test_acc"]


def test_a_speed_run_writes_no_checkpoint(cifar_home, tmp_path):
    """Its time cannot be resumed, and on a GPU a checkpoint per epoch is a real share of a run of seconds."""
    report = speedrun.run("simplecnn", runs=1, target=0.5, out_dir=tmp_path / "speed", curve=False,
                          overrides=("train.epochs=2", "train.batch_size=50", "data.subset=200"))
    run_dir = tmp_path / "speed" / "seed0"
    assert (run_dir / "model.safetensors").is_file() and not (run_dir / "checkpoints" / "last.pt").exists()
    assert report["runs"][0]["warmup_s"] == 0  # a CPU run, not compiled: nothing to warm up
    assert "No checkpoints are written" in report["timer_covers"]
    trained = json.loads((run_dir / "summary.json").read_text())
    assert trained["epochs"] == 2
    # A run of `cifarkit train` keeps its checkpoint, for --resume.
    train.run(load_recipe("simplecnn", ["train.epochs=1", "train.batch_size=50", "data.subset=200"]),
              out=tmp_path / "kept")
    assert (tmp_path / "kept" / "checkpoints" / "last.pt").is_file()


@pytest.mark.unit
def test_a_step_reports_device_tensors_and_counts():
    """train_step adds what it sums to the loop's tensors on the device, never read on the host: reading one would
    wait for a GPU. The images drawn and trained on are counts the loop keeps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = engine.TrainState(model=model, forward=model, optimizer=optimizer,
                              scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                              scaler=torch.amp.GradScaler("cpu", enabled=False), ema=None)
    inputs, labels = torch.randn(8, 3, 4, 4), torch.arange(8) % 10
    before = model[1].weight.detach().clone()
    loss, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
    trained, drawn = engine.train_step(state, [(inputs[:4], labels[:4]), (inputs[4:], labels[4:])],
                                       engine.ClassificationLoss(), torch.device("cpu"), device.PRECISIONS["fp32"],
                                       grad_clip=None, loss_sum=loss, correct=correct)
    assert (trained, drawn) == (8, 8) and 0 <= correct.item() <= 8
    with torch.no_grad():
        after = torch.nn.functional.cross_entropy(model(inputs), labels)
    assert not torch.equal(before, model[1].weight)
    assert 0 < after.item() < loss.item() / 8  # one step of SGD on these 8 images lowered their mean loss


def test_after_the_warm_up_the_run_compiles_nothing(cifar_home, tmp_path, monkeypatch):
    """The warm-up exists to take compilation off the clock: every graph the run needs (the whitening bias trains in
    epoch 1 only, so two) is made before it, and the timed epochs then compile nothing, whatever the restored state.
    torch.compile with its aot_eager backend here: dynamo's guards and recompiles are the same as inductor's, without
    the C++ compiler's minutes."""
    import torch._dynamo
    real_compile, real_warm_up = torch.compile, train.warm_up
    monkeypatch.setattr(torch, "compile", lambda model, **options: real_compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]  # counts for the whole process: read as differences
    counted = {"before": graphs["unique_graphs"]}

    def warm_up_then_forbid_compiling(recipe, setup):
        seconds = real_warm_up(recipe, setup)
        counted["after warm-up"] = graphs["unique_graphs"]
        torch._dynamo.config.error_on_recompile = True
        return seconds
    monkeypatch.setattr(train, "warm_up", warm_up_then_forbid_compiling)
    # dynamo's own patch restores the setting on exit; pytest's monkeypatch would delete it from the config module,
    # which hides it from dynamo for the rest of the process
    with torch._dynamo.config.patch(error_on_recompile=False):
        train.run(load_recipe("fast", ["train.epochs=3", "train.batch_size=100", "data.subset=500",
                                       "train.device=cpu", "train.compile=true"]), out=tmp_path / "run")
    assert counted["after warm-up"] - counted["before"] == 2
    assert graphs["unique_graphs"] == counted["after warm-up"]
    torch._dynamo.reset()
