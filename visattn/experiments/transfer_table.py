"""The attention-transfer table: what each run reached after each stage (converted, transferred, each fine-tune
epoch) with the training it took since its parent's weights, the parents' and the from-scratch runs' own, every
row's lines summed up over the seeds, and the table as markdown with every run and stage as JSON and CSV."""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from visattn.experiments.plan import Row, Run, expected_config
from visattn.experiments.report import median_range
from visattn.experiments.summarize import (
    DEVICE_WORDS, FinishedRun, epoch_time, median_of_known, read_records, started_from,
)
from visattn.train import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, TRANSFER_METRICS_FILE, TrainConfig, make_config, read_yaml

CONVERTED = "converted"
TRANSFER = "transfer"
# train.py flags of a row of the transfer arm whose transfer also trains the attention's qkv, proj and norms.
PROJECTIONS = ("--transfer-projections",)


def epoch_stage(epoch: int) -> str:
    return f"epoch {epoch}"


def epochs_words(count: int) -> str:
    return f"{count} epoch{'s' if count != 1 else ''}"


class UncountableRecords(ValueError):
    """A run's epoch records without the images they trained on (one line naming the file)."""


def training_cost(records: list[dict[str, Any]], source: Path) -> tuple[int, float]:
    """(images trained on, seconds: :func:`~visattn.experiments.summarize.epoch_time`) of the epoch records read
    from ``source``; :class:`UncountableRecords` for a record without its images: a transfer epoch's written before
    train.py counted them."""
    missing = next((number for number, record in enumerate(records, start=1) if "train_images" not in record), None)
    if missing is not None:
        raise UncountableRecords(f"{source}: record {missing} has no train_images (written before train.py counted "
                                 f"them); accepted: the records of a run trained since: train {source.parent} again")
    return sum(record["train_images"] for record in records), sum(map(epoch_time, records))


@dataclass(frozen=True)
class Point:
    """A run's test accuracy after one stage (None where the run did not record it), and the training images
    and seconds since its first weights up to the end of that stage, with the kind of device those seconds were
    measured on ("GPU", "CPU"; None where unknown, or where the stages counted ran on different kinds)."""

    stage: str  # CONVERTED, TRANSFER or epoch_stage(k)
    acc: float | None
    images: int
    seconds: float
    device: str | None


def device_of(summaries: list[dict[str, Any]]) -> str | None:
    """The one kind of device runs trained on, by their summaries' ``mem_kind`` (None if they differ, or one
    does not say)."""
    kinds = {DEVICE_WORDS.get(summary.get("mem_kind")) for summary in summaries}
    return kinds.pop() if len(kinds) == 1 else None


def run_points(run: Run, finetune_epochs: list[int]) -> list[Point]:
    """The stages of a finished run of the table: converted, transferred (a run with a transfer stage), and
    the end of each epoch of ``finetune_epochs``, from its summary and per-epoch records."""
    transfer = read_records(run.run_dir / TRANSFER_METRICS_FILE)
    images, seconds = training_cost(transfer, run.run_dir / TRANSFER_METRICS_FILE)
    device = device_of([run.summary])
    points = [Point(CONVERTED, run.summary.get("initial_test_acc"), 0, 0.0, device)]
    if transfer:
        points.append(Point(TRANSFER, run.summary.get("transfer_test_acc"), images, seconds, device))
    for epoch in finetune_epochs:
        more_images, more_seconds = training_cost(run.history[:epoch], run.run_dir / METRICS_FILE)
        acc = run.history[epoch - 1].get("test_acc") if len(run.history) >= epoch else None
        points.append(Point(epoch_stage(epoch), acc, images + more_images, seconds + more_seconds, device))
    return points


def lineage(run_dir: Path) -> list[Path]:
    """``run_dir`` and the runs whose weights it started from (:func:`~visattn.experiments.summarize.started_from`:
    a curriculum's earlier stages), first to last."""
    runs = [run_dir]
    while True:
        start = started_from(make_config(read_yaml(runs[0] / CONFIG_FILE)))
        if start is None or start.resolve() in {run.resolve() for run in runs}:
            return runs
        runs.insert(0, start)


def lineage_cost(run_dir: Path) -> tuple[int, float]:
    """(images, seconds) of :func:`training_cost` over a finished run and the runs it started from."""
    costs = [training_cost(read_records(run / name), run / name) for run in lineage(run_dir)
             for name in (TRANSFER_METRICS_FILE, METRICS_FILE)]
    return sum(images for images, _ in costs), sum(seconds for _, seconds in costs)


def lineage_point(stage: str, run: FinishedRun) -> Point:
    """A finished run's reported accuracy and its training over all its stages (:func:`lineage_cost`), on the
    kind of device they all ran on (None where they ran on different kinds)."""
    device = device_of([read_summary(folder) for folder in lineage(run.run_dir)])
    return Point(stage, run.summary["test_acc"], *lineage_cost(run.run_dir), device)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary.json (empty where it has none)."""
    path = run_dir / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def recipe_words(run_dir: Path) -> str:
    """How a run and the runs it started from were trained: "4 epochs at 64×64 px, then 4 epochs at 128×128 px"."""
    configs = [make_config(read_yaml(run / CONFIG_FILE)) for run in lineage(run_dir)]
    return ", then ".join(f"{epochs_words(config.epochs)} at {config.image_hw[0]}×{config.image_hw[1]} px"
                          for config in configs)


@dataclass
class TransferTable:
    """Everything a transfer table shows: its rows (as the transfer arm trains them), its runs, the parent of
    each seed and the runs trained from scratch it is compared with."""

    rows: list[Row]  # the transfer arm's: PROJECTIONS as the train flags of a row whose transfer trains them
    transfer_runs: list[Run]
    no_transfer_runs: list[Run]
    parents: dict[int, FinishedRun]  # seed -> the parent its runs start from
    transfer_epochs: int
    finetune_epochs: list[int]
    from_scratch_root: Path | None = None
    scratch_rows: list[Row] = field(default_factory=list)  # one per row, with from_scratch_root
    from_scratch: dict[tuple[str, int], FinishedRun] = field(default_factory=dict)  # (scratch row, seed) -> its run


@dataclass(frozen=True)
class Line:
    """One line of the table: a row's stage summed up over its seeds."""

    attention: str
    stage: str
    accs: list[float]
    deltas: list[float]  # each seed's accuracy minus its parent's
    images: float | None  # medians over the seeds
    seconds: float | None
    device: str | None  # the kind of device its seconds were measured on
    mixed_devices: bool  # its points were measured on different kinds of device (or one unknown): no seconds
    runs: str  # how many of its runs finished, and where a failed one's log is


def line_of(attention: str, stage: str, points: list[Point], deltas: list[float], runs: str) -> Line:
    """A line of ``points``' accuracies and the medians of their cost; a GPU's seconds and a CPU's have no
    median: none where the points were measured on different kinds of device."""
    devices = {point.device for point in points}
    device = devices.pop() if len(devices) == 1 else None
    return Line(attention, stage, [point.acc for point in points if point.acc is not None], deltas,
                median_of_known([point.images for point in points]),
                median_of_known([point.seconds for point in points]) if device is not None else None, device,
                bool(points) and device is None, runs)


def summed(attention: str, stage: str, points: list[tuple[int, Point]], parents: dict[int, FinishedRun],
           runs: str) -> Line:
    """A line from (seed, point) pairs of its finished runs, each seed compared with its own parent."""
    deltas = [point.acc - parents[seed].summary["test_acc"] for seed, point in points if point.acc is not None]
    return line_of(attention, stage, [point for _, point in points], deltas, runs)


def runs_cell(runs: list[Run]) -> str:
    """"2 of 3 finished; 1 failed (see `its log`)"."""
    finished = sum(run.status == "finished" for run in runs)
    words = [f"{finished} of {len(runs)} finished"]
    for status in ("out of memory", "failed"):
        failed = [run for run in runs if run.status == status]
        if failed:
            words.append(f"{len(failed)} {status} (see `{failed[0].failed_log}`)")
    return "; ".join(words)


def stage_points(runs: list[Run], stage: str, finetune_epochs: list[int]) -> list[tuple[int, Point]]:
    return [(run.seed, point) for run in runs if run.status == "finished"
            for point in run_points(run, finetune_epochs) if point.stage == stage]


def parent_line(table: TransferTable) -> Line:
    parents = list({parent.run_dir.resolve(): parent for parent in table.parents.values()}.values())
    first = parents[0]
    return line_of(f"parent ({first.config.attn})", f"trained: {recipe_words(first.run_dir)}",
                   [lineage_point("trained", parent) for parent in parents], [], f"{len(parents)} finished")


def row_lines(table: TransferTable, row: Row) -> list[Line]:
    """A row's lines: converted, transferred, each fine-tune epoch after the transfer and without it, and
    from scratch where a run root of those is given."""
    mine = [run for run in table.transfer_runs if run.row == row]
    without = [run for run in table.no_transfer_runs if run.row.text == row.text]
    last = max(table.finetune_epochs)
    projections = " (qkv, proj and norms too)" if row.train_flags == PROJECTIONS else ""
    stages = [(CONVERTED, "converted, no training"),
              (TRANSFER, f"attention transfer, {epochs_words(table.transfer_epochs)}{projections}"),
              *((epoch_stage(k), f"transfer + fine-tune epoch {k} of {last}") for k in table.finetune_epochs)]
    lines = [summed(row.label, label, stage_points(mine, stage, table.finetune_epochs), table.parents, runs_cell(mine))
             for stage, label in stages]
    lines += [summed(row.label, f"fine-tune without transfer, epoch {k} of {last}",
                     stage_points(without, epoch_stage(k), table.finetune_epochs), table.parents, runs_cell(without))
              for k in table.finetune_epochs]
    if table.from_scratch_root is not None:
        lines.append(scratch_line(table, row))
    return lines


def scratch_line(table: TransferTable, row: Row) -> Line:
    scratch = table.scratch_rows[table.rows.index(row)]
    found = [(seed, table.from_scratch[(scratch.text, seed)]) for seed in table.parents
             if (scratch.text, seed) in table.from_scratch]
    points = [(seed, lineage_point("from scratch", run)) for seed, run in found]
    return summed(row.label, f"from scratch: {scratch.label}, its recipe", points, table.parents,
                  f"{len(found)} of {len(table.parents)} in `{table.from_scratch_root / scratch.folder}`")


def table_lines(table: TransferTable) -> list[Line]:
    return [parent_line(table), *(line for row in table.rows for line in row_lines(table, row))]


def accuracy_cell(accs: list[float]) -> str:
    return f"{median_range(accs)} ({len(accs)})" if accs else "—"


def points_cell(deltas: list[float]) -> str:
    """Differences in accuracy, in points: the median, and with more than one value their range."""
    if not deltas:
        return "—"
    median = f"{100 * statistics.median(deltas):+.2f}"
    return median if len(deltas) == 1 else f"{median} [{100 * min(deltas):+.2f}–{100 * max(deltas):+.2f}]"


def count_cell(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def seconds_cell(line: Line, named: bool) -> str:
    """A line's seconds, followed by its kind of device where ``named`` (a table whose lines ran on several)."""
    cell = count_cell(line.seconds, 1)
    return f"{cell} ({line.device})" if named and line.seconds is not None and line.device else cell


def transfer_markdown(table: TransferTable, command: str) -> str:
    lines = [
        "| attention | stage | test accuracy, median [min–max] (seeds) | vs its parent, points | training images | "
        "training s | runs |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    table_rows = table_lines(table)
    devices = {line.device for line in table_rows if line.seconds is not None}
    for line in table_rows:
        lines.append(f"| {line.attention} | {line.stage} | {accuracy_cell(line.accs)} | {points_cell(line.deltas)} | "
                     f"{count_cell(line.images)} | {seconds_cell(line, len(devices) > 1)} | {line.runs} |")
    return "\n".join(lines) + "\n\n" + note(table, command, table_rows) + "\n"


def size_words(config: TrainConfig) -> str:
    """"128×128 px (32×32 grid, 1,024 tokens)"."""
    rows_, cols_ = (side // config.patch_size for side in config.image_hw)
    return f"{config.image_hw[0]}×{config.image_hw[1]} px ({rows_}×{cols_} grid, {rows_ * cols_:,} tokens)"


def note(table: TransferTable, command: str, lines: list[Line]) -> str:
    last = max(table.finetune_epochs)
    runs_config = expected_config(table.transfer_runs[0].argv)
    parent_config = next(iter(table.parents.values())).config
    where = f"at {size_words(runs_config)}"
    if parent_config.image_hw != runs_config.image_hw:
        where += (f", each parent trained at {size_words(parent_config)} (its accuracy at that size; a softmax row "
                  "gives it at the runs' size)")
    return " ".join([
        f"`{command}`: {runs_config.dataset} {where}; seeds {', '.join(map(str, table.parents))}.",
        f"Each run starts from its seed's parent's best weights, converted to the row's attention; with transfer, "
        f"{epochs_words(table.transfer_epochs)} of attention transfer, then in both arms {epochs_words(last)} of "
        f"fine-tuning {'with low-rank adapters (below)' if runs_config.lora_rank else 'the whole model'} with the "
        "parent's recipe (and the flags after --), the test split evaluated after every epoch (train.py "
        "--test-every-epoch).",
        *([f"Epoch k of {last} is epoch k of one {last}-epoch schedule, not a k-epoch fine-tune of its own (whose "
           "learning rate would have decayed by then): every k is of the same run, and each run costs one transfer "
           f"and {epochs_words(last)}."] if len(table.finetune_epochs) > 1 else []),
        "Test accuracy after conversion, transfer and each epoch: of the model as it stands (not chosen on "
        "validation); of the parents and the runs from scratch: of the weights their runs reported (chosen on "
        "validation). vs its parent: each seed's accuracy minus its own parent's, in points (median [min–max]).",
        "Training images and seconds (medians over the seeds): since the parent's weights, cumulative over the "
        "stages (a transfer image passes through the parent and the converted layers); of the parents and the runs "
        "from scratch, all their stages (the runs they started from included). From the runs' records: training "
        "plus the validation (or the transfer's held-out loss) at the end of each epoch; start-up, data preparation "
        "and test evaluations not counted (the accuracy tables' seconds of all stages are each stage's wall time, "
        "these included).",
        *(["Seconds are each line's on the kind of device its runs trained on, named beside them: a GPU's and a "
           "CPU's are not compared."] if len({line.device for line in lines if line.seconds is not None}) > 1 else []),
        *(["Seconds read — in a line whose seeds (or a run's stages) trained on different kinds of device, or where "
           "one did not record its device."]
          if any(line.mixed_devices for line in lines) else []),
        "Transfer trains the parameters each type adds to the parent's qkv, proj and norms; a transfer stage marked "
        f"\"qkv, proj and norms too\" trains those as well (--transfer-projections: a type that adds none"
        f"{' and has no adapters' if runs_config.lora_rank else ''}, or every row where the command asks for it).",
        *([f"Low-rank adapters (lora_rank {runs_config.lora_rank}) on every qkv and proj: the transfer trains them "
           "too, and the fine-tune trains only them, the attention's own parameters and the head, the parent's other "
           "weights frozen."] if runs_config.lora_rank else []),
        f"From scratch: the runs of the same type in `{table.from_scratch_root}` (an accuracy table's run root)."
        if table.from_scratch_root is not None else
        "From scratch: not shown (--from-scratch-root names an accuracy table's run root of the same types).",
    ])


CSV_FIELDS = ("arm", "row", "attn", "options", "seed", "stage", "test_acc", "parent_test_acc", "images", "seconds",
              "device", "status", "run_dir")


def stage_records(table: TransferTable) -> list[dict[str, Any]]:
    """Every parent, run and run from scratch, one record per stage it reached (a run that did not finish:
    one record without a stage)."""
    records = []
    for seed, parent in table.parents.items():
        point = lineage_point("trained", parent)
        records.append(dict(arm="parent", row=parent.config.attn, attn=parent.config.attn,
                            options=parent.config.attn_kwargs, seed=seed, stage=point.stage, test_acc=point.acc,
                            images=point.images, seconds=point.seconds, device=point.device, status="finished",
                            run_dir=str(parent.run_dir)))
    for arm, runs in (("transfer", table.transfer_runs), ("no-transfer", table.no_transfer_runs)):
        for run in runs:
            common = dict(arm=arm, row=run.row.text, attn=run.row.attn, options=run.row.options, seed=run.seed,
                          status=run.status, run_dir=str(run.run_dir))
            points = run_points(run, table.finetune_epochs) if run.status == "finished" else []
            records += [{**common, "stage": point.stage, "test_acc": point.acc, "images": point.images,
                         "seconds": point.seconds, "device": point.device} for point in points] or [
                {**common, "stage": None, "test_acc": None, "images": None, "seconds": None, "device": None}]
    for (text, seed), run in table.from_scratch.items():
        point = lineage_point("trained", run)
        records.append(dict(arm="from-scratch", row=text, attn=run.config.attn, options=run.config.attn_kwargs,
                            seed=seed, stage=point.stage, test_acc=point.acc, images=point.images,
                            seconds=point.seconds, device=point.device, status="finished", run_dir=str(run.run_dir)))
    for record in records:
        record["parent_test_acc"] = table.parents[record["seed"]].summary["test_acc"]
    return records


def write_transfer(output: Path, table: TransferTable, command: str) -> str:
    """The markdown table, and beside it every stage of every run as JSON (with the table's lines and each
    run's per-epoch records) and CSV; returns the table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    text = transfer_markdown(table, command)
    output.write_text(text)
    records = stage_records(table)
    histories = [dict(arm=arm, row=run.row.text, seed=run.seed, run_dir=str(run.run_dir), summary=run.summary,
                      history=run.history, transfer_history=read_records(run.run_dir / TRANSFER_METRICS_FILE))
                 for arm, runs in (("transfer", table.transfer_runs), ("no-transfer", table.no_transfer_runs))
                 for run in runs if run.status == "finished"]
    output.with_suffix(".json").write_text(json.dumps(
        {"command": command, "lines": [asdict(line) for line in table_lines(table)], "stages": records,
         "runs": histories}, indent=1))
    with open(output.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({**record, "options": json.dumps(record["options"])} for record in records)
    return text
