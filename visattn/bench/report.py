"""What a sweep reports: the markdown tables, the CSV (timm's column names), the plot, and the analysis
behind them (scaling exponents and crossovers per mode and batch size, the targets check); and the
tables of a ``max-tokens`` run (:mod:`visattn.bench.search`).

Every table, CSV row, plot panel, exponent and crossover is of one batch size: a point's rows are compared
only with the references of the same image size, mode and batch. ``% floor`` and ``x timm`` are medians of
per-round ratios with their interquartile range (:mod:`visattn.bench.ratios`). ``est. MB (lower bound)``
(``*_mem_estimate_mb`` in the CSV) is the plan's analytic estimate, which the sweep uses to skip and to
group: measured peaks on CPU have been 2.5 to 4 times above it, so it is a lower bound, not a forecast."""
from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from visattn.bench.ratios import Spread, rate_ratio
from visattn.bench.search import MaxTokensSweep, Row
from visattn.bench.sweep import FLOOR, TILED, TIMM, Result
from visattn.bench.targets import MIN_ROUNDS, SEED_CLAIM_OF_ROW, SEED_MAX_TOKENS, Verdict, seed_claim

MB = 2**20


# ---------------------------------------------------------------------------------------------------
# Analysis: exponents and crossovers


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


# ---------------------------------------------------------------------------------------------------
# Reports


def _by_row(results: Iterable[Result]) -> dict[tuple[str, str, int], dict[str, Result]]:
    """{(attn, size label, batch size): {mode: result}} in sweep order."""
    rows: dict[tuple[str, str, int], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.case.attn, r.case.size_label, r.case.batch_size), {})[r.case.mode] = r
    return rows


def _settings(results: Iterable[Result]) -> list[tuple[str, int]]:
    """(mode, batch size) of the sweep: modes in sweep order, each with its batch sizes in sweep order."""
    seen = list(dict.fromkeys((r.case.mode, r.case.batch_size) for r in results))
    return [(mode, b) for mode in dict.fromkeys(m for m, _ in seen) for m, b in seen if m == mode]


def _setting_label(mode: str, batch_size: int, results: list[Result]) -> str:
    """``infer``, or ``infer batch 16`` where the sweep has several batch sizes."""
    several = len({r.case.batch_size for r in results}) > 1
    return f"{mode} batch {batch_size}" if several else mode


def _reference(results: list[Result], attn: str, r: Result) -> Result | None:
    """Row ``attn`` of ``r``'s point: same kind, size, batch size and mode."""
    for other in results:
        c, o = r.case, other.case
        if o.attn == attn and (o.kind, o.size, o.batch_size, o.mode) == (c.kind, c.size, c.batch_size, c.mode):
            return other
    return None


def pct_of_floor(results: list[Result], r: Result) -> Spread | None:
    """``r``'s images/s in percent of floor's at its point, per round."""
    floor = _reference(results, FLOOR, r)
    ratio = None if floor is None else rate_ratio(r, floor)
    return None if ratio is None else ratio.scaled(100)


def speedup_vs_timm(results: list[Result], r: Result) -> Spread | None:
    """``r``'s images/s over timm's at its point, per round (linked through floor across memory groups)."""
    timm = _reference(results, TIMM, r)
    return None if timm is None else rate_ratio(r, timm, link=_reference(results, FLOOR, r))


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _mb(x: int | None) -> float | None:
    return None if x is None else round(x / MB, 1)


def _spread_columns(name: str, value: Spread | None) -> dict[str, float | None]:
    """``name`` (the median), ``name_q1``, ``name_q3``."""
    if value is None:
        return {name: None, f"{name}_q1": None, f"{name}_q3": None}
    return {name: _round(value.median, 4), f"{name}_q1": _round(value.q1, 4), f"{name}_q3": _round(value.q3, 4)}


def csv_rows(results: list[Result]) -> list[dict[str, Any]]:
    """One row per attention type x size x batch size with timm's column names (``infer_samples_per_sec``,
    ...); the ratios with their quartiles (``infer_pct_of_floor_q1``, ``infer_pct_of_floor_q3``)."""
    out = []
    for (attn, _, batch_size), by_mode in _by_row(results).items():
        first = next(iter(by_mode.values()))
        case = first.case
        row: dict[str, Any] = {"attn": attn}
        if case.kind == "model":
            row |= {"model": case.timm_name if attn in (TIMM, TILED) else case.model_name}
        else:
            row |= {"num_heads": case.num_heads, "head_dim": case.head_dim}
        row |= {"batch_size": batch_size, "tokens": first.tokens, "grid": f"{first.grid[0]}x{first.grid[1]}"}
        row |= {"device": case.device, "dtype": case.dtype}
        if case.kind == "model":
            row["param_count"] = round(first.param_count / 1e6, 3)
        for mode, r in by_mode.items():
            sps = r.samples_per_sec
            gflops = r.flops / 1e9
            row |= {
                f"{mode}_samples_per_sec": _round(sps, 4),
                f"{mode}_tokens_per_sec": _round(r.tokens_per_sec, 4),
                f"{mode}_step_time": _round(None if r.step_time is None else 1000 * r.step_time, 4),
                f"{mode}_batch_size": case.batch_size,
            }
            if case.kind == "model":
                row[f"{mode}_img_size"] = case.size_label
            row |= {
                f"{mode}_iters": len(r.times),
                f"{mode}_gflops": _round(gflops, 4),
                f"{mode}_gmacs": _round(gflops / 2, 4),
                f"{mode}_gflops_per_sec": _round(None if sps is None else gflops * sps, 4),
            }
            if case.kind == "model":
                row |= _spread_columns(f"{mode}_pct_of_floor", pct_of_floor(results, r))
                row |= _spread_columns(f"{mode}_speedup_vs_timm", speedup_vs_timm(results, r))
            row |= {
                f"{mode}_peak_mem_mb": _mb(r.peak_bytes),
                f"{mode}_act_mem_mb": _mb(r.activation_bytes),
                f"{mode}_mem_estimate_mb": _mb(r.estimate_bytes),
                f"{mode}_status": _status_cell(r),
            }
        if case.kind == "op":
            row["seed_claimed_ms"] = seed_claim(attn, first.tokens)
        out.append(row)
    return out


def summarize(results: list[Result], fit_points: int) -> dict[str, Any]:
    """Scaling exponents (time and memory vs tokens) and crossovers per attention type, mode and batch size
    (``summary["exponents"][attn][mode][batch]``). The crossover reference is timm in the model sweep and
    the fused softmax op in the ops benchmark."""
    reference = "softmax" if results[0].case.kind == "op" else TIMM
    summary: dict[str, Any] = {"exponents": {}, "crossover_reference": reference, "crossover": {}}
    attns = list(dict.fromkeys(r.case.attn for r in results))
    for attn in attns:
        for mode, batch_size in _settings(results):
            mine = [r for r in results if (r.case.attn, r.case.mode, r.case.batch_size) == (attn, mode, batch_size)]
            tokens = [r.tokens for r in mine]
            summary["exponents"].setdefault(attn, {}).setdefault(mode, {})[str(batch_size)] = {
                "time": _round(fit_exponent(tokens, [r.step_time for r in mine], fit_points)),
                "memory": _round(fit_exponent(tokens, [r.activation_bytes for r in mine], fit_points)),
            }
            if attn != reference and reference in attns:
                points = []
                for r in mine:
                    other = _reference(results, reference, r)
                    points.append((r.tokens, r.step_time, None if other is None else other.step_time))
                summary["crossover"].setdefault(attn, {}).setdefault(mode, {})[str(batch_size)] = crossover_tokens(points)
    return summary


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def _status_cell(r: Result) -> str:
    return f"{r.status}: {r.message}" if r.message else r.status


def _fmt_spread(value: Spread | None) -> str:
    """``96.2 (93.1-98)``: the median and the interquartile range."""
    if value is None:
        return "-"
    return f"{_fmt(value.median)} ({_fmt(value.q1)}-{_fmt(value.q3)})"


def _table_cells(r: Result, results: list[Result]) -> dict[str, str]:
    """The markdown cells of one result, keyed by column; a row that did not run shows why instead of a time."""
    ops = r.case.kind == "op"
    speed_column = "ms/step" if ops else "images/s"
    cells = {"attn": r.case.attn, "grid" if ops else "img": r.case.size_label, "tokens": str(r.tokens)}
    if ops and r.case.mode == "infer":
        cells["seed claim (ms)"] = seed_claim(r.case.attn, r.tokens)
    if r.ok:
        sps = r.samples_per_sec
        cells |= {"images/s": _fmt(sps, 4), "tokens/s": _fmt(r.tokens_per_sec, 4), "ms/step": _fmt(1000 * r.step_time, 4)}
        cells["GFLOP/s"] = _fmt(r.flops / 1e9 * sps, 4)
        if not ops:
            cells["% floor (IQR)"] = _fmt_spread(pct_of_floor(results, r))
            cells["x timm (IQR)"] = _fmt_spread(speedup_vs_timm(results, r))
    else:
        cells[speed_column] = _status_cell(r)
    cells |= {"GFLOPs" if ops else "GFLOPs/img": _fmt(r.flops / 1e9, 4)}
    cells |= {"peak MB": _fmt(_mb(r.peak_bytes), 6), "est. MB (lower bound)": _fmt(_mb(r.estimate_bytes), 6)}
    if not ops:
        cells["params (M)"] = _fmt(r.param_count / 1e6)
    return cells


def _markdown_table(header: list[str], rows: Iterable[dict[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row.get(column, "") for column in header) + " |" for row in rows]
    return lines + [""]


def _verdict_cells(v: Verdict) -> dict[str, str]:
    cells = {"target": v.target.describe(v.attn)}
    if v.value is None:
        return cells | {"median (IQR)": "-", "verdict": f"not measured ({v.why})"}
    cells["median (IQR)"] = _fmt_spread(v.spread) if v.spread is not None else _fmt(v.value)
    cells["rounds"] = "" if v.spread is None else str(v.spread.rounds) + (" (too few)" if v.too_few_rounds else "")
    cells["verdict"] = "met" if v.met else "missed"
    cells["decided by the spread"] = "yes" if v.decided_by_spread else ""
    return cells


def targets_report(verdicts: list[Verdict]) -> list[str]:
    """The targets section: each verdict, and a line naming the ones the spread decided."""
    lines = ["## Targets", ""]
    if not verdicts:
        return lines + ["No target of visattn/bench/targets.py is at a point of this run, in its setting (ViT-S/16, "
                        "each type's default options; fp32 on CPU, bf16 on CUDA).", ""]
    lines += [
        f"Met when the median over the rounds clears the threshold; decided by the spread when the interquartile "
        f"range straddles it; fewer than {MIN_ROUNDS} rounds are flagged.", "",
    ]
    lines += _markdown_table(["target", "median (IQR)", "rounds", "verdict", "decided by the spread"],
                             (_verdict_cells(v) for v in verdicts))
    judged = [v for v in verdicts if v.value is not None]
    by_spread = [f"{v.attn} ({v.target.mode} {v.target.size}² batch {v.target.batch_size})" for v in judged if v.decided_by_spread]
    lines += [f"{sum(v.met for v in judged)} of {len(judged)} measured targets met; decided by the spread: "
              f"{', '.join(by_spread) or 'none'}.", ""]
    return lines


def markdown_report(
    results: list[Result], summary: dict[str, Any], fit_points: int, verdicts: list[Verdict] | None = None
) -> str:
    """The report: one table per mode and batch size, the scaling exponents, the crossovers and, for a model
    sweep given its ``verdicts``, the targets."""
    first = results[0].case
    ops = first.kind == "op"
    batches = ", ".join(str(b) for b in dict.fromkeys(r.case.batch_size for r in results))
    what = (
        f"attention ops alone, batch {batches}, {first.num_heads} heads x {first.head_dim}"
        if ops
        else f"{first.model_name} vs timm {first.timm_name}, batch {batches}"
    )
    flags = (", compiled" if first.compile else "") + (", gradient checkpointing" if first.grad_checkpointing else "")
    lines = [f"# visattn-bench: {what}, {first.device}, {first.dtype}{flags}", ""]
    if not ops:
        lines += ["% floor and x timm: the median over interleaved rounds of the per-round ratio, with its "
                  "interquartile range.", ""]
    tiled = next((r.case for r in results if r.case.attn == TILED), None)
    if tiled is not None:
        (th, tw), overlap = tiled.tile, tiled.tile_overlap
        lines += [f"{TILED}: timm {tiled.timm_name} at {th}x{tw} px on tiles of the image overlapping by at least "
                  f"{overlap} px, all tiles of a batch in one forward", ""]
    settings = _settings(results)
    titles = (
        {"infer": "Forward", "train": "Forward + backward"}
        if ops
        else {"infer": "Inference (forward)", "train": "Training step (forward + backward + AdamW)"}
    )
    for mode, batch_size in settings:
        if ops:
            header = ["attn", "grid", "tokens", "ms/step"] + (["seed claim (ms)"] if mode == "infer" else [])
            header += ["GFLOPs", "GFLOP/s", "peak MB", "est. MB (lower bound)"]
        else:
            header = ["attn", "img", "tokens", "images/s", "tokens/s", "ms/step", "GFLOPs/img", "GFLOP/s",
                      "% floor (IQR)", "x timm (IQR)", "peak MB", "est. MB (lower bound)", "params (M)"]
        lines += [f"## {titles[mode]}, batch {batch_size}", ""]
        rows = (r for r in results if (r.case.mode, r.case.batch_size) == (mode, batch_size))
        lines += _markdown_table(header, (_table_cells(r, results) for r in rows))
    labels = {(mode, b): _setting_label(mode, b, results) for mode, b in settings}
    lines += [f"## Scaling exponents (log-log slope over the largest {fit_points} sizes)", ""]
    lines += ["Time: median step time; memory: peak above the footprint after building.", ""]
    columns = [(setting, what) for setting in settings for what in ("time", "memory")]
    lines += _markdown_table(
        ["attn"] + [f"{labels[setting]} {what}" for setting, what in columns],
        (
            {"attn": attn} | {f"{labels[(m, b)]} {what}": _fmt(by_mode[m][str(b)][what]) for (m, b), what in columns}
            for attn, by_mode in summary["exponents"].items()
        ),
    )
    reference = summary["crossover_reference"]
    lines += [f"## Crossover: smallest token count from which the type beats {reference} at every larger size", ""]
    largest = {(m, b): max(r.tokens for r in results if (r.case.mode, r.case.batch_size) == (m, b)) for m, b in settings}

    def crossover_cell(tokens: int | None, setting: tuple[str, int]) -> str:
        return str(tokens) if tokens is not None else f"not up to {largest[setting]}"

    lines += _markdown_table(
        ["attn"] + [labels[setting] for setting in settings],
        (
            {"attn": attn} | {labels[(m, b)]: crossover_cell(by_mode[m][str(b)], (m, b)) for m, b in settings}
            for attn, by_mode in summary["crossover"].items()
        ),
    )
    if verdicts is not None:
        lines += targets_report(verdicts)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Max tokens


def _grid_label(grid: tuple[int, int], patch: tuple[int, int], ops: bool) -> str:
    label = f"{grid[0]}×{grid[1]}"
    return label if ops else f"{label} ({grid[0] * patch[0]}×{grid[1] * patch[1]} px)"


def _seed_claim(attn: str) -> str:
    kind = SEED_CLAIM_OF_ROW.get("softmax" if attn == TIMM else attn)
    return "" if kind is None else f"{kind}: ~{SEED_MAX_TOKENS[kind]:,}"


def _stop_text(row: Row, patch: tuple[int, int], ops: bool) -> str:
    if row.error:
        return f"error: {row.error}"
    if row.stopped:
        return f"the command was stopped during its search, after {len(row.trials)} trial(s)"
    parts = []
    for trial, what in ((row.timed_out, "time limit"), (row.failing, "out of memory")):
        if trial is not None:
            parts.append(f"{what} at {trial.tokens:,} tokens, {_grid_label(trial.grid, patch, ops)}")
    return "; ".join(parts) or "fits at --max-tokens"


def _largest_text(row: Row) -> str:
    """The largest count that fitted; "≥" where the search ended before it found the memory limit (time,
    --max-tokens, the command stopped)."""
    largest = row.largest
    if largest is None and (row.search is None or row.stopped_by == "time"):
        return "?"
    if largest is None:
        return f"< {row.search.trials[0][0]:,}"
    bound = "≥ " if row.stopped_by in ("time", "ceiling", "stopped") else ""
    return f"{bound}{largest.tokens:,}"


def max_tokens_csv_rows(rows: list[Row], sweep: MaxTokensSweep) -> list[dict[str, Any]]:
    """One row per type and mode: the largest fitting grid, the first failing one and why."""
    out = []
    for row in rows:
        largest, failing = row.largest, row.failing
        record: dict[str, Any] = {"attn": row.attn, "mode": row.mode, "max_tokens": largest.tokens if largest else None}
        record["grid"] = f"{largest.grid[0]}x{largest.grid[1]}" if largest else None
        if not sweep.args.ops:
            record["img_size"] = f"{largest.case.size[0]}x{largest.case.size[1]}" if largest else None
        record |= {
            "peak_mem_mb": round(largest.peak_bytes / MB, 1) if largest and largest.peak_bytes is not None else None,
            "failed_tokens": failing.tokens if failing else None,
            "timed_out_tokens": row.timed_out.tokens if row.timed_out else None,
            "stopped_by": row.stopped_by,
            "message": row.error or "; ".join(t.message for t in (row.timed_out, failing) if t is not None),
            "trials": len(row.trials),
            "seconds": round(sum(t.seconds for t in row.trials.values()), 1),
            "seed_claim": _seed_claim(row.attn),
        }
        out.append(record)
    return out


def max_tokens_trial_rows(rows: list[Row]) -> list[dict[str, Any]]:
    """Every trial, in the order run."""
    return [
        {
            "attn": row.attn, "mode": row.mode, "tokens": t.tokens, "grid": f"{t.grid[0]}x{t.grid[1]}", "status": t.status,
            "seconds": round(t.seconds, 2), "peak_mem_mb": None if t.peak_bytes is None else round(t.peak_bytes / MB, 1),
            "message": t.message,
        }
        for row in rows
        for t in row.trials.values()
    ]


def max_tokens_report(rows: list[Row], sweep: MaxTokensSweep) -> str:
    """The markdown table of a ``max-tokens`` run: per type and mode, the largest count that fitted, its grid,
    its peak, and what stopped the search ("not searched" for a row not reached)."""
    a = sweep.args
    options = ", ".join(f"{key}={value}" for key, value in a.model_kwargs.items())
    what = f"token mixing alone, {a.heads} heads x {a.head_dim}" if a.ops else f"{a.model}" + (f" ({options})" if options else "")
    lines = [
        f"# max tokens within {a.max_memory / 2**30:.4g} GiB: {what}, batch 1, {a.device} {a.dtype}"
        + (", gradient checkpointing" if a.grad_checkpointing else ""),
        "",
        f"Doubling from {a.min_tokens:,} tokens up to {a.max_tokens:,}, then bisecting to within {100 * a.tolerance:.3g}%; "
        f"a trial may take {a.trial_timeout:g} s; ≥: a lower bound, the search having ended on the time limit or at "
        "--max-tokens before the memory limit was found to within the tolerance.",
        "",
    ]
    by_key = {(r.attn, r.mode): r for r in rows}
    header = ["attn"]
    for mode in a.modes:
        name = "forward" if mode == "infer" else "training"
        header += [f"{name}: max tokens", f"{name}: grid", f"{name}: peak MB", f"{name}: stopped by"]
    header.append("seed claim")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for attn in sweep.rows:
        cells = [f"`{attn}`"]
        for mode in a.modes:
            row = by_key.get((attn, mode))
            if row is None:  # not reached (yet, or the command was stopped before it)
                cells += ["not searched", "", "", ""]
                continue
            largest = row.largest
            peak = "" if largest is None or largest.peak_bytes is None else f"{largest.peak_bytes / MB:,.0f}"
            grid = "" if largest is None else _grid_label(largest.grid, sweep.patch, a.ops)
            cells += [_largest_text(row), grid, peak, _stop_text(row, sweep.patch, a.ops)]
        cells.append(_seed_claim(attn))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Files


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[Result], path: Path) -> None:
    """Speed and peak memory against tokens, log-log, one line per attention type; one row of panels per
    mode and batch size."""
    # Here, not at the top: the file-only backend must be chosen before pyplot loads, and only by a
    # command that draws (the library's importers keep their own backend).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    ops = results[0].case.kind == "op"
    settings = _settings(results)
    fig, axes = plt.subplots(len(settings), 2, figsize=(12, 4.5 * len(settings)), squeeze=False)
    style = {
        TIMM: dict(color="black", linewidth=2.5),
        FLOOR: dict(color="grey", linestyle="--", linewidth=2),
        TILED: dict(color="black", linestyle=":", linewidth=2),
    }
    for row, (mode, batch_size) in enumerate(settings):
        ax_speed, ax_mem = axes[row]
        here = [r for r in results if (r.case.mode, r.case.batch_size) == (mode, batch_size)]
        for attn in dict.fromkeys(r.case.attn for r in results):
            mine = [r for r in here if r.case.attn == attn and r.ok]
            if not mine:
                continue
            tokens = [r.tokens for r in mine]
            speed = [1000 * r.step_time for r in mine] if ops else [r.samples_per_sec for r in mine]
            kwargs = style.get(attn, {}) | dict(marker="o", label=attn)
            ax_speed.plot(tokens, speed, **kwargs)
            mem = [(t, r.peak_bytes / MB) for t, r in zip(tokens, mine) if r.peak_bytes]
            if mem:
                ax_mem.plot(*zip(*mem), **kwargs)
        ax_speed.set_ylabel("ms per step" if ops else "images / s")
        ax_mem.set_ylabel("peak memory (MB)")
        measured = sorted({r.tokens for r in here})
        for ax, what in ((ax_speed, "speed"), (ax_mem, "peak memory")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(measured, [str(t) for t in measured])  # the measured sizes, not crowded minor ticks
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("tokens")
            ax.set_title(f"{mode}, batch {batch_size}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        if ax_speed.lines:
            ax_speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
