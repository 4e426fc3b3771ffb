"""Any image -> the normalized 3 x 32 x 32 float32 array a CIFAR-10 model takes. numpy and Pillow only.

This file is standalone on purpose: `cifarkit release` copies it into every release with that release's mean and
std, so the preprocessing ships with the weights and runs without cifarkit or torch:

    from preprocess import preprocess
    x = preprocess("dog.png")          # (3, 32, 32) float32, ready for ONNX Runtime after x[None]

Accepted inputs: a file path, the bytes of an image file, a PIL image, a numpy array (H x W, H x W x 1/3/4; uint8,
uint16 or float in [0, 1]) or a torch tensor (C x H x W or H x W, uint8 or float in [0, 1]), of any size. Grayscale,
palette, RGBA and 16-bit images become RGB; resizing is antialiased. Anything else raises ValueError naming the
problem.

Image files (and bytes): a file of more than MAX_PIXELS pixels (2**26, about 67 million, e.g. 9248 x 6936) is refused
from its header, before any pixel is decoded. The EXIF orientation is applied, so a phone photo is not seen sideways; an
animated GIF, APNG or WebP gives its first frame; a large JPEG is decoded at 1/2, 1/4 or 1/8 scale (DCT scaling)
before the antialiased resize. Every way a file can fail (missing, a folder, empty, not an image, truncated,
corrupt, too large) is one ValueError naming the file. A PIL image is taken as it is: no EXIF, frame or size rule.
"""
from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.247, 0.2435, 0.2616)
SIZE = 32
# 64 Mi pixels: admits every phone photo up to the 64 MP sensors (9248 x 6936), whose RGB decode takes 192 MiB at
# most; and it is below Pillow's own bomb threshold (Image.MAX_IMAGE_PIXELS, 89 MP by default), so Pillow's guard
# only ever speaks about files this limit refuses anyway.
MAX_PIXELS = 2**26
# A JPEG is decoded at the smallest DCT scale that keeps it this many times the output size (or more) on each side,
# so the final resize still averages several source pixels into each output pixel.
DRAFT_FACTOR = 4
# The downscaling filter, chosen by scripts/measure_resize_filters.py (results/resize-filters.json): of box,
# bilinear and bicubic (all antialiased), the one that best recovers the 32 x 32 pixels of upscaled and JPEG-saved
# copies of CIFAR-10 images. A box filter averages each k x k block, so it undoes a k-times upscale exactly.
RESAMPLE = Image.Resampling.BOX


def load_image(image) -> Image.Image:
    """The input as an RGB PIL image of its own size."""
    if isinstance(image, (str, Path)):
        return _open(Path(image))
    if isinstance(image, (bytes, bytearray, memoryview)):
        return from_bytes(image)
    if isinstance(image, Image.Image):
        return _to_rgb(image)
    if hasattr(image, "detach") and hasattr(image, "cpu"):  # a torch tensor, without importing torch
        array = image.detach().cpu().numpy()
        if array.ndim == 3:
            if array.shape[0] not in (1, 3, 4):
                raise ValueError(f"a tensor image must be C x H x W with 1, 3 or 4 channels, got shape {array.shape}")
            array = array.transpose(1, 2, 0)
        return _from_array(array)
    if isinstance(image, np.ndarray):
        return _from_array(image)
    raise ValueError(f"cannot read an image from a {type(image).__name__}; give a file path, the bytes of an image "
                     f"file, a PIL image, a numpy array or a torch tensor")


def to_uint8(image, resample: Image.Resampling = RESAMPLE) -> np.ndarray:
    """The input resized (antialiased, with the filter `resample`) to 32 x 32 x 3 uint8."""
    rgb = load_image(image)
    if rgb.size != (SIZE, SIZE):
        rgb = rgb.resize((SIZE, SIZE), resample, reducing_gap=None)
    return np.asarray(rgb, dtype=np.uint8)


def normalize(pixels: np.ndarray, mean=MEAN, std=STD) -> np.ndarray:
    """N x 32 x 32 x 3 (or 32 x 32 x 3) uint8 -> N x 3 x 32 x 32 (or 3 x 32 x 32) float32, standardized per channel."""
    scaled = (pixels.astype(np.float32) / 255 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(np.moveaxis(scaled, -1, -3))


def preprocess(image, mean=MEAN, std=STD) -> np.ndarray:
    return normalize(to_uint8(image), mean, std)


def _open(path: Path) -> Image.Image:
    if not path.exists():
        raise ValueError(f"no such image file: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file; give an image file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes); give an image file")
    return _decode(path, path)


def from_bytes(data: bytes, name: str = "the image data") -> Image.Image:
    """The image file held in `data` (an upload, say) as an RGB PIL image; errors name it `name`."""
    if len(data) == 0:
        raise ValueError(f"{name} is empty (0 bytes); give an image file")
    return _decode(io.BytesIO(data), name)


def _decode(source, name) -> Image.Image:
    """An image file (a path, or a file object) checked from its header, then decoded as RGB; errors name `name`."""
    with _decoding(name):
        image = Image.open(source)  # reads the header only
    with image:
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise ValueError(f"{name} is {width} x {height} = {width * height:,} pixels, over the limit of "
                             f"{MAX_PIXELS:,}; downscale it (the model sees 32 x 32)")
        with _decoding(name):
            image.seek(0)  # an animated GIF, APNG or WebP: its first frame
            image.draft(None, (DRAFT_FACTOR * SIZE, DRAFT_FACTOR * SIZE))  # a no-op for all but JPEG
            ImageOps.exif_transpose(image, in_place=True)  # in place: a 64 MP picture is not copied once more
            return _to_rgb(image)


@contextmanager
def _decoding(path):
    """Whatever Pillow raises on a bad file (OSError, SyntaxError, EOFError, ValueError, struct.error, MemoryError,
    ... depending on the format's plugin) becomes one ValueError naming the file."""
    try:
        with warnings.catch_warnings():
            # Pillow warns past Image.MAX_IMAGE_PIXELS and raises past twice that. As an error here, its warning stops
            # the file before decoding instead of printing; Image.MAX_IMAGE_PIXELS itself is left alone: it is the
            # user's process-wide setting, and changing it for a moment would drop the guard for other threads.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except UnidentifiedImageError:
        raise ValueError(f"{path} is not an image Pillow can read (PNG, JPEG, BMP, GIF, TIFF, WebP, ...), "
                         f"or its header is damaged") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"{path} is too large to decode safely ({e}); downscale it below {MAX_PIXELS:,} "
                         f"pixels") from None
    except Exception as e:
        raise ValueError(f"{path} is a broken image file ({str(e) or type(e).__name__})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16/32-bit grayscale: rescale before 8-bit RGB
        return _from_array(np.asarray(image))
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Transparent pixels show the colour under them otherwise, which is arbitrary; put them on white.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _from_array(array: np.ndarray) -> Image.Image:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)) or 0 in array.shape:
        raise ValueError(f"an array image must be H x W or H x W x 1/3/4, got shape {array.shape}")
    if array.dtype == np.uint8:
        pixels = array
    elif array.dtype == np.uint16:
        pixels = (array >> 8).astype(np.uint8)
    elif np.issubdtype(array.dtype, np.integer):  # 32-bit integer images (Pillow's "I" mode) hold 16-bit data
        pixels = (np.clip(array, 0, 65535) >> 8).astype(np.uint8)
    elif np.issubdtype(array.dtype, np.floating) or array.dtype == np.bool_:
        if not np.isfinite(array).all():
            raise ValueError("the image array holds NaN or infinite values")
        pixels = (np.clip(array.astype(np.float32), 0, 1) * 255 + 0.5).astype(np.uint8)
    else:
        raise ValueError(f"unsupported image dtype {array.dtype}; use uint8, uint16 or floats in [0, 1]")
    image = Image.fromarray(pixels)
    return _to_rgb(image) if image.mode != "RGB" else image
