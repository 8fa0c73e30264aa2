"""Finding and reading the images to predict: files as given, folders walked for image files.

An image file is one with an extension of torchvision's ``ImageFolder`` (``IMG_EXTENSIONS``, any case);
it is read as ``ImageFolder`` reads it (``pil_loader``: Pillow, converted to RGB).
"""
from __future__ import annotations

import os
from pathlib import Path

from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, is_image_file, pil_loader


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


def read_image(path: str | Path) -> Image.Image:
    """The image at ``path`` in RGB; UnreadableImageError saying why it cannot be read."""
    try:
        return pil_loader(path)
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
    except OSError as error:  # e.g. a truncated file
        reason = f"cannot decode: {error}"
    raise UnreadableImageError(reason)
