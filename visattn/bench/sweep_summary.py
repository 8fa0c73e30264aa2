"""The analysis of a sweep behind its report and ``*_summary.json``: per attention type, mode and batch size,
the scaling exponents of step time and memory against tokens and the crossover against the reference.

The crossover reads the same statistic as the ``x timm`` column: at each size, the median over the rounds of
the per-round ratio of the type's images/s to the reference's (:func:`visattn.bench.ratios.speedup_over`),
never the ratio of two median step times, which a shared machine's drift can turn the other way."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from visattn.bench.ratios import row_at_point, speedup_over
from visattn.bench.sweep import TIMM, Result


def sweep_settings(results: Iterable[Result]) -> list[tuple[str, int]]:
    """(mode, batch size) of the sweep: modes in sweep order, each with its batch sizes in sweep order."""
    seen = list(dict.fromkeys((r.case.mode, r.case.batch_size) for r in results))
    return [(mode, b) for mode in dict.fromkeys(m for m, _ in seen) for m, b in seen if m == mode]


def round_significant(x: float | None, digits: int = 3) -> float | None:
    """``x`` to ``digits`` significant digits, as the CSV and the summary hold it."""
    return None if x is None else float(f"{x:.{digits}g}")


def fit_exponent(tokens: Sequence[float], values: Sequence[float | None], points: int = 3) -> float | None:
    """Log-log slope of ``values`` against ``tokens`` over the largest ``points`` token counts that have
    a positive value (least squares); None with fewer than two such points."""
    pairs = sorted((t, v) for t, v in zip(tokens, values) if v is not None and v > 0)[-points:]
    if len(pairs) < 2:
        return None
    xs = [math.log(t) for t, _ in pairs]
    ys = [math.log(v) for _, v in pairs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def crossover_tokens(points: Iterable[tuple[int, bool | None]]) -> int | None:
    """The smallest token count from which a type beats the reference at every larger measured count.

    Args:
        points: (tokens, whether the type beats the reference there: :func:`beats_reference`); None where
            neither ran, which is ignored.
    Returns:
        the token count, or None if the type does not beat the reference at the largest count.
    """
    crossover = None
    for tokens, wins in sorted(points, key=lambda point: point[0], reverse=True):
        if wins is None:
            continue
        if not wins:
            break
        crossover = tokens
    return crossover


def beats_reference(results: list[Result], r: Result, reference: str) -> bool | None:
    """Whether row ``r`` is faster than row ``reference`` at its point: the median of the per-round ratio of
    their images/s above 1 (a tie is not a win). A type that ran beats a reference that did not (skipped,
    out of memory) and loses where only the reference ran, or where no round connects the two; None where
    neither ran."""
    other = row_at_point(results, reference, r)
    reference_ran = other is not None and other.ok
    if not r.ok:
        return False if reference_ran else None
    if not reference_ran:
        return True
    ratio = speedup_over(results, r, reference)
    return ratio is not None and ratio.median > 1


def summarize(results: list[Result], fit_points: int) -> dict[str, Any]:
    """Scaling exponents (time and memory vs tokens) and crossovers per attention type, mode and batch size
    (``summary["exponents"][attn][mode][batch]``). The crossover reference is timm in the model sweep and
    the fused softmax op in the ops benchmark."""
    reference = "softmax" if results[0].case.kind == "op" else TIMM
    summary: dict[str, Any] = {"exponents": {}, "crossover_reference": reference, "crossover": {}}
    attns = list(dict.fromkeys(r.case.attn for r in results))
    for attn in attns:
        for mode, batch_size in sweep_settings(results):
            mine = [r for r in results if (r.case.attn, r.case.mode, r.case.batch_size) == (attn, mode, batch_size)]
            tokens = [r.tokens for r in mine]
            summary["exponents"].setdefault(attn, {}).setdefault(mode, {})[str(batch_size)] = {
                "time": round_significant(fit_exponent(tokens, [r.step_time for r in mine], fit_points)),
                "memory": round_significant(fit_exponent(tokens, [r.activation_bytes for r in mine], fit_points)),
            }
            if attn != reference and reference in attns:
                points = [(r.tokens, beats_reference(results, r, reference)) for r in mine]
                summary["crossover"].setdefault(attn, {}).setdefault(mode, {})[str(batch_size)] = crossover_tokens(points)
    return summary
