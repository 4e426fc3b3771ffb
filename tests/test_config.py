import re

import pytest

from cifarkit.cli import main
from cifarkit.cli.common import DEFAULT_RECIPE
from cifarkit.core.errors import CifarkitError
from cifarkit.training.config import INHERITED, builtin_recipes, explain, load_recipe, recipe_chain
from conftest import ROOT

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


# A recipe's comments say why in plain words; the evidence lives in docs/recipes-and-speed.md. A number that starts a
# word (a figure, a seed, a date, a share), a percentage, a seed or a results file marks evidence that belongs there.
EVIDENCE = re.compile(r"(?<!\w)\d|%|results/|\.json|\bseeds?\b", re.IGNORECASE)
RECIPES = pytest.mark.parametrize("path", sorted(builtin_recipes().values()), ids=lambda path: path.stem)


@RECIPES
def test_recipes_name_prints_every_value_on_one_line_with_its_reason(path, capsys):
    _, header, rows = explain(str(path))
    assert [key for key, _, reason in rows if reason == ""] == []  # every value the recipe sets has a reason
    assert main(["recipes", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:len(header) + 1] == [f"# {line}" for line in header]
    values = lines[len(header) + 1:]
    assert len(values) == len(rows)
    for line, (key, _, reason) in zip(values, rows):
        assert line.startswith(f"{key} = ") and line.endswith(f"  # {reason or 'default'}")


@RECIPES
def test_recipe_comments_are_a_short_header_and_one_plain_reason_per_value(path):
    _, header, rows = explain(str(path))
    inherited = tuple(f"{INHERITED} {base.stem}: " for base, _ in recipe_chain(str(path))[:-1])
    reasons = [reason for _, _, reason in rows if reason and not reason.startswith(inherited)]
    # Any other comment (evidence above a key, a note on a section) would be one that `cifarkit recipes` never shows.
    assert sum(bool(re.search(r"(^|\s)#", line)) for line in path.read_text().splitlines()) == len(header + reasons)
    assert [comment for comment in header + reasons if EVIDENCE.search(comment)] == []
    assert 1 <= len(header) <= 2
    section = re.search(r'docs/recipes-and-speed\.md, "([^"]+)"', header[-1])
    assert section and f"\n## {section.group(1)}\n" in (ROOT / "docs" / "recipes-and-speed.md").read_text()


def test_the_rule_for_plain_reasons_flags_evidence():
    flagged = ["lost 0.22 points", "on two validation seeds", "94% in minutes", "(results/profile-fast.json)",
               "seed 003", "a 2-pixel shift", "8 epochs", "2025 record"]
    plain = ["the record's: short runs prefer less momentum", "airbench94_muon's value", "in bf16, as fastnet_deep"]
    assert [text for text in flagged if not EVIDENCE.search(text)] == []
    assert [text for text in plain if EVIDENCE.search(text)] == []


def test_reasons_are_read_from_the_line_of_any_recipe_files_value(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text('# My recipe.\n# Its evidence.\ndescription: "mine # not a comment"\nmodel: {name: simplecnn}\n'
                    'train:\n  # not a reason: a reason stands on its value\'s line\n  epochs: 2\n'
                    '  batch_size: 32  # small\n  grad_clip:  # none\n')
    _, header, rows = explain(str(path))
    reasons = {key: reason for key, _, reason in rows}
    assert header == ["My recipe.", "Its evidence."]
    assert [reasons[key] for key in ("model.name", "train.epochs", "train.batch_size", "train.grad_clip")] == \
        ["", "", "small", "none"]
    assert reasons["train.seed"] is None
    assert main(["recipes", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["mine: mine # not a comment", "# My recipe.", "# Its evidence."]
    assert {"train.epochs = 2", "train.batch_size = 32  # small", "train.seed = 0  # default"} <= set(lines)
    assert "data.mean = [0.4914, 0.4822, 0.4465]  # default" in lines


def test_recipes_fast_shows_the_default_recipe_and_its_reasons(capsys):
    assert main(["recipes", "fast"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fast (default): FastNet")
    assert "optim.momentum = 0.825  # the record's: short runs prefer less momentum than the usual" in lines


def test_a_recipe_on_a_base_is_the_base_with_its_own_values_and_reasons_on_top(tmp_path, capsys):
    child = tmp_path / "longer.yaml"
    child.write_text("# Fast, longer.\nbase: fast\ntrain:\n  epochs: 9  # longer\n")
    grandchild = tmp_path / "wider.yaml"
    grandchild.write_text("# Longer, translated further.\nbase: longer.yaml\n"
                          "data:\n  augment:\n    translate: 3  # more\n")
    fast = load_recipe("fast")
    recipe = load_recipe(str(grandchild), ["train.seed=4"])
    assert (recipe.name, recipe.train.epochs, recipe.data.augment.translate, recipe.train.seed) == ("wider", 9, 3, 4)
    assert (recipe.optim, recipe.description) == (fast.optim, fast.description)
    _, header, rows = explain(str(grandchild))
    reasons = {key: reason for key, _, reason in rows}
    assert header == ["Longer, translated further."]
    assert (reasons["data.augment.translate"], reasons["train.epochs"]) == ("more", "from longer: longer")
    assert reasons["optim.momentum"] == "from fast: the record's: short runs prefer less momentum than the usual"
    assert reasons["train.grad_clip"] is None

    child.write_text("base: wider.yaml\n")
    with pytest.raises(CifarkitError, match="names base 'wider.yaml', which leads back to itself; break the loop"):
        load_recipe(str(grandchild))
    child.write_text("base: fastest\n")
    with pytest.raises(CifarkitError, match="names base 'fastest', which is neither a built-in recipe .* nor a file"):
        load_recipe(str(grandchild))
