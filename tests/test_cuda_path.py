"""The CUDA training path (fp16 autocast + GradScaler, data and batches on the training device), driven on the CPU.

CI has no GPU. torch's CPU autocast computes in fp16 and GradScaler accepts CPU tensors, so everything a CUDA run
does apart from the kernels themselves runs here: scale, unscale before clipping, skipped steps on overflow, the
scaler's state in checkpoints. `--precision fp16` stays refused on the CPU for users (it is emulated and slow).
"""
import pytest
import torch
from safetensors.torch import load_file

from cifarkit import models
from cifarkit.core.device import PRECISIONS
from cifarkit.data import loader
from cifarkit.data.config import DataConfig
from cifarkit.training import checkpoint, train
from cifarkit.training.config import load_recipe
from cifarkit.training.engine import ClassificationLoss, TrainState, train_one_epoch


@pytest.fixture
def fp16_everywhere(monkeypatch):
    """What `auto` picks on a CUDA device, forced for the CPU run under test."""
    monkeypatch.setattr(train, "pick_precision", lambda preference, device: PRECISIONS["fp16"])


def test_a_run_trains_in_fp16_with_a_grad_scaler(cifar_home, tmp_path, fp16_everywhere):
    # SimpleCNN and few images: fp16 convolutions are emulated on CPUs without native fp16, ~100x slower than bf16.
    out = tmp_path / "run"
    recipe = load_recipe("simplecnn", ["train.epochs=1", "train.batch_size=50", "data.subset=100",
                                       "train.grad_clip=5.0"])
    summary = train.run(recipe, out=out)
    assert summary["precision"] == "fp16"
    scaler_state = checkpoint.load_training(out / "checkpoints" / "last.pt")["scaler"]
    assert scaler_state["scale"] > 0  # a disabled scaler saves an empty state
    weights = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    optimizer_state = checkpoint.load_training(out / "checkpoints" / "last.pt")["optimizer"]["state"]
    assert optimizer_state  # Adam keeps no state until a step is taken, so steps were not all skipped


@pytest.mark.unit
def test_fp16_steps_with_a_grad_scaler_lower_the_loss():
    """The scaled fp16 steps must still descend: scaling, unscaling and clipping may not distort the update."""
    torch.manual_seed(0)
    model = models.create("simplecnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState(model=model, forward=model, optimizer=optimizer,
                       scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                       scaler=torch.amp.GradScaler("cpu"), ema=None)
    inputs, labels = torch.randn(16, 3, 32, 32), torch.arange(16) % 10  # small: fp16 is emulated on CPUs

    def loss():
        model.eval()
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(inputs), labels).item()
    before = loss()
    train_one_epoch(state, [[(inputs, labels)]] * 4, 4, 16, ClassificationLoss(), torch.device("cpu"),
                    PRECISIONS["fp16"], grad_clip=1.0)
    assert loss() < before and state.scaler.get_scale() == 2.0**16  # no step overflowed and none was skipped


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the skipped step's warning
@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_overflowing_fp16_gradients_skip_the_step_and_back_off_the_scale(grad_clip):
    torch.manual_seed(0)
    model = models.create("simplecnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # A scale so large that the fp16 backward overflows: the step must be skipped, also after clipping.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    state = TrainState(model=model, forward=model, optimizer=optimizer,
                       scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), scaler=scaler,
                       ema=None)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(8) % 10
    batches = loader.TrainLoader(images, labels, batch_size=8, cfg=DataConfig(), seed=0)
    train_one_epoch(state, batches.epoch(1), 1, 8, ClassificationLoss(), torch.device("cpu"),
                    PRECISIONS["fp16"], grad_clip)
    after = model.state_dict()
    for name, value in before.items():
        if name.endswith(("weight", "bias")):
            assert torch.equal(after[name], value), name
    assert scaler.get_scale() == 2.0**59


@pytest.mark.unit
def test_training_batches_are_made_on_the_datas_device():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    batches = loader.TrainLoader(images, torch.arange(64) % 10, batch_size=32, cfg=DataConfig(), seed=0,
                              memory_format=torch.channels_last)
    for [(inputs, labels)] in batches.epoch(1):
        assert inputs.device == images.device and labels.device == images.device
        assert inputs.dtype == torch.float32 and inputs.is_contiguous(memory_format=torch.channels_last)

