import pytest

from cifarkit.cli import main
from cifarkit.cli.common import DEFAULT_RECIPE
from cifarkit.core.errors import CifarkitError
from cifarkit.training.config import builtin_recipes, load_recipe

pytestmark = pytest.mark.unit


def test_builtin_recipes_load_and_match_the_write_ups():
    assert set(builtin_recipes()) >= {"resnet18-sgd", "resnet18-adamw", "cifar10net", "simplecnn"}
    a = load_recipe("resnet18-sgd")
    assert (a.optim.name, a.optim.lr, a.optim.momentum, a.optim.nesterov, a.optim.weight_decay) == \
        ("sgd", 0.1, 0.9, True, 5e-4)
    assert (a.schedule.name, a.train.epochs, a.train.batch_size, a.data.augment.cutout) == ("cosine", 200, 256, 16)
    b = load_recipe("resnet18-adamw")
    assert (b.optim.name, b.optim.lr, b.optim.weight_decay, b.schedule.name, b.train.epochs) == \
        ("adamw", 3e-4, 0.05, "onecycle", 100)
    assert b.data.augment.autoaugment == "cifar10"
    c = load_recipe("cifar10net")
    assert (c.optim.name, c.optim.lr, c.schedule.step_epochs, c.schedule.gamma, c.train.epochs,
            c.train.batch_size) == ("adam", 1e-3, 10, 0.5, 15, 128)
    assert load_recipe("simplecnn").train.batch_size == 64
    assert DEFAULT_RECIPE == "fast"


def test_overrides_are_typed_and_dotted():
    r = load_recipe("cifar10net", ["train.epochs=3", "optim.lr=0.01", "data.augment.cutout=8",
                                   "data.mean=[0.5, 0.5, 0.5]", "train.grad_clip=null", "train.ema_decay=0.99"])
    assert r.train.epochs == 3 and r.optim.lr == 0.01 and r.data.augment.cutout == 8
    assert r.data.mean == (0.5, 0.5, 0.5) and r.train.grad_clip is None and r.train.ema_decay == 0.99
    assert isinstance(load_recipe("cifar10net", ["optim.lr=1"]).optim.lr, float)
    assert load_recipe("cifar10net", ["optim.weight_decay=5e-4"]).optim.weight_decay == 5e-4  # YAML reads a str


@pytest.mark.parametrize("epochs, by_epoch", [(2, [25, 25]), (7.59, [25] * 7 + [15]), (0.01, [1])])
def test_a_fraction_of_an_epoch_trains_its_steps_rounded_up(epochs, by_epoch):
    train = load_recipe("fast", [f"train.epochs={epochs}"]).train
    assert train.steps_by_epoch(25) == by_epoch
    assert train.total_steps(25) == sum(by_epoch)  # what the lr schedule and Lookahead are built for


@pytest.mark.parametrize("override, message", [
    ("train.epoch=3", r"unknown key 'train.epoch'; valid keys here: train.epochs"),
    ("optimizer.lr=3", r"unknown key 'optimizer'"),
    ("train.epochs=three", r"bad value for train.epochs: 'three' \(expected int \| float\)"),
    ("train.epochs=0", r"bad value for train.epochs: 0 \(must be > 0 and finite\)"),
    ("train.epochs=.inf", r"bad value for train.epochs: inf \(must be > 0 and finite\)"),
    ("train.epochs=.nan", r"bad value for train.epochs: nan \(must be > 0 and finite\)"),
    ("train.batch_size=2.5", r"bad value for train.batch_size: 2.5 \(expected int\)"),
    ("train.whiten_bias_epochs=-1", r"bad value for train.whiten_bias_epochs: -1 \(must be >= 0\)"),
    ("train.group_train_epochs=[6, -1]", r"bad value for train.group_train_epochs: \[6, -1\] \(epochs per conv "
                                         r"group, each >= 0\)"),
    ("train.group_train_epochs=6", r"bad value for train.group_train_epochs: 6 \(expected tuple\[int, \.\.\.\] "
                                   r"\| None\)"),
    ("train.tta_share=1.5", r"bad value for train.tta_share: 1.5 \(a share of the test images, from 0 to 1\)"),
    ("optim.name=lion", r"bad value for optim.name: 'lion' \(choose from sgd, adam, adamw, muon\)"),
    ("optim.newton_schulz=[3.4, -4.7]", r"bad value for optim.newton_schulz: \[3.4, -4.7\] \(expected a list of 3 "
                                        r"numbers\)"),
    ("model.norm_momentum=0", r"bad value for model.norm_momentum: 0.0 \(in \(0, 1\], or null for the model's "
                              r"own\)"),
    ("data.mean=[0.5]", r"bad value for data.mean"),
    ("train.flip=true", r"unknown key 'train.flip'"),
    ("data.augment=3", r"bad value for data.augment: expected a mapping"),
    ("epochs", r"bad override 'epochs'; write it as key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(CifarkitError, match=message):
        load_recipe("cifar10net", [override])


def test_unknown_recipe_lists_the_choices():
    with pytest.raises(CifarkitError, match="unknown recipe 'nope'; choose from .*cifar10net"):
        load_recipe("nope")


def test_recipe_from_a_yaml_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: {name: simplecnn}\ntrain: {epochs: 2}\n")
    r = load_recipe(str(path))
    assert (r.name, r.model.name, r.train.epochs) == ("mine", "simplecnn", 2)
    path.write_text("model: {name: simplecnn}\ntrain: {epocs: 2}\n")
    with pytest.raises(CifarkitError, match="unknown key 'train.epocs'"):
        load_recipe(str(path))


def test_cli_reports_bad_keys_on_one_line(capsys, cifar_home, tmp_path):
    assert main(["train", "--set", "optim.lrr=1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "cifarkit: error: unknown key 'optim.lrr'; valid keys here: optim.name, optim.lr, " \
                  "optim.momentum, optim.nesterov, optim.weight_decay, optim.betas, optim.vector_lr_scale, " \
                  "optim.vector_weight_decay, optim.filter_lr, optim.filter_momentum, optim.newton_schulz"
    assert not (tmp_path / "r").exists()


def test_recipes_command(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "cifar10net" in out and "(default)" in out and "resnet18-adamw" in out
