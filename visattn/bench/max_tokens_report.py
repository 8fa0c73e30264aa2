"""What ``visattn-bench max-tokens`` reports (:mod:`visattn.bench.max_tokens`): the markdown table per type and
mode (``max_tokens.md``), its CSV (``max_tokens.csv``) and every trial (``max_tokens_trials.csv``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from visattn.bench.max_tokens import MaxTokensPlan, Row
from visattn.bench.memory import MB
from visattn.bench.sweep_report import write_csv


def _grid_label(grid: tuple[int, int], patch: tuple[int, int], ops: bool) -> str:
    label = f"{grid[0]}×{grid[1]}"
    return label if ops else f"{label} ({grid[0] * patch[0]}×{grid[1] * patch[1]} px)"


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


def max_tokens_csv_rows(rows: list[Row], plan: MaxTokensPlan) -> list[dict[str, Any]]:
    """One row per type and mode: the largest fitting grid, the first failing one and why."""
    out = []
    for row in rows:
        largest, failing = row.largest, row.failing
        record: dict[str, Any] = {"attn": row.attn, "mode": row.mode, "max_tokens": largest.tokens if largest else None}
        record["grid"] = f"{largest.grid[0]}x{largest.grid[1]}" if largest else None
        if not plan.args.ops:
            record["img_size"] = f"{largest.case.size[0]}x{largest.case.size[1]}" if largest else None
        record |= {
            "peak_mem_mb": round(largest.peak_bytes / MB, 1) if largest and largest.peak_bytes is not None else None,
            "failed_tokens": failing.tokens if failing else None,
            "timed_out_tokens": row.timed_out.tokens if row.timed_out else None,
            "stopped_by": row.stopped_by,
            "message": row.error or "; ".join(t.message for t in (row.timed_out, failing) if t is not None),
            "trials": len(row.trials),
            "seconds": round(sum(t.seconds for t in row.trials.values()), 1),
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


def max_tokens_report(rows: list[Row], plan: MaxTokensPlan) -> str:
    """The markdown table of a ``max-tokens`` run: per type and mode, the largest count that fitted, its grid,
    its peak, and what stopped the search ("not searched" for a row not reached)."""
    a = plan.args
    header = ["attn"]
    for mode in a.modes:
        name = "forward" if mode == "infer" else "training"
        header += [f"{name}: max tokens", f"{name}: grid", f"{name}: peak MB", f"{name}: stopped by"]
    lines = _heading(a) + ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key = {(r.attn, r.mode): r for r in rows}
    for attn in plan.rows:
        cells = [f"`{attn}`"]
        for mode in a.modes:
            cells += _mode_cells(by_key.get((attn, mode)), plan)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _heading(a: argparse.Namespace) -> list[str]:
    """The title (the limit, what ran, where) and how the search went, from the run's arguments ``a``."""
    options = ", ".join(f"{key}={value}" for key, value in a.model_kwargs.items())
    what = f"token mixing alone, {a.heads} heads x {a.head_dim}" if a.ops else f"{a.model}" + (f" ({options})" if options else "")
    return [
        f"# max tokens within {a.max_memory / 2**30:.4g} GiB: {what}, batch 1, {a.device} {a.dtype}"
        + (", gradient checkpointing" if a.grad_checkpointing else ""),
        "",
        f"Doubling from {a.min_tokens:,} tokens up to {a.max_tokens:,}, then bisecting to within {100 * a.tolerance:.3g}%; "
        f"a trial may take {a.trial_timeout:g} s; ≥: a lower bound, the search having ended on the time limit or at "
        "--max-tokens before the memory limit was found to within the tolerance.",
        "",
    ]


def _mode_cells(row: Row | None, plan: MaxTokensPlan) -> list[str]:
    """A row's four cells in one mode: max tokens, grid, peak MB, stopped by."""
    if row is None:  # not reached (yet, or the command was stopped before it)
        return ["not searched", "", "", ""]
    largest = row.largest
    peak = "" if largest is None or largest.peak_bytes is None else f"{largest.peak_bytes / MB:,.0f}"
    grid = "" if largest is None else _grid_label(largest.grid, plan.patch, plan.args.ops)
    return [_largest_text(row), grid, peak, _stop_text(row, plan.patch, plan.args.ops)]


def write_max_tokens_files(rows: list[Row], plan: MaxTokensPlan, out: Path) -> str:
    """Write ``max_tokens.md``, ``max_tokens.csv`` and ``max_tokens_trials.csv`` in ``out``; returns the table."""
    report = max_tokens_report(rows, plan)
    (out / "max_tokens.md").write_text(report)
    write_csv(max_tokens_csv_rows(rows, plan), out / "max_tokens.csv")
    write_csv(max_tokens_trial_rows(rows), out / "max_tokens_trials.csv")
    return report
