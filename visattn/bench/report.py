"""What a sweep reports: the markdown tables, the CSV (timm's column names), the plot, and the analysis
behind them (scaling exponents and crossovers)."""
from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from visattn.bench.sweep import FLOOR, TILED, TIMM, Result
from visattn.bench.targets import seed_claim

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


def _by_row(results: Iterable[Result]) -> dict[tuple[str, str], dict[str, Result]]:
    """{(attn, size label): {mode: result}} in sweep order."""
    rows: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.case.attn, r.case.size_label), {})[r.case.mode] = r
    return rows


def _reference(results: list[Result], attn: str, r: Result) -> Result | None:
    for other in results:
        if other.case.attn == attn and other.case.size == r.case.size and other.case.mode == r.case.mode:
            return other
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _mb(x: int | None) -> float | None:
    return None if x is None else round(x / MB, 1)


def csv_rows(results: list[Result]) -> list[dict[str, Any]]:
    """One row per attention type x size with timm's column names (``infer_samples_per_sec``, ...)."""
    out = []
    for (attn, _), by_mode in _by_row(results).items():
        first = next(iter(by_mode.values()))
        case = first.case
        row: dict[str, Any] = {"attn": attn}
        if case.kind == "model":
            row |= {"model": case.timm_name if attn in (TIMM, TILED) else case.model_name}
        else:
            row |= {"num_heads": case.num_heads, "head_dim": case.head_dim}
        row |= {"tokens": first.tokens, "grid": f"{first.grid[0]}x{first.grid[1]}", "device": case.device, "dtype": case.dtype}
        if case.kind == "model":
            row["param_count"] = round(first.param_count / 1e6, 3)
        for mode, r in by_mode.items():
            sps = r.samples_per_sec
            gflops = r.flops / 1e9
            row |= {
                f"{mode}_samples_per_sec": _round(sps, 4),
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
                floor, timm = _reference(results, FLOOR, r), _reference(results, TIMM, r)
                pct = _ratio(sps, floor.samples_per_sec if floor else None)
                row[f"{mode}_pct_of_floor"] = _round(None if pct is None else 100 * pct, 4)
                row[f"{mode}_speedup_vs_timm"] = _round(_ratio(sps, timm.samples_per_sec if timm else None), 4)
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
    """Scaling exponents (time and memory vs tokens) and crossovers per attention type and mode. The
    crossover reference is timm in the model sweep and the fused softmax op in the ops benchmark."""
    reference = "softmax" if results[0].case.kind == "op" else TIMM
    summary: dict[str, Any] = {"exponents": {}, "crossover_reference": reference, "crossover": {}}
    attns = list(dict.fromkeys(r.case.attn for r in results))
    modes = list(dict.fromkeys(r.case.mode for r in results))
    for attn in attns:
        for mode in modes:
            mine = [r for r in results if r.case.attn == attn and r.case.mode == mode]
            tokens = [r.tokens for r in mine]
            summary["exponents"].setdefault(attn, {})[mode] = {
                "time": _round(fit_exponent(tokens, [r.step_time for r in mine], fit_points)),
                "memory": _round(fit_exponent(tokens, [r.activation_bytes for r in mine], fit_points)),
            }
            if attn != reference and reference in attns:
                points = [(r.tokens, r.step_time, _reference(results, reference, r).step_time) for r in mine]
                summary["crossover"].setdefault(attn, {})[mode] = crossover_tokens(points)
    return summary


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def _status_cell(r: Result) -> str:
    return f"{r.status}: {r.message}" if r.message else r.status


def _table_cells(r: Result, results: list[Result]) -> dict[str, str]:
    """The markdown cells of one result, keyed by column; a row that did not run shows why instead of a time."""
    ops = r.case.kind == "op"
    speed_column = "ms/step" if ops else "images/s"
    cells = {"attn": r.case.attn, "grid" if ops else "img": r.case.size_label, "tokens": str(r.tokens)}
    if ops and r.case.mode == "infer":
        cells["seed claim (ms)"] = seed_claim(r.case.attn, r.tokens)
    if r.ok:
        sps = r.samples_per_sec
        cells |= {"images/s": _fmt(sps, 4), "ms/step": _fmt(1000 * r.step_time, 4), "GFLOP/s": _fmt(r.flops / 1e9 * sps, 4)}
        if not ops:
            floor, timm = _reference(results, FLOOR, r), _reference(results, TIMM, r)
            pct = _ratio(sps, floor.samples_per_sec if floor else None)
            cells["% floor"] = _fmt(None if pct is None else 100 * pct)
            cells["x timm"] = _fmt(_ratio(sps, timm.samples_per_sec if timm else None))
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


def markdown_report(results: list[Result], summary: dict[str, Any], fit_points: int) -> str:
    first = results[0].case
    ops = first.kind == "op"
    what = (
        f"attention ops alone, batch {first.batch_size}, {first.num_heads} heads x {first.head_dim}"
        if ops
        else f"{first.model_name} vs timm {first.timm_name}, batch {first.batch_size}"
    )
    flags = (", compiled" if first.compile else "") + (", gradient checkpointing" if first.grad_checkpointing else "")
    lines = [f"# visattn-bench: {what}, {first.device}, {first.dtype}{flags}", ""]
    tiled = next((r.case for r in results if r.case.attn == TILED), None)
    if tiled is not None:
        (th, tw), overlap = tiled.tile, tiled.tile_overlap
        lines += [f"{TILED}: timm {tiled.timm_name} at {th}x{tw} px on tiles of the image overlapping by at least "
                  f"{overlap} px, all tiles of a batch in one forward", ""]
    modes = list(dict.fromkeys(r.case.mode for r in results))
    titles = (
        {"infer": "Forward", "train": "Forward + backward"}
        if ops
        else {"infer": "Inference (forward)", "train": "Training step (forward + backward + AdamW)"}
    )
    for mode in modes:
        if ops:
            header = ["attn", "grid", "tokens", "ms/step"] + (["seed claim (ms)"] if mode == "infer" else [])
            header += ["GFLOPs", "GFLOP/s", "peak MB", "est. MB"]
        else:
            header = ["attn", "img", "tokens", "images/s", "ms/step", "GFLOPs/img", "GFLOP/s", "% floor", "x timm"]
            header += ["peak MB", "est. MB", "params (M)"]
        lines += [f"## {titles[mode]}", ""]
        lines += _markdown_table(header, (_table_cells(r, results) for r in results if r.case.mode == mode))
    lines += [f"## Scaling exponents (log-log slope over the largest {fit_points} sizes)", ""]
    lines += ["Time: median step time; memory: peak above the footprint after building.", ""]
    header = ["attn"] + [f"{mode} {what}" for mode in modes for what in ("time", "memory")]
    lines += _markdown_table(
        header,
        (
            {"attn": attn} | {f"{m} {what}": _fmt(by_mode[m][what]) for m in modes for what in ("time", "memory")}
            for attn, by_mode in summary["exponents"].items()
        ),
    )
    reference = summary["crossover_reference"]
    lines += [f"## Crossover: smallest token count from which the type beats {reference} at every larger size", ""]
    largest = {m: max(r.tokens for r in results if r.case.mode == m) for m in modes}
    lines += _markdown_table(
        ["attn"] + modes,
        (
            {"attn": attn} | {m: str(by_mode[m]) if by_mode[m] is not None else f"not up to {largest[m]}" for m in modes}
            for attn, by_mode in summary["crossover"].items()
        ),
    )
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[Result], path: Path) -> None:
    """Speed and peak memory against tokens, log-log, one line per attention type."""
    # Here, not at the top: the file-only backend must be chosen before pyplot loads, and only by a
    # command that draws (the library's importers keep their own backend).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    ops = results[0].case.kind == "op"
    modes = list(dict.fromkeys(r.case.mode for r in results))
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.5 * len(modes)), squeeze=False)
    style = {
        TIMM: dict(color="black", linewidth=2.5),
        FLOOR: dict(color="grey", linestyle="--", linewidth=2),
        TILED: dict(color="black", linestyle=":", linewidth=2),
    }
    for row, mode in enumerate(modes):
        ax_speed, ax_mem = axes[row]
        for attn in dict.fromkeys(r.case.attn for r in results):
            mine = [r for r in results if r.case.attn == attn and r.case.mode == mode and r.ok]
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
        measured = sorted({r.tokens for r in results if r.case.mode == mode})
        for ax, what in ((ax_speed, "speed"), (ax_mem, "peak memory")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(measured, [str(t) for t in measured])  # the measured sizes, not crowded minor ticks
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("tokens")
            ax.set_title(f"{mode}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        if ax_speed.lines:
            ax_speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
