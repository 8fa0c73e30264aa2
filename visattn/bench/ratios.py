"""Ratios that hold still: a row's speed against a reference's (``% floor``, ``x timm``) taken round by round.

A shared machine moves single step times by ±10%, and drift moves them together: every row of a point is
timed in the same interleaved rounds (:mod:`visattn.bench.timing`), so within one round the rows saw the same
machine. A ratio is therefore formed per round, from the two rows' steps of that round, and reported as
the median over the rounds with its interquartile range (:class:`Spread`).

Where the two rows were timed in different memory groups (:func:`visattn.bench.memory.groups_that_fit`)
they share no round; floor, which joins every group, then links them: the ratio's values are every
quotient of the first row's per-round ratios to floor by the second row's. On CUDA every row runs alone
(:func:`visattn.bench.timing.worker_groups`) and no round is shared: the ratio's values are then every
quotient of a step of the one row by a step of the other.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from visattn.bench.sweep import FLOOR, TIMM, Result


@dataclass(frozen=True)
class Spread:
    """The median of a ratio over rounds and its interquartile range (``q1`` to ``q3``)."""

    median: float
    q1: float
    q3: float
    rounds: int  # the rounds it rests on (for a ratio linked through floor, the fewer of the two rows')

    def straddles(self, threshold: float) -> bool:
        """Whether ``threshold`` lies within the interquartile range: the median alone decides on which side."""
        return self.q1 <= threshold <= self.q3

    def scaled(self, factor: float) -> Spread:
        return Spread(self.median * factor, self.q1 * factor, self.q3 * factor, self.rounds)


def spread(values: Sequence[float], rounds: int | None = None) -> Spread:
    """Median and interquartile range (inclusive quartiles: of 5 values, the 2nd and 4th) of ``values``;
    ``rounds`` defaults to their count."""
    if not values:
        raise ValueError("spread of no values: at least one round is needed")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return Spread(statistics.median(values), q1, q3, len(values) if rounds is None else rounds)


def per_round_ratios(own: Mapping[int, float], reference: Mapping[int, float], own_batch: int = 1,
                     reference_batch: int = 1) -> list[float]:
    """Own rate over the reference's, in each round both ran: (own batch / own seconds) / (reference batch /
    reference seconds).

    Args:
        own, reference: {round serial: seconds of the step} of the two rows.
        own_batch, reference_batch: images per step of each.
    """
    return [reference[k] * own_batch / (own[k] * reference_batch) for k in own if k in reference]


def _ratios(own: Result, reference: Result) -> list[float]:
    return per_round_ratios(own.round_times, reference.round_times, own.case.batch_size, reference.case.batch_size)


def rate_ratio(own: Result, reference: Result, link: Result | None = None) -> Spread | None:
    """``own``'s images/s over ``reference``'s, per round (see the module docstring); through ``link``
    (floor) where the two share no round, step by step on CUDA. None where either did not run or no round
    connects them."""
    if not (own.ok and reference.ok):
        return None
    paired = _ratios(own, reference)
    if paired:
        return spread(paired)
    if own.case.device.startswith("cuda"):
        unpaired = [
            (own.case.batch_size / mine) / (reference.case.batch_size / theirs)
            for mine in own.times for theirs in reference.times
        ]
        return spread(unpaired, rounds=min(len(own.times), len(reference.times)))
    if link is None or not link.ok:
        return None
    mine, theirs = _ratios(own, link), _ratios(reference, link)
    if not (mine and theirs):
        return None
    return spread([a / b for a in mine for b in theirs], rounds=min(len(mine), len(theirs)))


def row_at_point(results: list[Result], attn: str, r: Result) -> Result | None:
    """Row ``attn`` of ``r``'s point: same kind, size, batch size and mode."""
    for other in results:
        c, o = r.case, other.case
        if o.attn == attn and (o.kind, o.size, o.batch_size, o.mode) == (c.kind, c.size, c.batch_size, c.mode):
            return other
    return None


def pct_of_floor(results: list[Result], r: Result) -> Spread | None:
    """``r``'s images/s in percent of floor's at its point, per round."""
    floor = row_at_point(results, FLOOR, r)
    ratio = None if floor is None else rate_ratio(r, floor)
    return None if ratio is None else ratio.scaled(100)


def speedup_over(results: list[Result], r: Result, reference: str) -> Spread | None:
    """``r``'s images/s over row ``reference``'s at its point, per round (linked through floor across memory
    groups): the statistic of ``x timm`` and of the crossover."""
    other = row_at_point(results, reference, r)
    return None if other is None else rate_ratio(r, other, link=row_at_point(results, FLOOR, r))


def speedup_vs_timm(results: list[Result], r: Result) -> Spread | None:
    """``r``'s images/s over timm's at its point, per round (linked through floor across memory groups)."""
    return speedup_over(results, r, TIMM)
