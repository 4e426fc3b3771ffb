import pytest
import torch

from cifarkit.core.errors import CifarkitError
from cifarkit.data import loader
from cifarkit.data.config import CIFAR10_MEAN, CIFAR10_STD, AugmentConfig, DataConfig
from cifarkit.training import config

pytestmark = pytest.mark.unit


def images(n=64, seed=0):
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


ALL = AugmentConfig(crop_pad=4, translate=2, flip=True, cutout=16)


@pytest.mark.parametrize("cfg", [AugmentConfig(), ALL, AugmentConfig(autoaugment="cifar10", crop_pad=4, flip=True)])
def test_shape_dtype_and_range(cfg):
    out = loader.augment(images(), cfg, CIFAR10_MEAN, CIFAR10_STD, gen())
    assert out.shape == (64, 3, 32, 32) and out.dtype == torch.float32
    lowest = min((0 - m) / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD))
    highest = max((1 - m) / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD))
    assert out.min() >= lowest - 1e-5 and out.max() <= highest + 1e-5


@pytest.mark.parametrize("cfg", [ALL, AugmentConfig(autoaugment="cifar10")])
def test_seeded(cfg):
    x = images()
    a = loader.augment(x, cfg, CIFAR10_MEAN, CIFAR10_STD, gen(1))
    b = loader.augment(x, cfg, CIFAR10_MEAN, CIFAR10_STD, gen(1))
    c = loader.augment(x, cfg, CIFAR10_MEAN, CIFAR10_STD, gen(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_autoaugment_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader.augment(images(8), AugmentConfig(autoaugment="cifar10"), CIFAR10_MEAN, CIFAR10_STD, gen())
    assert torch.equal(torch.rand(3), expected)


def test_normalize_uses_the_cifar_statistics():
    x = torch.full((1, 3, 32, 32), 128, dtype=torch.uint8)
    out = loader.normalize(x, CIFAR10_MEAN, CIFAR10_STD)
    for c in range(3):
        assert out[0, c].unique().item() == pytest.approx((128 / 255 - CIFAR10_MEAN[c]) / CIFAR10_STD[c], rel=1e-5)


def test_random_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = images(32)
    out = loader.random_shift(x, 4, "constant", gen(3))
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(len(x)):
        windows = [(dy, dx) for dy in range(9) for dx in range(9)
                   if torch.equal(padded[i, :, dy:dy + 32, dx:dx + 32], out[i])]
        assert windows, f"image {i} is not a crop of its padded original"
    assert not torch.equal(out, x)


def test_flip_mirrors_about_half_the_images():
    x = images(400)
    out = loader.random_flip(x, gen())
    flipped = sum(torch.equal(o, i.flip(2)) for o, i in zip(out, x))
    kept = sum(torch.equal(o, i) for o, i in zip(out, x))
    assert flipped + kept == 400 and 140 < flipped < 260


def test_cutout_zeroes_at_most_a_16_pixel_square():
    x = torch.ones(200, 3, 32, 32)
    out = loader.cutout(x, 16, gen())
    zeros = (out[:, 0] == 0).sum(dim=(1, 2))
    assert zeros.max() == 256 and zeros.min() >= 64  # a centre in a corner still clips to 8x8
    assert torch.equal(out[:, 0] == 0, out[:, 2] == 0)  # the same square in every channel


def test_early_crop_is_a_window_of_the_translated_image():
    x = images(32)
    out = loader.augment(x, AugmentConfig(translate=2), (0, 0, 0), (1 / 255,) * 3, gen(4), crop=24)
    assert out.shape == (32, 3, 24, 24) and out.is_contiguous(memory_format=torch.channels_last)
    padded = torch.nn.functional.pad(x.float(), (2, 2, 2, 2), mode="reflect")
    offsets = set()
    for i in range(len(x)):
        windows = [(dy, dx) for dy in range(13) for dx in range(13)
                   if torch.equal(padded[i, :, dy:dy + 24, dx:dx + 24], out[i])]
        assert windows, f"image {i} is not a 24-pixel window of its padded original"
        offsets.update(windows)
    assert len(offsets) > 10  # the window's place is drawn per image, across the whole padded image


def test_loader_crops_only_the_early_epochs():
    cfg = DataConfig(augment=AugmentConfig(translate=2, early_crop=20, early_crop_epochs=2))
    batches = loader.TrainLoader(images(64), torch.arange(64) % 10, 32, cfg, seed=0)
    sizes = [{tuple(inputs.shape[2:]) for batch in batches.epoch(e) for inputs, _ in batch} for e in (1, 2, 3)]
    assert sizes == [{(20, 20)}, {(20, 20)}, {(32, 32)}]


@pytest.mark.parametrize("crop, epochs, problem", [(0, 2, "early_crop: 0"), (32, 1, "early_crop: 32"),
                                                    (24, -1, "early_crop_epochs: -1")])
def test_bad_early_crop_is_refused(crop, epochs, problem):
    with pytest.raises(CifarkitError, match=problem):
        config.load_recipe("fast", [f"data.augment.early_crop={crop}", f"data.augment.early_crop_epochs={epochs}"])


def test_color_jitter_shifts_and_scales_each_image_by_one_draw_in_range():
    x = torch.randn(300, 3, 8, 8)
    shifted = loader.color_jitter(x, 0.2, 0.0, gen())
    shift = (shifted - x).flatten(1)
    assert torch.allclose(shift, shift[:, :1].expand_as(shift), atol=1e-6)  # one brightness per image
    assert shift.abs().max() <= 0.2 and shift[:, 0].std() > 0.08  # spread over the range, not a constant
    scaled = loader.color_jitter(x, 0.0, 0.3, gen())
    scale = (scaled / x).flatten(1)
    assert torch.allclose(scale, scale[:, :1].expand_as(scale), atol=1e-4)  # one contrast per image
    assert ((scale - 1).abs().max() <= 0.3) and scale[:, 0].std() > 0.12
    assert torch.equal(loader.color_jitter(x, 0.2, 0.3, gen(5)), loader.color_jitter(x, 0.2, 0.3, gen(5)))


@pytest.mark.parametrize("key, value", [("brightness", -0.1), ("contrast", 1.0)])
def test_bad_color_jitter_is_refused(key, value):
    with pytest.raises(CifarkitError, match=f"data.augment.{key}: {value}"):
        config.load_recipe("fast", [f"data.augment.{key}={value}"])
