"""The C kernels (`models/cpu_kernels.c`, built by `core/native.py`) against torch's: the max-pool bit for bit,
BatchNorm + GELU to a bf16 rounding."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cifarkit import models
from cifarkit.core import native
from cifarkit.models import kernels

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(BITS[t.dtype])


def same_bits(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Equal bit for bit, but for a NaN, which only has to be a NaN (torch's bf16 kernel sets its own bits)."""
    nan = expected.isnan()
    number = ~nan.contiguous().view(-1)
    return torch.equal(nan, actual.isnan()) and torch.equal(bits(expected)[number], bits(actual)[number])


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A fresh build of the kernel into a temporary CIFARKIT_HOME."""
    monkeypatch.setenv("CIFARKIT_HOME", str(tmp_path))
    native.load.cache_clear()
    yield
    native.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 5, 9, 11), (3, 64, 31, 31), (2, 16, 8, 6), (2, 3, 2, 3)])
def test_the_kernel_pools_and_passes_gradients_as_torch_does(built, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    x.view(-1)[::7] = 0.5  # ties within windows: the first in row-major order wins
    x.view(-1)[[3, 4, 30]] = float("nan")  # a NaN wins, a later NaN over an earlier one
    x = x.contiguous(memory_format=torch.channels_last)
    theirs, ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert kernels.pool_uses_kernel(ours)
    pooled_theirs, pooled_ours = F.max_pool2d(theirs, 2), kernels.MaxPool2x2()(ours)
    grad = torch.randn(pooled_theirs.shape).to(dtype)
    grad.view(-1)[::5] = -0.0  # torch adds each gradient to a zero, which makes -0 a +0
    grad = grad.contiguous(memory_format=torch.channels_last)
    pooled_theirs.backward(grad)
    pooled_ours.backward(grad)
    assert pooled_ours.is_contiguous(memory_format=torch.channels_last)
    assert same_bits(pooled_theirs, pooled_ours)
    assert same_bits(theirs.grad, ours.grad)


def test_a_fastnet_training_step_is_the_same_with_the_pool_kernel(built, monkeypatch):
    monkeypatch.setattr(kernels, "norm_act_uses_kernel", lambda norm, act, x: False)  # the pool alone is exact
    torch.manual_seed(0)
    model = models.create("fastnet").to(memory_format=torch.channels_last)
    images = torch.randn(16, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (16,))
    calls = []
    real_apply = kernels.MaxPool2x2Function.apply
    monkeypatch.setattr(kernels.MaxPool2x2Function, "apply", lambda x: calls.append(x.shape) or real_apply(x))

    def gradients():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with_kernel = gradients()
    assert len(calls) == 3  # one pool per conv group
    monkeypatch.setattr(kernels, "pool_uses_kernel", lambda x: False)
    without = gradients()
    assert len(calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(with_kernel, without, strict=True))


@pytest.mark.parametrize("case", ["no gradient", "evaluation", "NCHW", "float64", "one row"])
def test_torch_pools_where_the_kernel_does_not_apply(built, case):
    x = torch.randn(2, 4, 6, 6 if case != "one row" else 1)
    x = x.double() if case == "float64" else x
    x = x if case == "NCHW" else x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(case != "no gradient")
    with torch.no_grad() if case == "evaluation" else torch.enable_grad():
        assert not kernels.pool_uses_kernel(x)


def test_without_a_compiler_or_when_switched_off_the_pool_is_torch_s(built, monkeypatch, caplog):
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    monkeypatch.setattr(native, "compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="cifarkit"):
        assert not kernels.pool_uses_kernel(x)
    assert "no C compiler" in caplog.text
    native.load.cache_clear()
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert native.load(kernels.SOURCE) is None
    assert torch.equal(kernels.MaxPool2x2()(x), F.max_pool2d(x, 2))


def test_a_build_is_cached_by_its_source_and_a_failed_one_leaves_nothing(built, tmp_path, caplog):
    assert native.load(kernels.SOURCE) is not None
    libraries = list((tmp_path / "native").iterdir())
    assert [path.name.startswith("cpu_kernels-") and path.suffix == ".so" for path in libraries] == [True]
    modified = libraries[0].stat().st_mtime_ns
    native.load.cache_clear()
    assert native.load(kernels.SOURCE) is not None
    assert libraries[0].stat().st_mtime_ns == modified  # not rebuilt

    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        assert native.load(broken) is None
    assert "compiling broken.c failed" in caplog.text
    assert sorted(path.name for path in (tmp_path / "native").iterdir()) == [libraries[0].name]


def norm_and_act(channels: int) -> tuple[nn.BatchNorm2d, nn.GELU]:
    """fastnet's pair: a BatchNorm with its scale frozen and momentum 0.4, then exact GELU."""
    norm = nn.BatchNorm2d(channels, momentum=0.4, eps=1e-12)
    norm.weight.requires_grad_(False)
    with torch.no_grad():
        norm.bias.normal_(0, 0.3)
        norm.running_var.uniform_(0.5, 2)
    return norm, nn.GELU()


def within_a_bf16_rounding(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """A bf16 rounding of each element, or of the largest where a difference cancels to a small one."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-9 * expected.abs().max().item())


@pytest.mark.parametrize("shape", [(64, 32, 15, 15), (96, 256, 3, 3), (3, 5, 2, 3)])
def test_batch_norm_then_gelu_is_torch_s_to_a_bf16_rounding(built, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 0.5).bfloat16().contiguous(memory_format=torch.channels_last)
    grad = torch.randn(shape).bfloat16().contiguous(memory_format=torch.channels_last)
    norm, act = norm_and_act(shape[1])
    theirs = copy.deepcopy(norm)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert kernels.norm_act_uses_kernel(norm, act, ours_x)
    calls = []
    real_apply = kernels.BatchNormGELUFunction.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels.BatchNormGELUFunction, "apply", lambda *a: calls.append(1) or real_apply(*a))
        ours_y = kernels.norm_act(norm, act, ours_x)
    theirs_y = act(theirs(theirs_x))
    ours_y.backward(grad)
    theirs_y.backward(grad)
    assert calls == [1] and ours_y.dtype == torch.bfloat16
    assert ours_y.is_contiguous(memory_format=torch.channels_last)
    within_a_bf16_rounding(theirs_y, ours_y)
    within_a_bf16_rounding(theirs_x.grad, ours_x.grad)
    # Most elements are torch's exactly; the rest differ by the last bit the batch statistics' order moves.
    assert (ours_y != theirs_y).float().mean() < 0.02 and (ours_x.grad != theirs_x.grad).float().mean() < 0.02
    torch.testing.assert_close(norm.bias.grad, theirs.bias.grad, rtol=1e-3, atol=1e-4)
    assert norm.weight.grad is None
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(norm, name), getattr(theirs, name), rtol=1e-5, atol=1e-6)
    assert norm.num_batches_tracked == theirs.num_batches_tracked == 1


def test_gelu_tables_are_torch_s_values(built):
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    forward, derivative = kernels.gelu_tables()
    assert same_bits(F.gelu(values), forward.bfloat16())
    grad = torch.full((1 << 16,), 1.5, dtype=torch.bfloat16)
    assert same_bits(torch.ops.aten.gelu_backward(grad, values), (grad.float() * derivative).bfloat16())


@pytest.mark.parametrize("case", ["evaluation", "fp32", "tanh GELU", "ReLU", "no running statistics", "NCHW"])
def test_torch_normalizes_where_the_fused_kernel_does_not_apply(built, case):
    norm, act = norm_and_act(4)
    act = nn.GELU(approximate="tanh") if case == "tanh GELU" else nn.ReLU() if case == "ReLU" else act
    norm = nn.BatchNorm2d(4, track_running_stats=False) if case == "no running statistics" else norm
    norm.train(case != "evaluation")
    x = torch.randn(2, 4, 6, 6).to(torch.float32 if case == "fp32" else torch.bfloat16)
    x = (x if case == "NCHW" else x.contiguous(memory_format=torch.channels_last)).requires_grad_()
    assert not kernels.norm_act_uses_kernel(norm, act, x)
    torch.testing.assert_close(kernels.norm_act(norm, act, x), act(norm(x)), rtol=0, atol=0)


def test_a_fastnet_step_with_the_kernels_is_as_close_to_exact_arithmetic_as_torch_s(built, monkeypatch):
    """Both bf16 steps are some way from the float64 step; with the fused kernel, no further than torch's own."""
    torch.manual_seed(0)
    model = models.create("fastnet").to(memory_format=torch.channels_last)
    images = torch.randn(64, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (64,))

    def gradients(net, dtype=torch.bfloat16):
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            F.cross_entropy(net(images.to(dtype if dtype == torch.float64 else torch.float32)), labels).backward()
        return [p.grad.double() for p in net.parameters() if p.grad is not None]

    exact = gradients(copy.deepcopy(model).double(), torch.float64)
    fused = gradients(model)
    monkeypatch.setattr(kernels, "norm_act_uses_kernel", lambda norm, act, x: False)
    plain = gradients(model)
    for e, f, p in zip(exact, fused, plain, strict=True):
        assert (f - e).norm() <= 1.1 * (p - e).norm() + 1e-3 * e.norm()
