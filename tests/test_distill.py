import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from cifarkit import models
from cifarkit.artifacts.releases import SHIPPED
from cifarkit.core.errors import CifarkitError
from cifarkit.data.config import AugmentConfig, DataConfig
from cifarkit.data.loader import TrainLoader
from cifarkit.release import build
from cifarkit.training import train
from cifarkit.training.config import load_recipe
from cifarkit.training.engine import ClassificationLoss, DistillationLoss


class FixedLogits(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, inputs):
        return self.logits


@pytest.mark.unit
def test_distillation_loss_is_0_7_ce_plus_0_3_t2_kl():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(6, 10), torch.randn(6, 10), torch.randint(0, 10, (6,))
    t = 4.0
    loss = DistillationLoss(FixedLogits(teacher), temperature=t, weight=0.3)(student, labels, None)
    p_teacher = (teacher / t).softmax(1)
    kl = (p_teacher * (p_teacher.log() - (student / t).log_softmax(1))).sum(1).mean()
    expected = 0.7 * nn.functional.cross_entropy(student, labels) + 0.3 * t * t * kl
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # A student that already matches its teacher only learns from the labels.
    matched = DistillationLoss(FixedLogits(student), temperature=t, weight=0.3)(student, labels, None)
    assert matched.item() == pytest.approx(0.7 * ClassificationLoss()(student, labels, None).item(), rel=1e-5)


@pytest.mark.unit
def test_targets_computed_before_training_give_the_live_teachers_loss():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(6, 10), torch.randn(6, 10), torch.randint(0, 10, (6,))
    live = DistillationLoss(FixedLogits(teacher), temperature=4.0, weight=0.3)(student, labels, None)
    cached = DistillationLoss(None, temperature=4.0, weight=0.3)
    assert torch.equal(cached(student, labels, None, teacher), live)
    with pytest.raises(ValueError, match="needs the batch's targets"):
        cached(student, labels, None)


@pytest.mark.unit
def test_the_loader_hands_each_image_its_own_target():
    images = torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 3, 4, 4).contiguous()
    loader = TrainLoader(images, torch.arange(40) % 10, 8, DataConfig(augment=AugmentConfig(flip=True)), seed=0,
                         shards=2, own=range(2))
    assert all(len(batch) == 2 for batch in next(loader.epoch(1)))
    loader.targets = torch.arange(40, dtype=torch.float32)[:, None] * torch.ones(10)
    for micro_batches in loader.epoch(1):
        for inputs, labels, targets in micro_batches:
            # The image's index is in its pixels (before normalization), and its target says the same index.
            index = torch.round(inputs[:, 0, 0, 0] * loader.cfg.std[0] * 255 + loader.cfg.mean[0] * 255)
            assert torch.equal(targets[:, 0], index) and torch.equal(labels, index.long() % 10)


@pytest.mark.unit
def test_the_teacher_changes_the_students_gradients():
    torch.manual_seed(0)
    student, teacher = models.create("simplecnn"), models.create("simplecnn").eval()
    inputs, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def gradients(loss_fn):
        student.zero_grad()
        loss_fn(student(inputs), labels, inputs).backward()
        return torch.cat([p.grad.flatten() for p in student.parameters()])
    plain = gradients(ClassificationLoss())
    assert not torch.allclose(gradients(DistillationLoss(teacher, temperature=4.0, weight=0.3)), plain)
    # With no weight on the teacher, distillation is exactly the plain loss: the difference above is the teacher's.
    assert torch.allclose(gradients(DistillationLoss(teacher, temperature=4.0, weight=0.0)), plain)


def test_a_recipe_with_a_teacher_trains_and_records_it(released, cifar_home, tmp_path, monkeypatch):
    settings = ["train.epochs=1", "data.subset=500"]
    train.run(load_recipe("distill", [f"distill.teacher={released}"] + settings), out=tmp_path / "student")
    train.run(load_recipe("distill", ["distill.teacher=null"] + settings), out=tmp_path / "plain")
    # Same seed, same batches: only the teacher's soft targets can make the two students differ.
    taught, plain = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("student", "plain"))
    assert any(not torch.equal(taught[k], plain[k]) for k in taught)
    config = yaml.safe_load((tmp_path / "student" / "config.yaml").read_text())
    assert config["distill"]["teacher"] == str(released)
    assert config["run"]["teacher"]["model"] == "simplecnn"
    assert "distilling from" in (tmp_path / "student" / "train.log").read_text()
    # Its release says how it was taught: the teacher, and the loss's split and temperature.
    monkeypatch.setattr(build, "INFERENCE_ROUNDS", 1)
    monkeypatch.setattr(build, "SECONDS_PER_SAMPLE", 0.05)
    folder = build.make_release(tmp_path / "student", "S", tmp_path / "models")
    assert yaml.safe_load((folder / "config.yaml").read_text())["training"]["distill"]["weight"] == 0.3
    card = (folder / "MODEL_CARD.md").read_text()
    assert (f"Distilled from the release at `{released.name}` (`simplecnn`): loss 0.7 x cross-entropy + 0.3 x the KL "
            f"divergence from the teacher's soft targets (its logits on each augmented batch) at temperature 4."
            ) in card


def test_tta_targets_are_the_teachers_tta_logits_computed_once(released, cifar_home, tmp_path, monkeypatch):
    calls = []
    real = train.tta_logits

    def counted(teacher, images, *args, **kwargs):
        calls.append(len(images))
        return real(teacher, images, *args, **kwargs)
    monkeypatch.setattr(train, "tta_logits", counted)
    settings = ["train.epochs=2", "data.subset=500", f"distill.teacher={released}"]
    train.run(load_recipe("distill", settings + ["distill.targets=tta"]), out=tmp_path / "tta")
    assert calls == [500], "once, for every training image, before the first epoch"
    train.run(load_recipe("distill", settings), out=tmp_path / "live")
    assert calls == [500], "a live teacher computes nothing in advance"
    # Same seed and batches; only the targets differ (the teacher's TTA prediction of the image, not its logits on
    # the augmented copy), so the students do too.
    tta, live = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("tta", "live"))
    assert any(not torch.equal(tta[k], live[k]) for k in tta)
    assert "targets the teacher's TTA logits of each image" in (tmp_path / "tta" / "train.log").read_text()
    with pytest.raises(CifarkitError, match=r"bad value for distill.targets: 'views' \(choose from live, tta\)"):
        load_recipe("distill", ["distill.targets=views"])


def test_a_teacher_with_other_normalization_is_refused(released, cifar_home, tmp_path):
    recipe = load_recipe("distill", [f"distill.teacher={released}", "train.epochs=1", "data.subset=500",
                                     "data.mean=[0.5, 0.5, 0.5]"])
    with pytest.raises(CifarkitError, match="set data.mean and data.std to the teacher's"):
        train.run(recipe, out=tmp_path / "student")


@pytest.mark.unit
def test_the_distill_recipe_without_a_teacher_is_the_plain_student():
    recipe = load_recipe("distill", ["distill.teacher=null"])
    assert recipe.distill.teacher is None and recipe.model.name == "simplecnn"


@pytest.mark.unit
def test_release_b_recipe_is_a_single_view_student_of_a_with_at_most_a_third_of_its_macs():
    """Issue 66's bounds on release B's recipe, read from the shipped A rather than typed: its student costs at most a
    third of A's MACs per image, and its run reports the single view that `Classifier.predict` computes."""
    recipe = load_recipe("distill-b")
    teacher = yaml.safe_load((SHIPPED / "version_A" / "config.yaml").read_text())["model"]
    assert recipe.distill.teacher == "A" and recipe.distill.targets == "tta" and not recipe.train.tta
    assert 3 * models.count_macs(models.create(recipe.model.name)) <= teacher["macs"]
