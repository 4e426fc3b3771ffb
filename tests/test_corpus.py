"""Every kind of image file a user may hand over, through Classifier.predict and through `cifarkit predict`.

The corpus is written once per module by the tests themselves (Pillow, numpy, zlib): each kind is marked good (it
must be classified) or bad (it must be refused with one line naming the file). `pytest -s` prints the table.
"""
import io
import os
import struct
import subprocess
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from cifarkit import Classifier
from cifarkit.artifacts import preprocess
from cifarkit.cli import main

ORIENTATION = 0x0112  # the EXIF tag
ROTATE_90_CW_TO_DISPLAY = 6  # its value when the stored pixels must turn 90 degrees clockwise to stand upright
FRAME_COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255))


@dataclass
class Sample:
    kind: str
    path: Path
    good: bool


def picture(width: int, height: int) -> Image.Image:
    """A smooth, asymmetric RGB picture (random colours bilinearly enlarged): compresses well, survives JPEG."""
    coarse = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def zero_png(width: int, height: int, bit_depth: int = 8) -> bytes:
    """A black grayscale PNG written by hand, its pixel rows streamed through zlib: a 200 MP picture is ~200 KB on
    disk and never held in memory here."""
    row = bytes(1 + (width * bit_depth + 7) // 8)  # a filter-type byte, then the row's zeros
    deflate = zlib.compressobj(9)
    idat = b"".join(deflate.compress(row * 1000) for _ in range(height // 1000))
    idat += deflate.compress(row * (height % 1000)) + deflate.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)  # grayscale, no interlace
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def animated(fmt: str, **options) -> bytes:
    frames = [Image.new("RGB", (16, 16), colour) for colour in FRAME_COLOURS]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)


def exif_rotated_jpeg() -> bytes:
    image = picture(60, 40)
    exif = image.getexif()
    exif[ORIENTATION] = ROTATE_90_CW_TO_DISPLAY
    return encode(image, "JPEG", quality=95, exif=exif)


def bad_crc_png() -> bytes:
    data = bytearray(encode(picture(20, 20), "PNG"))
    data[29] ^= 0xFF  # the first byte of IHDR's CRC (8 signature + 4 length + 4 type + 13 data bytes before it)
    return bytes(data)


def transparent_gif() -> bytes:
    image = picture(40, 30).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return encode(image, "GIF", transparency=0)


def float_tiff() -> bytes:
    values = np.random.default_rng(1).random((30, 40), dtype=np.float32)  # mode F: floats in [0, 1]
    return encode(Image.fromarray(values), "TIFF")


def corpus_files():
    """(kind, file name, good, content): content is the file's bytes, "directory", or None for a path left
    missing."""
    rgb = picture(64, 48)
    png = encode(rgb, "PNG")
    jpeg = encode(picture(256, 256), "JPEG")
    webp = encode(rgb, "WEBP")
    return [
        ("1 x 1 PNG", "one-pixel.png", True, encode(picture(1, 1), "PNG")),
        ("1 x 5000 PNG", "sliver.png", True, encode(picture(1, 5000), "PNG")),
        ("16-bit grayscale PNG", "sixteen-bit.png",
         True, encode(Image.fromarray(np.arange(48 * 64, dtype=np.uint16).reshape(48, 64) * 21), "PNG")),
        ("1-bit PNG", "one-bit.png", True, encode(rgb.convert("1"), "PNG")),
        ("grayscale JPEG", "gray.jpg", True, encode(rgb.convert("L"), "JPEG")),
        ("palette PNG", "palette.png", True, encode(rgb.convert("P"), "PNG")),
        ("transparent GIF", "transparent.gif", True, transparent_gif()),
        ("RGBA PNG", "rgba.png", True, encode(rgb.convert("RGBA"), "PNG")),
        ("LA PNG", "gray-alpha.png", True, encode(rgb.convert("LA"), "PNG")),
        ("CMYK JPEG", "cmyk.jpg", True, encode(rgb.convert("CMYK"), "JPEG")),
        ("BMP", "picture.bmp", True, encode(rgb, "BMP")),
        ("TIFF", "picture.tif", True, encode(rgb, "TIFF", compression="tiff_lzw")),
        ("32-bit float TIFF", "float.tif", True, float_tiff()),
        ("WebP", "picture.webp", True, webp),
        ("animated GIF", "animated.gif", True, animated("GIF")),
        ("APNG", "animated.png", True, animated("PNG")),
        ("animated WebP", "animated.webp", True, animated("WEBP", lossless=True)),
        ("EXIF-rotated JPEG", "rotated.jpg", True, exif_rotated_jpeg()),
        ("PNG named .jpg", "really-a-png.jpg", True, png),
        ("8000 x 6000 JPEG (48 MP)", "phone-photo.jpg", True, encode(picture(8000, 6000), "JPEG")),
        ("missing path", "missing.png", False, None),
        ("directory", "folder.png", False, "directory"),
        ("empty file", "empty.png", False, b""),
        ("text named .jpg", "notes.jpg", False, b"these are notes, not a picture\n"),
        ("SVG", "drawing.svg", False, b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9">'
                                      b'<rect width="9" height="9" fill="red"/></svg>\n'),
        ("truncated PNG", "truncated.png", False, png[:len(png) // 2]),
        ("PNG with a bad CRC", "bad-crc.png", False, bad_crc_png()),
        ("PNG with corrupt pixel data", "corrupt-idat.png", False,
         png[:33] + png_chunk(b"IDAT", b"not a zlib stream" * 8) + png_chunk(b"IEND", b"")),  # 33: up to IHDR's end
        ("PNG signature, then junk", "junk.png", False, png[:8] + b"junk" * 16),
        ("truncated JPEG", "truncated.jpg", False, jpeg[:len(jpeg) // 2]),
        ("truncated GIF", "truncated.gif", False, encode(rgb, "GIF")[:20]),
        ("truncated WebP", "truncated.webp", False, webp[:len(webp) // 2]),
        ("decompression bomb PNG (20000 x 10000, ~200 KB)", "bomb.png", False, zero_png(20000, 10000)),
        ("PNG past Pillow's bomb warning (10000 x 9500)", "warned.png", False, zero_png(10000, 9500, bit_depth=1)),
        ("JPEG over the pixel limit (9000 x 8000)", "too-large.jpg", False,
         encode(Image.new("L", (9000, 8000), 128), "JPEG")),
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Sample]:
    folder = tmp_path_factory.mktemp("corpus")
    samples = {}
    for number, (kind, name, good, content) in enumerate(corpus_files()):
        path = folder / f"{number:02d}-{name}"  # the number keeps every path from being a part of another
        if content == "directory":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        samples[kind] = Sample(kind, path, good)
    return samples


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory):
    """One CIFARKIT_HOME for every `cifarkit predict` here: the ONNX model the release's default backend needs is
    exported into its cache once, not once per run."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def classifier(released):
    return Classifier.load(released, backend="torch-fp32")


def print_table(rows) -> None:
    """(kind, line printed, exit code) rows as a markdown table, for the report (`pytest -s`)."""
    print("\n| kind | line printed | exit code |\n|---|---|---:|")
    for kind, line, code in rows:
        print(f"| {kind} | `{line}` | {code} |")


def test_classifier_classifies_good_files_and_refuses_bad_ones_with_one_line(classifier, corpus):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a DecompressionBombWarning (or any other) must not reach the user
        for sample in corpus.values():
            if sample.good:
                assert classifier.predict(sample.path) in range(10), sample.kind
                continue
            with pytest.raises(ValueError) as refused:
                classifier.predict(sample.path)
            message = str(refused.value)
            assert str(sample.path) in message and "\n" not in message, sample.kind
    assert [str(w.message) for w in caught] == []


def test_predict_command_reports_each_bad_file_once_and_still_classifies_the_good_ones(released, corpus,
                                                                                        cli_home):
    env = {**os.environ, "CIFARKIT_HOME": str(cli_home)}
    paths = [str(s.path) for s in corpus.values()]
    run = subprocess.run([sys.executable, "-m", "cifarkit", "predict", "--model", str(released), *paths],
                         env=env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in run.stderr and "DecompressionBomb" not in run.stderr, run.stderr
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("cifarkit: error: ")]
    for sample in corpus.values():
        naming = [line for line in errors if str(sample.path) in line]
        classified = [line for line in run.stdout.splitlines() if line.startswith(f"{sample.path}: ")]
        assert (len(naming), len(classified)) == ((0, 1) if sample.good else (1, 0)), (sample.kind, run.stderr)
    bad = sum(not s.good for s in corpus.values())
    assert f"cifarkit: error: {bad} of {len(paths)} images could not be classified" in errors


def test_each_file_alone_prints_one_line_and_exits_0_or_2(released, corpus, cli_home, capsys, monkeypatch, request):
    monkeypatch.setenv("CIFARKIT_HOME", str(cli_home))
    monkeypatch.delenv("CIFARKIT_DATA", raising=False)  # this home's cache, not the real archive
    rows = []
    for sample in corpus.values():
        code = main(["predict", "--model", str(released), str(sample.path)])
        out, err = capsys.readouterr()
        printed = out.splitlines() + [line for line in err.splitlines() if str(sample.path) in line]
        assert len(printed) == 1 and code == (0 if sample.good else 2), (sample.kind, out, err)
        rows.append((sample.kind, printed[0].replace(f"{sample.path.parent}{os.sep}", ""), code))  # short names
    if request.config.getoption("capture") == "no":  # `pytest -s`: the table is for a person reading the run
        with capsys.disabled():
            print_table(rows)


@pytest.mark.unit
def test_exif_orientation_is_applied(corpus):
    path = corpus["EXIF-rotated JPEG"].path
    stored = np.asarray(Image.open(path).convert("RGB"))  # the pixels as stored, before any EXIF rule
    upright = np.rot90(stored, k=-1)  # orientation 6: turn 90 degrees clockwise to display
    assert np.array_equal(preprocess.to_uint8(path), preprocess.to_uint8(upright))
    assert not np.array_equal(preprocess.to_uint8(path), preprocess.to_uint8(stored))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["animated GIF", "APNG", "animated WebP"])
def test_animated_images_give_their_first_frame(corpus, kind):
    with Image.open(corpus[kind].path) as image:
        assert image.n_frames == len(FRAME_COLOURS)  # the file really is animated
    pixels = preprocess.to_uint8(corpus[kind].path)
    assert (pixels == FRAME_COLOURS[0]).all()


@pytest.mark.parametrize("kind, size", [
    ("decompression bomb PNG (20000 x 10000, ~200 KB)", "200000000 pixels"),
    ("PNG past Pillow's bomb warning (10000 x 9500)", "95000000 pixels"),
    ("JPEG over the pixel limit (9000 x 8000)", "9000 x 8000"),
])
@pytest.mark.unit
def test_files_over_the_limit_are_refused_before_decoding(corpus, monkeypatch, kind, size):
    decoded = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image.size) or load(image))
    with pytest.raises(ValueError) as refused:
        preprocess.to_uint8(corpus[kind].path)
    message = str(refused.value)
    assert size in message and f"{preprocess.MAX_PIXELS:,}" in message and "downscale it" in message
    assert decoded == []


@pytest.mark.unit
def test_the_pixel_limit_admits_phone_photos_and_sits_below_pillows_own():
    # A 64 MP phone sensor's photo (9248 x 6936) is classified; Pillow's default guard never speaks below the limit.
    assert 9248 * 6936 <= preprocess.MAX_PIXELS < Image.MAX_IMAGE_PIXELS


@pytest.mark.unit
def test_a_large_jpeg_is_decoded_at_reduced_scale_then_resized_with_antialiasing(tmp_path, monkeypatch):
    stripes = np.zeros((2048, 2048), np.uint8)
    stripes[:, ::2] = 255  # one-pixel stripes: sampling without averaging gives pure black or white
    path = tmp_path / "stripes.jpg"
    Image.fromarray(stripes).save(path, quality=95)
    resized_from = []
    resize = Image.Image.resize
    monkeypatch.setattr(Image.Image, "resize", lambda image, *a, **k: resized_from.append(image.size) or
                        resize(image, *a, **k))
    small = preprocess.to_uint8(path).astype(float)
    assert resized_from == [(256, 256)]  # decoded at 1/8 scale by the JPEG decoder, not at 2048 x 2048
    assert abs(small.mean() - 127.5) < 5 and small.std() < 10
