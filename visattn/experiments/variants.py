"""Named variants of the cluttered-digits task, for judging a high-resolution recipe on data it was not tuned on.

The rule: every recipe decision (stages, epochs, widths, attention options, learning rates) is made on the
``TUNING`` variants and reported on the ``HELD_OUT`` ones; a recipe that holds only on the data it was tuned
on is reported as such, and a held-out variant is never changed after a result on it has been seen.

Each variant is a set of ``dataset_kwargs`` of ``cluttered-digits`` (see
:class:`visattn.train.generated_tasks.cluttered_digits.ClutteredDigitsOptions`), made for 128 px canvases (the
recipe ``configs/cluttered-digits-curriculum.yaml``; every one also fits the 64 px canvases of its first
stage), with 1,000 validation and 1,000 test canvases. ``tune-base`` is that recipe's own data; the others
change the digits' size and its spread, the clutter's size and density, and how many distinct digits the
training set shows. ``python -m visattn.experiments.accuracy --variants tuning`` (or ``held-out``, or names)
trains a table on each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASET = "cluttered-digits"


@dataclass(frozen=True)
class Variant:
    """A named set of a generated dataset's options, laid over a recipe's ``dataset_kwargs``."""

    name: str
    dataset_kwargs: dict[str, Any] = field(hash=False)
    dataset: str = DATASET


def cluttered_digits(name: str, *, train_size: int, digit_size: int, digit_size_max: int, clutter_size: int,
                     clutter_count: int, placements: int, seed: int) -> Variant:
    """A cluttered-digits variant with 1,000 validation and 1,000 test canvases."""
    return Variant(name, dict(
        seed=seed, train_size=train_size, val_size=1000, test_size=1000, digit_size=digit_size,
        digit_size_max=digit_size_max, clutter_size=clutter_size, clutter_count=clutter_count, placements=placements,
    ))


TUNING = (
    cluttered_digits("tune-base", train_size=4000, digit_size=32, digit_size_max=0, clutter_size=8, clutter_count=0,
                     placements=0, seed=0),
    cluttered_digits("tune-scaled", train_size=4000, digit_size=24, digit_size_max=40, clutter_size=12,
                     clutter_count=24, placements=0, seed=1),
    cluttered_digits("tune-few", train_size=2000, digit_size=32, digit_size_max=0, clutter_size=16, clutter_count=16,
                     placements=10, seed=2),
)
HELD_OUT = (
    cluttered_digits("held-dense", train_size=4000, digit_size=20, digit_size_max=36, clutter_size=10,
                     clutter_count=32, placements=0, seed=11),
    cluttered_digits("held-big", train_size=3000, digit_size=28, digit_size_max=44, clutter_size=14, clutter_count=16,
                     placements=3, seed=12),
    cluttered_digits("held-coarse", train_size=6000, digit_size=32, digit_size_max=0, clutter_size=20,
                     clutter_count=12, placements=0, seed=13),
)
GROUPS = {"tuning": TUNING, "held-out": HELD_OUT}
VARIANTS = {variant.name: variant for variant in (*TUNING, *HELD_OUT)}


def group_of(variant: Variant) -> str:
    """"tuning" or "held-out"."""
    return next(group for group, members in GROUPS.items() if variant in members)


def parse_variants(words: list[str]) -> list[Variant]:
    """The variants that ``words`` name, each a variant's name or a group's ("tuning", "held-out"), in order and
    each once; ValueError naming an unknown word and the accepted ones."""
    chosen: list[Variant] = []
    for word in words:
        if word in GROUPS:
            named = GROUPS[word]
        elif word in VARIANTS:
            named = (VARIANTS[word],)
        else:
            raise ValueError(f"unknown variant {word!r}; valid: {', '.join(VARIANTS)}, or a group: {', '.join(GROUPS)}")
        chosen += [variant for variant in named if variant not in chosen]
    return chosen
