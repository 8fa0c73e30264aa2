"""The tables as files: the accuracy table (markdown, with its figure, every run as JSON and CSV), the summary
of one accuracy table per variant of the data (markdown and JSON), and the resolution table (markdown, every
run as JSON)."""
from __future__ import annotations

import csv
import json
import shlex
import statistics
from pathlib import Path
from typing import Any

from visattn.experiments.larger_size import MOST_CONFIDENT, SECOND_STAGE, TRAINED, UPSAMPLED, WHOLE, Evaluation, columns, tiled_column
from visattn.experiments.plan import Run, all_runs, expected_config
from visattn.experiments.plot import plot
from visattn.experiments.summarize import DEVICE_WORDS, RowResult, device_kinds, epoch_seconds, run_epochs_at_chance
from visattn.experiments.variants import Variant, group_of
from visattn.models import TIMM_ATTENTION
from visattn.train import TrainConfig


def command_line(module: str, argv: list[str]) -> str:
    """The command that trains a table's runs and writes it, as a shell reads it (``--tables-only``, which only
    writes it from runs trained before, left out)."""
    return shlex.join(["python", "-m", module, *(word for word in argv if word != "--tables-only")])


def median_range(values: list[float]) -> str:
    """Accuracies as a percentage: the median, and with more than one value their range."""
    median = f"{100 * statistics.median(values):.2f}%"
    if len(values) == 1:
        return median
    return f"{median} [{100 * min(values):.2f}–{100 * max(values):.2f}]"


# -- the accuracy table ---------------------------------------------------------------------------------------
CHANCE_NOTE = (
    "epochs at chance: the leading epochs of the first stage whose validation accuracy is below chance plus three "
    "standard errors, 1/C + 3·sqrt((1/C)(1 − 1/C)/n) for C classes and n validation images (median [min–max] over "
    "the seeds)"
)


def accuracy_cell(result: RowResult) -> str:
    return f"{median_range(result.accs)} ({result.count})" if result.accs else "—"


def chance_cell(result: RowResult) -> str:
    """Epochs at chance: the median over seeds, and where they differ their range."""
    values = result.chance_epochs
    if not values:
        return "—"
    median = f"{statistics.median(values):g}"
    return median if min(values) == max(values) else f"{median} [{min(values)}–{max(values)}]"


def _number(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _rate(value: float | None) -> str:
    """Images/s to three figures or more: a few images/s at high resolution on a CPU keep their decimals."""
    return _number(value, 0 if value is None or value >= 100 else 1 if value >= 10 else 2)


def accuracy_markdown(results: list[RowResult], runs: list[Run], recipe: TrainConfig, command: str) -> str:
    finished = [run for run in runs if run.status == "finished"]
    mem_kinds = device_kinds(finished)
    on_gpu = mem_kinds == {"cuda_allocated"}
    rows_, cols_ = (side // recipe.patch_size for side in recipe.image_hw)
    tokens = f"{rows_ * cols_:,} tokens"
    timm = next((result for result in results if result.row.attn == TIMM_ATTENTION), None)
    reference = timm.images_per_s if timm is not None else None
    lines = [
        f"| attention | test accuracy, median [min–max] (seeds) | epochs at chance | train images/s | s per epoch | "
        f"{'peak GPU memory' if on_gpu else 'peak memory'} (MiB) | speed-up over timm | runs at {tokens} |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    # Rows measured on different kinds of device name theirs beside their speed: a GPU's and a CPU's are not compared.
    row_kinds = {result.mem_kind for result in results if result.mem_kind is not None}
    for result in results:
        speedup = (
            f"{result.images_per_s / reference:.2f}×"
            if reference and result.images_per_s is not None and result.mem_kind == timm.mem_kind else "—"
        )
        status = result.status
        if status == "failed":
            failed = next(run for run in runs if run.row == result.row and run.status == "failed")
            status = f"failed (see `{failed.failed_log}`)"
        elif status == "no: out of memory":
            failed = next(run for run in runs if run.row == result.row and run.status == "out of memory")
            if failed.cause is not failed:
                status = f"no: out of memory in stage {failed.cause.stage} (see `{failed.failed_log}`)"
        lines.append(
            f"| {result.row.label} | {accuracy_cell(result)} | {chance_cell(result)} | "
            f"{device_named(_rate(result.images_per_s), result, len(row_kinds) > 1)} | "
            f"{_number(result.epoch_s, 1)} | {_number(result.peak_mem_mib)} | {speedup} | {status} |"
        )
    memory = (
        "GPU memory allocated by tensors" if on_gpu
        else "on CPU the whole process's peak resident set, Python runtime and dataset included"
        if mem_kinds <= {"cpu_peak_rss"}
        else "GPU memory allocated by tensors for runs on a GPU, the whole process's peak resident set for runs on a CPU"
    )
    variant = runs[0].variant if runs else None
    data = recipe.dataset
    if variant is not None:
        data += f" variant {variant} (options {recipe.dataset_kwargs})"
    note = (
        f"`{command}`: {data} at {recipe.image_hw[0]}×{recipe.image_hw[1]} px, patch {recipe.patch_size} "
        f"({rows_}×{cols_} grid, {tokens}), {recipe.model} of width {recipe.embed_dim}, depth {recipe.depth}, "
        f"{recipe.num_heads} heads, {recipe.epochs} epoch{'s' if recipe.epochs != 1 else ''}{curriculum(runs)}; seeds "
        f"{', '.join(str(seed) for seed in sorted({run.seed for run in runs}))}. Test accuracy of the weights chosen on "
        f"validation; {CHANCE_NOTE}; images/s over the training steps and seconds per epoch (training and "
        f"validation), each from the run's own records, and peak memory ({memory}): medians over the seeds. "
        "Speed-up: images/s over "
        "the timm row's (timm's own Attention in the same ViT), from runs that may have shared the machine with "
        "the grid's other runs: how fast a type trains is the benchmark's figure (visattn-bench), not this column's."
    )
    if len(row_kinds) > 1:
        note += (" Each row's speed, seconds and memory are on the kind of device named beside its images/s: a GPU's "
                 "and a CPU's are not compared.")
    if any(result.mixed_devices for result in results):
        note += " Speed, seconds and memory read — in a row whose seeds ran on different kinds of device."
    return "\n".join(lines) + "\n\n" + note + "\n"


def device_named(cell: str, result: RowResult, named: bool) -> str:
    """``cell`` followed by the row's kind of device where ``named`` (a table whose rows ran on several)."""
    word = DEVICE_WORDS.get(result.mem_kind)
    return f"{cell} ({word})" if named and word and cell != "—" else cell


def curriculum(runs: list[Run]) -> str:
    """The note's words for the earlier stages: their epochs, grids, and dataset and its options where those
    differ from the last stage's ("" without any)."""
    earlier = runs[0].earlier if runs else []
    if not earlier:
        return ""
    last = expected_config(runs[0].argv)
    words = []
    for stage in earlier:
        config = expected_config(stage.argv)
        rows_, cols_ = (side // config.patch_size for side in config.image_hw)
        data = "" if config.dataset == last.dataset else f" of {config.dataset}"
        if config.dataset_kwargs != last.dataset_kwargs:
            data += f", dataset options {config.dataset_kwargs}"
        words.append(f"{config.epochs} epoch{'s' if config.epochs != 1 else ''} at "
                     f"{config.image_hw[0]}×{config.image_hw[1]} px ({rows_}×{cols_} grid){data}")
    if len(words) == 1:
        return f", after a first stage of {words[0]} whose weights it starts from (speed and memory: this last stage alone)"
    return (
        f", after {len(words)} earlier stages ({'; '.join(words)}), each from the weights of the one before, and "
        f"this last stage from those of stage {len(words)} (speed and memory: this last stage alone)"
    )


CSV_FIELDS = ("variant", "row", "attn", "options", "seed", "stage", "status", "test_acc", "best_acc", "best_epoch",
              "epochs", "epochs_at_chance", "images_per_s", "epoch_time_s", "peak_mem_mib", "mem_kind", "wall_time_s",
              "run_dir")


def run_record(run: Run) -> dict[str, Any]:
    summary = run.summary or {}
    return {
        "variant": run.variant, "row": run.row.text, "attn": run.row.attn, "options": run.row.options, "seed": run.seed,
        "stage": run.stage, "status": run.status,
        **{key: summary.get(key) for key in ("test_acc", "best_acc", "best_epoch", "epochs", "images_per_s",
                                              "peak_mem_mib", "mem_kind", "wall_time_s")},
        "epochs_at_chance": run_epochs_at_chance(run),  # of its (row, seed)'s first stage, on every stage's record
        "epoch_time_s": epoch_seconds(run.history), "run_dir": str(run.run_dir),
    }


def write_accuracy(output: Path, results: list[RowResult], runs: list[Run], recipe: TrainConfig, command: str) -> str:
    """The markdown table, and the PNG, JSON and CSV beside it (with every earlier stage); returns the table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    table = accuracy_markdown(results, runs, recipe, command)
    output.write_text(table)
    plot(results, runs, output.with_suffix(".png"))
    every_run = all_runs(runs)
    records = [run_record(run) for run in every_run]
    output.with_suffix(".json").write_text(json.dumps(
        {"command": command, "runs": [{**record, "history": run.history} for record, run in zip(records, every_run)]},
        indent=1,
    ))
    with open(output.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({**record, "options": json.dumps(record["options"])} for record in records)
    return table


# -- the summary over variants of the data --------------------------------------------------------------------
def variant_output(output: Path, variant: Variant) -> Path:
    """A variant's own accuracy table beside the summary ``output``: ``NAME-<variant>.md``."""
    return output.with_name(f"{output.stem}-{variant.name}{output.suffix}")


def variants_markdown(per_variant: list[tuple[Variant, list[RowResult]]], output: Path, command: str) -> str:
    """One row per (variant, attention row): its group, test accuracy, seconds for all stages, epochs at chance."""
    lines = [
        f"Command: `{command}`",
        "",
        "| variant | group | attention | test accuracy, median [min–max] (seeds) | s, all stages (median) | "
        "epochs at chance |",
        "|---|---|---|---:|---:|---:|",
    ]
    row_kinds = {result.mem_kind for _, results in per_variant for result in results if result.mem_kind is not None}
    for variant, results in per_variant:
        for result in results:
            lines.append(f"| {variant.name} | {group_of(variant)} | {result.row.label} | {accuracy_cell(result)} | "
                         f"{device_named(_number(result.all_stages_s), result, len(row_kinds) > 1)} | "
                         f"{chance_cell(result)} |")
    tables = ", ".join(f"[{variant.name}]({variant_output(output, variant).name})" for variant, _ in per_variant)
    mixed = (" (— where they ran on different kinds of device)"
             if any(result.mixed_devices for _, results in per_variant for result in results) else "")
    if len(row_kinds) > 1:
        mixed += ", on the kind of device named beside them: a GPU's and a CPU's are not compared"
    note = (
        "Recipe decisions are made on the tuning variants and reported on the held-out ones, which are not changed "
        "once a result on them has been seen (visattn/experiments/variants.py). Test accuracy of the weights chosen on validation; seconds: "
        "the wall time train.py recorded for each stage, summed over the stages, median over the seeds"
        f"{mixed}; "
        f"{CHANCE_NOTE}. "
        f"Each variant's own table, with speed and memory: {tables}."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def write_variants(output: Path, per_variant: list[tuple[Variant, list[RowResult]]], command: str) -> str:
    """The summary table, and its rows as JSON beside it; returns the table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    table = variants_markdown(per_variant, output, command)
    output.write_text(table)
    output.with_suffix(".json").write_text(json.dumps({"command": command, "rows": [
        {"variant": variant.name, "group": group_of(variant), "dataset_kwargs": variant.dataset_kwargs,
         "row": result.row.text, "seeds": result.seeds, "test_accs": result.accs, "all_stages_s": result.all_stages_s,
         "epochs_at_chance": result.chance_epochs, "status": result.status}
        for variant, results in per_variant for result in results
    ]}, indent=1))
    return table


# -- the resolution table -------------------------------------------------------------------------------------
def _cell(values: list[float | None], failed: bool) -> str:
    if failed:
        return "error"
    values = [value for value in values if value is not None]
    return median_range(values) if values else "–"


def _size(hw: tuple[int, int]) -> str:
    return f"{hw[0]} px" if hw[0] == hw[1] else f"{hw[0]}x{hw[1]} px"


def resolution_markdown(evaluations: list[Evaluation], rows: list[str], overlaps: list[int], img_size: int,
                        command: str, named_runs: bool = False) -> str:
    """The table: a row per table row, its accuracies the median [min–max] over its seeds; or, with
    ``named_runs``, a row per run of ``--runs`` with its seed."""
    small = "/".join(_size(hw) for hw in sorted({tuple(e.trained_hw) for e in evaluations}))
    heads = {
        TRAINED: f"test at {small} (trained there)",
        UPSAMPLED: f"its test images upsampled to {img_size} px",
        WHOLE: f"whole, {img_size} px test set",
        **{tiled_column(overlap): f"tiled, {overlap} px overlap" for overlap in overlaps},
        MOST_CONFIDENT: f"most confident tile, {max(overlaps)} px overlap",
        SECOND_STAGE: f"second stage (trained on at {img_size} px)",
    }
    keys = columns(overlaps)
    per_row = "one run per row" if named_runs else "median [min–max] over seeds"
    lines = [
        f"Test accuracy at {img_size} px of models trained at {small}, {per_row}; "
        f"the {img_size} px test set is the dataset's test split at {img_size} px (a generated dataset drawn "
        f"at that size, a dataset of files the upsampled images).",
        "",
        f"Command: `{command}`",
        "",
        ("| run | seed | " if named_runs else "| attention | seeds | ") + " | ".join(heads[key] for key in keys) + " |",
        "|---|---:|" + "---:|" * len(keys),
    ]
    for row in rows:
        mine = [evaluation for evaluation in evaluations if evaluation.row == row]
        cells = [_cell([e.accuracy.get(key) for e in mine], any(key in e.errors for e in mine)) for key in keys]
        seeds = mine[0].seed if named_runs else len(mine)
        lines.append(f"| {row} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_resolution(output: Path, text: str, evaluations: list[Evaluation], img_size: int, command: str) -> None:
    """The markdown table, and every run with each column's seconds as JSON beside it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    output.with_suffix(".json").write_text(json.dumps(
        {"command": command, "img_size": img_size, "runs": [evaluation.__dict__ for evaluation in evaluations]},
        indent=1,
    ))
