import json

import numpy as np
import pytest
import torch
from PIL import Image

from cifarkit import Classifier
from cifarkit.artifacts import preprocess, weights
from cifarkit.artifacts.releases import release_dir
from cifarkit.cli import main
from cifarkit.data import cifar10
from conftest import ROOT


@pytest.fixture(scope="module")
def classifier(released):
    return Classifier.load(released, backend="torch-fp32")


@pytest.fixture
def test_image(cifar_home):
    """(a real 32 x 32 test image as H x W x 3 uint8, its label)"""
    dataset = cifar10.load()
    return dataset.test_x[0].permute(1, 2, 0).numpy(), int(dataset.test_y[0])


def test_every_input_kind_gives_the_same_answer_for_the_same_picture(classifier, test_image, tmp_path):
    pixels, _ = test_image
    path = tmp_path / "img.png"
    Image.fromarray(pixels).save(path)
    expected = classifier.predict_proba(pixels)
    inputs = [str(path), path, Image.open(path), torch.from_numpy(pixels).permute(2, 0, 1),
              torch.from_numpy(pixels).permute(2, 0, 1).float() / 255, pixels.astype(np.float64) / 255]
    for image in inputs:
        np.testing.assert_allclose(classifier.predict_proba(image), expected, atol=1e-5)


def on_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Colour composited over white by its alpha, computed apart from Pillow."""
    opacity = alpha[..., None] / 255
    return np.rint(colour * opacity + 255 * (1 - opacity)).astype(np.uint8)


@pytest.mark.unit
def test_odd_modes_and_sizes_give_the_pixels_of_an_independent_conversion():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    gray, alpha = rgb[:, :, 0], rng.integers(0, 256, (32, 32), dtype=np.uint8)
    deep = rng.integers(0, 65536, (32, 32, 3), dtype=np.uint16)
    big = rng.integers(0, 256, (300, 200, 3), dtype=np.uint8)
    palette = Image.fromarray(big[:32, :32]).convert("P")

    def three(channel):
        return np.repeat(channel[:, :, None], 3, axis=2)

    def resized(pixels):  # Pillow's own antialiased resize of the RGB picture, with the filter preprocess uses
        return np.asarray(Image.fromarray(pixels).resize((32, 32), preprocess.RESAMPLE, reducing_gap=None))

    cases = {  # kind: (input, the 32 x 32 x 3 pixels it must give)
        "grayscale": (Image.fromarray(gray), three(gray)),
        "gray array": (gray, three(gray)),
        "1-bit": (Image.fromarray(gray > 128), three(np.where(gray > 128, 255, 0).astype(np.uint8))),
        "palette": (palette, np.asarray(palette.convert("RGB"))),
        "RGBA": (Image.fromarray(np.dstack([rgb, alpha])), on_white(rgb, alpha)),
        "LA": (Image.fromarray(np.dstack([gray, alpha]), "LA"), on_white(three(gray), alpha)),
        "16-bit": (Image.fromarray(deep[:, :, 0]), three((deep[:, :, 0] >> 8).astype(np.uint8))),
        "uint16 array": (deep, (deep >> 8).astype(np.uint8)),
        "large RGB": (Image.fromarray(big), resized(big)),
        "tiny": (Image.fromarray(big[:5, :7]), resized(big[:5, :7])),
    }
    for kind, (image, expected) in cases.items():
        np.testing.assert_allclose(preprocess.to_uint8(image).astype(int), expected, atol=1, err_msg=kind)
        x = preprocess.preprocess(image)
        assert x.shape == (3, 32, 32) and x.dtype == np.float32 and np.isfinite(x).all(), kind
    # Transparent pixels become white, not whatever colour they hid.
    clear = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    assert (preprocess.to_uint8(clear) == 255).all()


@pytest.mark.unit
def test_downscaling_is_antialiased():
    stripes = np.zeros((256, 256, 3), np.uint8)
    stripes[:, ::2] = 255  # one-pixel stripes: nearest-neighbour sampling would give pure black or white
    small = preprocess.to_uint8(stripes).astype(float)
    assert abs(small.mean() - 127.5) < 5 and small.std() < 10


@pytest.mark.unit
def test_the_filter_is_the_one_the_measurement_chose():
    measured = json.loads((ROOT / "results" / "resize-filters.json").read_text())
    assert preprocess.RESAMPLE == Image.Resampling[measured["choice"].upper()]


@pytest.mark.parametrize("upscale", [Image.Resampling.NEAREST, Image.Resampling.BOX])
def test_a_4x_upscale_of_a_real_image_gives_back_its_pixels_which_bicubic_does_not(test_image, upscale):
    pixels, _ = test_image
    enlarged = Image.fromarray(pixels).resize((128, 128), upscale)
    error = np.abs(preprocess.to_uint8(enlarged).astype(int) - pixels).max()
    bicubic_error = np.abs(preprocess.to_uint8(enlarged, Image.Resampling.BICUBIC).astype(int) - pixels).max()
    assert error <= 1 < bicubic_error


@pytest.mark.parametrize("bad, message", [
    ("missing.png", "no such image file"),
    ("notes.txt", "is not an image Pillow can read"),
    ("broken.png", "broken image file"),
    (np.zeros((10, 10, 5), np.uint8), "must be H x W or H x W x 1/3/4"),
    (np.full((4, 4), np.nan), "NaN or infinite"),
    (torch.zeros(7, 8, 8), "C x H x W with 1, 3 or 4 channels"),
    ({"not": "an image"}, "cannot read an image from a dict"),
])
def test_bad_input_raises_a_value_error_that_names_the_problem(classifier, tmp_path, monkeypatch, bad, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "whole.png")
    (tmp_path / "broken.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
    with pytest.raises(ValueError, match=message):
        classifier.predict(bad)


def test_labels_probabilities_topk_and_batches_agree(classifier, cifar_home):
    dataset = cifar10.load()
    images = [dataset.test_x[i].permute(1, 2, 0).numpy() for i in range(20)]
    batch = classifier.predict_batch(images, batch_size=8)
    assert batch == [classifier.predict(image) for image in images]
    proba = classifier.predict_proba(images[0])
    assert proba.shape == (10,) and proba.sum() == pytest.approx(1.0, abs=1e-5)
    top = classifier.topk(images[0], k=3)
    assert [label for label, _ in top][0] == classifier.predict_label(images[0]) == cifar10.CLASSES[batch[0]]
    assert top[0][1] >= top[1][1] >= top[2][1]
    with pytest.raises(ValueError, match="k must be between 1 and 10"):
        classifier.topk(images[0], k=11)


def test_predict_command_reports_each_image_and_fails_only_the_bad_ones(released, tmp_path, capsys):
    good = tmp_path / "good.png"
    Image.new("RGB", (50, 40), "blue").save(good)
    bad = tmp_path / "bad.png"
    bad.write_text("not a png")
    code = main(["predict", "--model", str(released), "--topk", "3", "--json", str(good), str(bad)])
    captured = capsys.readouterr()
    assert code != 0
    results = json.loads(captured.out)
    assert results[0]["path"] == str(good) and results[0]["label"] in cifar10.CLASSES
    assert 0 < results[0]["confidence"] <= 1 and len(results[0]["topk"]) == 3
    assert cifar10.CLASSES[results[0]["class_index"]] == results[0]["label"]
    assert {k: v for k, v in results[0].items() if k != "path"} == Classifier.load(released).prediction(good, k=3)
    assert "error" in results[1] and "bad.png" in captured.err
    assert main(["predict", "--model", str(released), str(good)]) == 0
    assert capsys.readouterr().out.startswith(f"{good}: ")


@pytest.mark.unit
def test_bf16_backend_gives_autocasts_logits_bit_for_bit():
    """The torch-bf16 backend casts its layers' weights once; autocast over the fp32 weights must agree exactly."""
    classifier = Classifier.load("B", backend="torch-bf16")
    model, _ = weights.load_weights(release_dir("B") / "model.safetensors")
    model = model.eval().to(memory_format=torch.channels_last)
    pixels = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    inputs = torch.from_numpy(preprocess.normalize(pixels, classifier.mean, classifier.std))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(inputs.contiguous(memory_format=torch.channels_last)).float()
    assert next(model.parameters()).dtype == torch.float32
    assert {p.dtype for p in classifier.model.parameters()} == {torch.bfloat16, torch.float32}  # BatchNorm: fp32
    assert torch.equal(classifier.logits(pixels), expected)


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["torch-fp32", "torch-bf16"])
def test_a_traced_classifier_gives_the_eager_logits_bit_for_bit_at_any_batch_size(backend):
    """The server runs traced models (no GIL between layers); it must answer what the release measured."""
    eager = Classifier.load("B", backend=backend)
    traced = Classifier.load("B", backend=backend, traced=True)
    assert isinstance(traced.model, torch.jit.ScriptModule) and not isinstance(eager.model, torch.jit.ScriptModule)
    rng = np.random.default_rng(1)
    for size in (1, 5, 64):  # traced on 2 images: the batch size must not be baked into the graph
        pixels = rng.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8)
        assert torch.equal(traced.logits(pixels), eager.logits(pixels))
