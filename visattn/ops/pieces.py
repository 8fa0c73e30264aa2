"""Walking a long axis (tokens, or short attention sequences) in pieces small enough to stay in cache.

Each piece is read from memory once and its work buffers are reused from piece to piece; the result
does not depend on the piece length.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


def items_per_piece(budget: int, values_per_item: int, minimum: int = 1) -> int:
    """How many items of ``values_per_item`` values fit in ``budget`` values, at least ``minimum``."""
    return max(minimum, budget // values_per_item)


def pieces(total: int, step: int) -> Iterator[slice]:
    """Consecutive slices of ``step`` items covering ``range(total)``; the last one may be shorter."""
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


def even_pieces(total: int, most: int) -> Iterator[slice]:
    """As few consecutive slices covering ``range(total)`` as hold at most ``most`` items each, of equal
    length but for the last (``total = 1,025, most = 672`` gives 513 and 512, not 672 and 353)."""
    count = -(-total // most)
    yield from pieces(total, -(-total // count))


class ImageRun(NamedTuple):
    """Images ``images`` of a batch and, of each, items ``items``."""

    images: slice
    items: slice


def image_runs(batch: int, items: int, values_per_item: int, budget: int, minimum: int = 1) -> list[ImageRun]:
    """Pieces of ``batch`` images of ``items`` items each, of about ``budget`` values at most: as many whole
    images as fit, else even runs of one image's items (at least ``minimum`` of them), so that a piece
    stays cache-sized at any batch size."""
    per_image = items * values_per_item
    if per_image <= budget:
        return [ImageRun(images, slice(0, items)) for images in even_pieces(batch, budget // per_image)]
    step = items_per_piece(budget, values_per_item, minimum)
    return [ImageRun(slice(i, i + 1), part) for i in range(batch) for part in even_pieces(items, step)]
