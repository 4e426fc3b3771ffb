import json

import pytest
import torch

from cifarkit import models
from cifarkit.cli import main
from cifarkit.errors import CifarkitError



def fastnet_params(w1, w2, w3):
    """Whitening conv (2x2, 3->24, bias), three groups of two bias-free 3x3 convs with BatchNorm, a 10-way head."""
    widths = [(24, w1), (w1, w2), (w2, w3)]
    convs = sum(9 * c_in * c_out + 9 * c_out * c_out for c_in, c_out in widths)
    norms = sum(2 * 2 * c_out for _, c_out in widths)
    return 3 * 24 * 4 + 24 + convs + norms + 10 * w3


# The write-ups state these counts; cifar10net's is exact, resnet18's is "about 11.2M".
EXPECTED_PARAMS = {"cifar10net": (815_018, 815_018), "simplecnn": (113_738, 113_738),
                   "resnet18": (11_150_000, 11_300_000),
                   "fastnet": (fastnet_params(64, 256, 256),) * 2,
                   "fastnet_wide": (fastnet_params(128, 384, 384),) * 2}


@pytest.mark.parametrize("name", models.names())
def test_registry_model_counts_and_forward(name):
    model = models.create(name)
    low, high = EXPECTED_PARAMS[name]
    assert low <= models.count_params(model) <= high
    out = model.eval()(torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last))
    assert out.shape == (2, 10)


def test_resnet18_keeps_full_resolution_in_the_stem():
    model = models.create("resnet18")
    stem_convs = [m for m in model.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.kernel_size for c in stem_convs] == [(3, 3)] * 3 and all(c.stride == (1, 1) for c in stem_convs)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())


def test_unknown_model_lists_the_choices():
    with pytest.raises(CifarkitError, match="unknown model 'resnet50'; choose from cifar10net, fastnet, fastnet_wide, resnet18, simplecnn"):
        models.create("resnet50")


def test_models_command(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cifar10net"]["params"] == 815_018
    # MACs of cifar10net counted by hand: six 3x3 convs at 32/16/8 px, then the two linear layers.
    convs = [(3, 32, 32), (32, 32, 32), (32, 64, 16), (64, 64, 16), (64, 128, 8), (128, 128, 8)]
    by_hand = sum(c_in * c_out * 9 * size * size for c_in, c_out, size in convs) + 2048 * 256 + 256 * 10
    assert rows["cifar10net"]["macs"] == by_hand
    assert main(["models"]) == 0
    assert "815,018" in capsys.readouterr().out
