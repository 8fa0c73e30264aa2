"""Finding and reading the images to predict: files as given, folders walked for image files.

An image file is one with an extension of torchvision's ``ImageFolder`` (``IMG_EXTENSIONS``, any case).
Training reads its ImageFolder with :func:`read_image` too, so that prediction sees every file as training did:
Pillow, converted to 8-bit RGB (:func:`to_rgb`: 16-bit grey levels scaled, not clipped).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, is_image_file

# Pillow modes of 16-bit grey levels: I;16* from 16-bit PNG and TIFF, I (32-bit) where a format widens them.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class UnreadableImageError(OSError):
    """A file that cannot be read as an image; the message is the reason, without the path."""


def find_images(paths: list[str | Path]) -> tuple[list[str], list[tuple[str, str]]]:
    """(image files, problems): each path that is not a folder as given (reading it tells whether it is an
    image), and the image files under each folder, walked in sorted order; a folder without any is a
    problem (path, reason)."""
    files: list[str] = []
    problems: list[tuple[str, str]] = []
    for path in map(str, paths):
        if not os.path.isdir(path):
            files.append(path)
            continue
        found = [
            os.path.join(folder, name)
            for folder, _, names in sorted(os.walk(path, followlinks=True))
            for name in sorted(names)
            if is_image_file(name)
        ]
        if not found:
            problems.append((path, f"folder without image files ({', '.join(IMG_EXTENSIONS)})"))
        files.extend(found)
    return files, problems


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB. Pillow converts every mode (grey, palette, CMYK, alpha, ...) but clips 16-bit grey
    levels to 255, so that all but the darkest pixels turn white; those are scaled instead (0-65535 to 0-255).
    Mode ``I`` (32-bit integers) is read as 16-bit levels too, as the formats that widen 16-bit grey store
    it; values outside 0-65535 saturate."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image.convert("RGB")
    levels = np.asarray(image, dtype=np.float64)  # (H, W)
    grey = np.clip(np.rint(levels * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def read_image(path: str | Path, draft: bool = False) -> Image.Image:
    """The image at ``path`` as 8-bit RGB (:func:`to_rgb`); UnreadableImageError saying why it cannot be read.

    ``draft``: a JPEG is decoded at an eighth of its size (Pillow's ``draft``), which still reads and decodes
    all of its data, so a damaged file fails as it would at full size, with less pixel work: for a check that
    does not keep the pixels.
    """
    try:
        with open(path, "rb") as handle:
            image = Image.open(handle)
            if draft:
                image.draft(None, (1, 1))
            image.load()
            return to_rgb(image)
    except FileNotFoundError:
        reason = "no such file"
    except IsADirectoryError:
        reason = "is a directory"
    except PermissionError:
        reason = "permission denied"
    except Image.UnidentifiedImageError:
        reason = "not an image file Pillow can read" + (" (empty file)" if os.path.getsize(path) == 0 else "")
    except Image.DecompressionBombError as error:
        reason = str(error)
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
        # what Pillow's decoders raise for damaged data: OSError for a truncated file or a broken stream,
        # SyntaxError for a broken PNG chunk, the others for malformed headers and tiles
        reason = f"cannot decode: {' '.join(str(error).split()) or type(error).__name__}"
    raise UnreadableImageError(reason)
