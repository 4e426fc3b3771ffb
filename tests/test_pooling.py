"""The C max-pool kernel (`models/max_pool_2x2.c`, built by `core/native.py`) against torch's, bit for bit."""
import logging

import pytest
import torch
import torch.nn.functional as F

from cifarkit import models
from cifarkit.core import native
from cifarkit.models import pooling

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
    assert pooling.uses_kernel(ours)
    pooled_theirs, pooled_ours = F.max_pool2d(theirs, 2), pooling.MaxPool2x2()(ours)
    grad = torch.randn(pooled_theirs.shape).to(dtype)
    grad.view(-1)[::5] = -0.0  # torch adds each gradient to a zero, which makes -0 a +0
    grad = grad.contiguous(memory_format=torch.channels_last)
    pooled_theirs.backward(grad)
    pooled_ours.backward(grad)
    assert pooled_ours.is_contiguous(memory_format=torch.channels_last)
    assert same_bits(pooled_theirs, pooled_ours)
    assert same_bits(theirs.grad, ours.grad)


def test_a_fastnet_training_step_is_the_same_with_the_kernel(built, monkeypatch):
    torch.manual_seed(0)
    model = models.create("fastnet").to(memory_format=torch.channels_last)
    images = torch.randn(16, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (16,))
    calls = []
    real_apply = pooling.MaxPool2x2Function.apply
    monkeypatch.setattr(pooling.MaxPool2x2Function, "apply", lambda x: calls.append(x.shape) or real_apply(x))

    def gradients():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with_kernel = gradients()
    assert len(calls) == 3  # one pool per conv group
    monkeypatch.setattr(pooling, "uses_kernel", lambda x: False)
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
        assert not pooling.uses_kernel(x)


def test_without_a_compiler_or_when_switched_off_the_pool_is_torch_s(built, monkeypatch, caplog):
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    monkeypatch.setattr(native, "compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="cifarkit"):
        assert not pooling.uses_kernel(x)
    assert "no C compiler" in caplog.text
    native.load.cache_clear()
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert native.load(pooling.SOURCE) is None
    assert torch.equal(pooling.MaxPool2x2()(x), F.max_pool2d(x, 2))


def test_a_build_is_cached_by_its_source_and_a_failed_one_leaves_nothing(built, tmp_path, caplog):
    assert native.load(pooling.SOURCE) is not None
    libraries = list((tmp_path / "native").iterdir())
    assert [path.name.startswith("max_pool_2x2-") and path.suffix == ".so" for path in libraries] == [True]
    modified = libraries[0].stat().st_mtime_ns
    native.load.cache_clear()
    assert native.load(pooling.SOURCE) is not None
    assert libraries[0].stat().st_mtime_ns == modified  # not rebuilt

    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with caplog.at_level(logging.WARNING, logger="cifarkit"):
        assert native.load(broken) is None
    assert "compiling broken.c failed" in caplog.text
    assert sorted(path.name for path in (tmp_path / "native").iterdir()) == [libraries[0].name]
