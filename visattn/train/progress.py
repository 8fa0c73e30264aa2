"""The progress bar of a preparation before training (drawing statistics, checking image files, timing the loader):
shown on the run's main process only, and only once the preparation has run for ``DELAY_S``, so that a short one
prints nothing and a long one shows its count, rate and an estimate of the time left."""
from __future__ import annotations

from tqdm import tqdm

DELAY_S = 2.0


def preparation_bar(total: int, desc: str, unit: str, shown: bool) -> tqdm:
    """A bar over ``total`` items of ``unit``; silent unless ``shown`` and until ``DELAY_S`` have passed."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not shown, delay=DELAY_S)
