"""The analysis of a sweep behind its report and ``*_summary.json``: per attention type, mode and batch size,
the scaling exponents of step time and memory against tokens and the crossover against the reference."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from visattn.bench.ratios import row_at_point
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


def crossover_tokens(points: Iterable[tuple[int, float | None, float | None]]) -> int | None:
    """The smallest token count from which a type beats the reference at every larger measured count.

    Args:
        points: (tokens, the type's step time, the reference's step time); None where it did not run
            (skipped, out of memory). A type that ran beats a reference that did not; sizes where
            neither ran are ignored.
    Returns:
        the token count, or None if the type does not beat the reference at the largest count.
    """
    crossover = None
    for tokens, own, reference in sorted(points, reverse=True):
        if own is None and reference is None:
            continue
        if own is None or (reference is not None and own >= reference):
            break
        crossover = tokens
    return crossover


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
                points = []
                for r in mine:
                    other = row_at_point(results, reference, r)
                    points.append((r.tokens, r.step_time, None if other is None else other.step_time))
                summary["crossover"].setdefault(attn, {}).setdefault(mode, {})[str(batch_size)] = crossover_tokens(points)
    return summary
