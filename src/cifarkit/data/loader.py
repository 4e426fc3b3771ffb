"""Batches of training images on the training device: normalization and augmentation, one generator each."""
from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from cifarkit.core.errors import CifarkitError
from cifarkit.data.config import AugmentConfig, DataConfig


def normalize(x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 N x 3 x H x W -> float32 standardized per channel."""
    shift, scale = _channel_statistics(tuple(mean), tuple(std), x.device)
    return (x.float() - shift) / scale


@functools.lru_cache(maxsize=8)
def _channel_statistics(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and std as 1 x 3 x 1 x 1 tensors on `device`, in uint8 units. Made once per device: built from a
    Python list for every batch, they were a host-to-device copy that waits for the GPU in every training step."""
    return (torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255,
            torch.tensor(std, device=device).view(1, 3, 1, 1) * 255)


def random_shift(x: torch.Tensor, pad: int, mode: str, generator: torch.Generator, size: int | None = None):
    """Each image padded by `pad`, then cropped at a random offset: back to its own size (a random crop / translate),
    or to `size` x `size`."""
    n, _, h, w = x.shape
    out_h, out_w = (size, size) if size else (h, w)
    padded = F.pad(x, (pad, pad, pad, pad), mode=mode) if pad else x
    dy = torch.randint(0, h + 2 * pad - out_h + 1, (n, 1, 1), generator=generator, device=x.device)
    dx = torch.randint(0, w + 2 * pad - out_w + 1, (n, 1, 1), generator=generator, device=x.device)
    rows = dy + torch.arange(out_h, device=x.device).view(1, out_h, 1)
    cols = dx + torch.arange(out_w, device=x.device).view(1, 1, out_w)
    # Advanced indexing around the channel slice gives N x H x W x C, i.e. the channels-last layout for free.
    return padded[torch.arange(n, device=x.device).view(n, 1, 1), :, rows, cols].permute(0, 3, 1, 2)


def random_flip(x: torch.Tensor, generator: torch.Generator, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Mirror the images where `flip` is true; without a mask, each image is mirrored with probability 1/2."""
    if flip is None:
        flip = torch.rand(x.shape[0], generator=generator, device=x.device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Zero a size x size square (clipped at the border) around a uniformly random centre in each image."""
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n, 1, 1), generator=generator, device=x.device)
    cx = torch.randint(0, w, (n, 1, 1), generator=generator, device=x.device)
    rows = torch.arange(h, device=x.device).view(1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, w)
    top, left = cy - size // 2, cx - size // 2
    inside = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size)
    return x * ~inside.unsqueeze(1)


def color_jitter(x: torch.Tensor, brightness: float, contrast: float, generator: torch.Generator) -> torch.Tensor:
    """Shift each normalized image by one random brightness and scale it by one random contrast."""
    draws = torch.rand(2, x.shape[0], 1, 1, 1, generator=generator, device=x.device) * 2 - 1
    return (x + draws[0] * brightness) * (1 + draws[1] * contrast)


def auto_augment(x: torch.Tensor, policy: str, generator: torch.Generator) -> torch.Tensor:
    """torchvision's AutoAugment, one policy draw per image; its global-RNG draws are seeded from `generator`."""
    from torchvision.transforms import v2
    transform = v2.AutoAugment(v2.AutoAugmentPolicy(policy))
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=x.device))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.stack([transform(img) for img in x])


def augment(x: torch.Tensor, cfg: AugmentConfig, mean, std, generator: torch.Generator,
            flip: torch.Tensor | None = None, crop: int | None = None) -> torch.Tensor:
    """uint8 batch -> augmented, normalized float batch, all on x's device. `flip` overrides the random mirroring;
    `crop` cuts each image to a random crop x crop window of its translated self."""
    if cfg.autoaugment:
        x = auto_augment(x, cfg.autoaugment, generator)
    if cfg.crop_pad:
        x = random_shift(x, cfg.crop_pad, "constant", generator)
    x = normalize(x, mean, std)
    if cfg.translate or crop:
        x = random_shift(x, cfg.translate, "reflect", generator, crop)
    if cfg.flip:
        x = random_flip(x, generator, flip)
    if cfg.brightness or cfg.contrast:
        x = color_jitter(x, cfg.brightness, cfg.contrast, generator)
    if cfg.cutout:
        x = cutout(x, cfg.cutout, generator)
    return x


class TrainLoader:
    """Shuffled, augmented, normalized training batches, produced on the data's device.

    Epoch e's order and augmentations depend only on (seed, e), so a resumed run replays them exactly. Full
    batches only: the remainder is dropped, so every step has the same batch size (BatchNorm-friendly).

    A batch can be cut into `shards` equal parts, for the ranks of a distributed run and the micro-batches of
    gradient accumulation; this process takes the shards in `own`. Every process draws the same order from
    (seed, epoch), and shard s is augmented from (seed, epoch, s) alone, so shard s holds the same images whichever
    rank or micro-batch it goes to: 2 ranks see what 1 process accumulating 2 micro-batches sees. Shard 0 goes on
    from the order's generator, which makes one shard the undivided batch of a one-process run.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, cfg: DataConfig, seed: int,
                 memory_format=torch.contiguous_format, shards: int = 1, own: range = range(1)):
        if len(images) < batch_size:
            raise CifarkitError(f"batch size {batch_size} exceeds the {len(images)} training images; "
                                f"lower --batch-size or raise --subset")
        self.images, self.labels, self.batch_size = images, labels, batch_size
        # Per-image targets for the loss (distillation's teacher logits computed once), or None: a micro-batch
        # is then (inputs, labels, targets), else (inputs, labels).
        self.targets: torch.Tensor | None = None
        self.cfg, self.seed, self.memory_format = cfg, seed, memory_format
        self.shard_size, self.own = batch_size // shards, own
        self.steps_per_epoch = len(images) // batch_size
        # Alternating flip (Jordan 2024): random in the first epoch, then each image the other way every epoch,
        # so consecutive epochs see both mirror images instead of a coin toss.
        first_flips = torch.Generator(device=images.device).manual_seed(seed)
        self.first_epoch_flip = torch.rand(len(images), generator=first_flips, device=images.device) < 0.5

    def epoch(self, epoch: int, steps: int | None = None):
        """Each step's micro-batches of this process: a list of (inputs, labels[, targets]), one per shard it owns
        (see `targets`). `steps`: the first so many of the epoch's steps (a run's cut-short last epoch); None: all
        of them."""
        device = self.images.device
        generator = torch.Generator(device=device).manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.images), generator=generator, device=device)
        generators = {s: generator if s == 0 else torch.Generator(device=device).manual_seed(
            int(np.random.SeedSequence([self.seed, epoch, s]).generate_state(1, np.uint64)[0])) for s in self.own}
        crop = self.crop(epoch)
        for step in range(self.steps_per_epoch if steps is None else steps):
            micro_batches = []
            with record_function("augmentation"):
                for s in self.own:
                    start = step * self.batch_size + s * self.shard_size
                    idx = order[start:start + self.shard_size]
                    flip = self.first_epoch_flip[idx] ^ (epoch % 2 == 0) if self.cfg.augment.alternate_flip else None
                    inputs = augment(self.images[idx], self.cfg.augment, self.cfg.mean, self.cfg.std, generators[s],
                                     flip, crop)
                    per_image = (self.labels[idx],) if self.targets is None else (self.labels[idx], self.targets[idx])
                    micro_batches.append((inputs.contiguous(memory_format=self.memory_format), *per_image))
            yield micro_batches

    def crop(self, epoch: int) -> int | None:
        """The window epoch `epoch`'s images are cut to (data.augment.early_crop), or None: whole images."""
        return self.cfg.augment.early_crop if epoch <= self.cfg.augment.early_crop_epochs else None

    def endless(self):
        """Steps without end, epoch after epoch: for measurements that count steps, not epochs."""
        return itertools.chain.from_iterable(self.epoch(epoch) for epoch in itertools.count(1))

