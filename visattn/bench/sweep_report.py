"""What the sweep (``visattn-bench``) reports: the markdown tables, the CSV (timm's column names) and the plot,
with the analysis behind them (:mod:`visattn.bench.sweep_summary`) and the targets check.

Every table, CSV row, plot panel, exponent and crossover is of one batch size: a point's rows are compared
only with the references of the same image size, mode and batch. ``% floor`` and ``x timm`` are medians of
per-round ratios with their interquartile range (:mod:`visattn.bench.ratios`). ``*_mem_estimate_mb`` in the
CSV is the plan's analytic estimate, which the sweep uses to skip and to group; the tables print it (``est. MB``)
only where measured peaks were within a stated band of it (:data:`visattn.bench.memory.ESTIMATE_BANDS`), and the
report's heading states that band."""
from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from visattn.bench.memory import MB, estimate_band
from visattn.bench.ratios import Spread, pct_of_floor, speedup_vs_timm
from visattn.bench.sweep import FLOOR, TILED, TIMM, Result
from visattn.bench.sweep_summary import round_significant, sweep_settings
from visattn.bench.targets import MIN_ROUNDS, Verdict


def _by_row(results: Iterable[Result]) -> dict[tuple[str, str, int], dict[str, Result]]:
    """{(attn, size label, batch size): {mode: result}} in sweep order."""
    rows: dict[tuple[str, str, int], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.case.attn, r.case.size_label, r.case.batch_size), {})[r.case.mode] = r
    return rows


def _setting_label(mode: str, batch_size: int, results: list[Result]) -> str:
    """``infer``, or ``infer batch 16`` where the sweep has several batch sizes."""
    several = len({r.case.batch_size for r in results}) > 1
    return f"{mode} batch {batch_size}" if several else mode


def _mb(x: int | None) -> float | None:
    return None if x is None else round(x / MB, 1)


def _spread_columns(name: str, value: Spread | None) -> dict[str, float | None]:
    """``name`` (the median), ``name_q1``, ``name_q3``."""
    if value is None:
        return {name: None, f"{name}_q1": None, f"{name}_q3": None}
    median, q1, q3 = (round_significant(x, 4) for x in (value.median, value.q1, value.q3))
    return {name: median, f"{name}_q1": q1, f"{name}_q3": q3}


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
            row |= _mode_columns(results, mode, r)
        out.append(row)
    return out


def _mode_columns(results: list[Result], mode: str, r: Result) -> dict[str, Any]:
    """The CSV columns of one mode of a row (``infer_*`` or ``train_*``): speed, FLOPs, ratios, memory, status."""
    case = r.case
    sps = r.samples_per_sec
    gflops = r.flops / 1e9
    columns: dict[str, Any] = {
        f"{mode}_samples_per_sec": round_significant(sps, 4),
        f"{mode}_tokens_per_sec": round_significant(r.tokens_per_sec, 4),
        f"{mode}_step_time": round_significant(None if r.step_time is None else 1000 * r.step_time, 4),
        f"{mode}_batch_size": case.batch_size,
    }
    if case.kind == "model":
        columns[f"{mode}_img_size"] = case.size_label
    columns |= {
        f"{mode}_iters": len(r.times),
        f"{mode}_gflops": round_significant(gflops, 4),
        f"{mode}_gmacs": round_significant(gflops / 2, 4),
        f"{mode}_gflops_per_sec": round_significant(None if sps is None else gflops * sps, 4),
    }
    if case.kind == "model":
        columns |= _spread_columns(f"{mode}_pct_of_floor", pct_of_floor(results, r))
        columns |= _spread_columns(f"{mode}_speedup_vs_timm", speedup_vs_timm(results, r))
    return columns | {
        f"{mode}_peak_mem_mb": _mb(r.peak_bytes),
        f"{mode}_act_mem_mb": _mb(r.activation_bytes),
        f"{mode}_mem_estimate_mb": _mb(r.estimate_bytes),
        f"{mode}_status": _status_cell(r),
    }


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
    cells |= {"peak MB": _fmt(_mb(r.peak_bytes), 6), "est. MB": _fmt(_mb(r.estimate_bytes), 6)}
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
    lines = _heading(results) + _speed_tables(results) + _exponents_section(results, summary, fit_points)
    lines += _crossover_section(results, summary)
    if verdicts is not None:
        lines += targets_report(verdicts)
    return "\n".join(lines)


def _heading(results: list[Result]) -> list[str]:
    """The title (what ran, where, in which dtype), what the ratios are, the memory estimate's band where it has
    one and, with a tiled row, its tiling."""
    first = results[0].case
    ops = first.kind == "op"
    batches = ", ".join(str(b) for b in dict.fromkeys(r.case.batch_size for r in results))
    what = (
        f"attention ops alone, batch {batches}, {first.num_heads} heads x {first.head_dim}"
        if ops
        else f"{first.model_name} vs timm {first.timm_name}, batch {batches}"
    )
    flags = (", compiled" if first.compile else "") + (", gradient checkpointing" if first.grad_checkpointing else "")
    flags += "".join(f", {op} on {name}" for op, name in first.backends)  # --backend
    lines = [f"# visattn-bench: {what}, {first.device}, {first.dtype}{flags}", ""]
    if not ops and any(r.case.attn in (FLOOR, TIMM) for r in results):  # rows without references have no ratio
        lines += ["% floor and x timm: the median over interleaved rounds of the per-round ratio, with its "
                  "interquartile range.", ""]
    band = estimate_band(first.kind, first.device)
    if band is not None:
        lines += [f"est. MB: the memory estimate of the cost model; on {band.measured_on} the measured peaks were "
                  f"{band.low:g} to {band.high:g} times it.", ""]
    tiled = next((r.case for r in results if r.case.attn == TILED), None)
    if tiled is not None:
        (th, tw), overlap = tiled.tile, tiled.tile_overlap
        lines += [f"{TILED}: timm {tiled.timm_name} at {th}x{tw} px on tiles of the image overlapping by at least "
                  f"{overlap} px, all tiles of a batch in one forward", ""]
    return lines


def _speed_tables(results: list[Result]) -> list[str]:
    """One table per mode and batch size: every row's speed, FLOPs and memory (the estimate where it has a band)."""
    first = results[0].case
    ops = first.kind == "op"
    estimate = ["est. MB"] if estimate_band(first.kind, first.device) is not None else []
    titles = (
        {"infer": "Forward", "train": "Forward + backward"}
        if ops
        else {"infer": "Inference (forward)", "train": "Training step (forward + backward + AdamW)"}
    )
    lines = []
    for mode, batch_size in sweep_settings(results):
        if ops:
            header = ["attn", "grid", "tokens", "ms/step", "GFLOPs", "GFLOP/s", "peak MB", *estimate]
        else:
            header = ["attn", "img", "tokens", "images/s", "tokens/s", "ms/step", "GFLOPs/img", "GFLOP/s",
                      "% floor (IQR)", "x timm (IQR)", "peak MB", *estimate, "params (M)"]
        lines += [f"## {titles[mode]}, batch {batch_size}", ""]
        rows = (r for r in results if (r.case.mode, r.case.batch_size) == (mode, batch_size))
        lines += _markdown_table(header, (_table_cells(r, results) for r in rows))
    return lines


def _exponents_section(results: list[Result], summary: dict[str, Any], fit_points: int) -> list[str]:
    """The scaling exponents of step time and memory, per type, one column pair per mode and batch size that
    has an exponent (two sizes measured at least); no section where none has."""
    labels = {(mode, b): _setting_label(mode, b, results) for mode, b in sweep_settings(results)}
    fitted = [
        (m, b) for m, b in labels
        if any(by_mode[m][str(b)][what] is not None for by_mode in summary["exponents"].values() for what in ("time", "memory"))
    ]
    if not fitted:
        return []
    lines = [f"## Scaling exponents (log-log slope over the largest {fit_points} sizes)", ""]
    lines += ["Time: median step time; memory: peak above the footprint after building.", ""]
    columns = [(setting, what) for setting in fitted for what in ("time", "memory")]
    return lines + _markdown_table(
        ["attn"] + [f"{labels[setting]} {what}" for setting, what in columns],
        (
            {"attn": attn} | {f"{labels[(m, b)]} {what}": _fmt(by_mode[m][str(b)][what]) for (m, b), what in columns}
            for attn, by_mode in summary["exponents"].items()
        ),
    )


def _crossover_section(results: list[Result], summary: dict[str, Any]) -> list[str]:
    """Per type, mode and batch size, the smallest token count from which it beats the crossover reference;
    no section where the run has no reference row."""
    if not summary["crossover"]:
        return []
    settings = sweep_settings(results)
    labels = {(mode, b): _setting_label(mode, b, results) for mode, b in settings}
    reference = summary["crossover_reference"]
    lines = [f"## Crossover: smallest token count from which the type beats {reference} at every larger size", ""]
    lines += [f"Beats: the median over the rounds of the per-round ratio of its speed to {reference}'s is above 1 "
              "(the statistic of x timm).", ""]
    largest = {(m, b): max(r.tokens for r in results if (r.case.mode, r.case.batch_size) == (m, b)) for m, b in settings}

    def crossover_cell(tokens: int | None, setting: tuple[str, int]) -> str:
        return str(tokens) if tokens is not None else f"not up to {largest[setting]}"

    return lines + _markdown_table(
        ["attn"] + [labels[setting] for setting in settings],
        (
            {"attn": attn} | {labels[(m, b)]: crossover_cell(by_mode[m][str(b)], (m, b)) for m, b in settings}
            for attn, by_mode in summary["crossover"].items()
        ),
    )


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as a CSV file, the columns in the order they first appear."""
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
    settings = sweep_settings(results)
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
