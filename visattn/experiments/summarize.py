"""What finished runs left: a grid's run's summary and per-epoch records, the epochs it spent at chance, an
accuracy table's row summed up over its seeds, and a finished run read with what it was trained with (config
and normalization)."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visattn.experiments.plan import Row, Run
from visattn.predict import MODEL_FILE, read_model_file, recorded_data_config
from visattn.train import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, TrainConfig, make_config, read_yaml


def read_run(run: Run) -> None:
    """Fill ``run.summary``, ``run.history`` and ``run.num_classes`` from its run directory (status "finished")."""
    run.summary = json.loads((run.run_dir / SUMMARY_FILE).read_text())
    run.history = read_records(run.run_dir / METRICS_FILE)
    has_model_file = (run.run_dir / MODEL_FILE).is_file()
    run.num_classes = read_model_file(run.run_dir)["kwargs"]["num_classes"] if has_model_file else None
    run.status = "finished"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a run's metrics file (none where there is no such file)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def chance_threshold(num_classes: int, samples: int) -> float:
    """The accuracy on ``samples`` images below which a model is not told from guessing among ``num_classes``.

    A model that has learnt nothing answers independently of an image's class, so on balanced classes each
    answer is right with probability p = 1/C. Taken as independent guesses, its right answers over n images
    are Binomial(n, p), and its accuracy has mean p and standard error sqrt(p (1 - p) / n) (a constant answer
    on exactly balanced classes varies less). The threshold is p + 3 standard errors,
    ``1/C + 3 sqrt((1/C)(1 - 1/C) / n)``, which such a model reaches in about 0.1% of evaluations (normal
    approximation): 0.1 + 3 sqrt(0.09 / 1000) = 0.1285 for 10 classes and 1,000 images.
    """
    p = 1 / num_classes
    return p + 3 * math.sqrt(p * (1 - p) / samples)


def epochs_at_chance(history: list[dict[str, Any]], num_classes: int) -> int:
    """The number of leading epochs of ``history`` whose accuracy on the split evaluated every epoch
    (validation, else test) is below :func:`chance_threshold` for that split's size."""
    split = "val" if "val_acc" in history[0] else "test"
    count = 0
    for record in history:
        if record[f"{split}_acc"] >= chance_threshold(num_classes, record[f"{split}_samples"]):
            break
        count += 1
    return count


def run_epochs_at_chance(run: Run) -> int | None:
    """:func:`epochs_at_chance` of the first stage of ``run`` (or of ``run``, without a curriculum); None until
    that stage has finished with per-epoch records and its model's class count."""
    first = (run.earlier or [run])[0]
    if first.status != "finished" or not first.history or first.num_classes is None:
        return None
    return epochs_at_chance(first.history, first.num_classes)


def epoch_time(record: dict[str, Any]) -> float:
    """The seconds of one epoch record, a fine-tune's or an attention transfer's: its training plus the evaluation
    that ends it (validation, or the transfer's held-out loss; ``eval_time_s``, where recorded): start-up, data
    preparation and test evaluations are not counted. The accuracy table's seconds per epoch and the transfer
    table's costs; the accuracy table's seconds of all stages are wall time (:func:`all_stages_seconds`)."""
    return record["train_time_s"] + record.get("eval_time_s", 0.0)


def all_stages_seconds(run: Run) -> float | None:
    """The wall time train.py recorded for ``run`` and each of its earlier stages, summed (None until each has
    finished): what a user waits for the run, start-up and data preparation included."""
    stages = [*run.earlier, run]
    if any(stage.summary is None for stage in stages):
        return None
    return sum(stage.summary["wall_time_s"] for stage in stages)


@dataclass(frozen=True)
class RowResult:
    """A row's runs summed up over its seeds."""

    row: Row
    seeds: int  # runs asked for
    accs: list[float]  # test accuracy of each finished run
    chance_epochs: list[int]  # epochs at chance of each finished run's first stage, where known
    all_stages_s: float | None  # median over the finished runs of their seconds for all stages together
    images_per_s: float | None
    epoch_s: float | None
    peak_mem_mib: float | None
    status: str  # "yes", "no: out of memory", "failed", "not run yet"
    mixed_devices: bool = False  # its finished seeds ran on different kinds of device: no median of time or memory
    mem_kind: str | None = None  # the one kind of device its finished seeds ran on, as their summaries name it

    @property
    def count(self) -> int:
        return len(self.accs)


def epoch_seconds(history: list[dict[str, Any]]) -> float | None:
    """Median seconds per epoch (:func:`epoch_time`)."""
    times = [epoch_time(record) for record in history]
    return statistics.median(times) if times else None


def median_of_known(values: list[float | None]) -> float | None:
    """The median of the values that are not None (None if there is none)."""
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


# The kind of device a run trained on, by the memory its summary names ("mem_kind").
DEVICE_WORDS = {"cuda_allocated": "GPU", "cpu_peak_rss": "CPU"}


def device_kinds(runs: list[Run]) -> set[str | None]:
    """The kinds of device the runs and their earlier stages were measured on, as their summaries name their
    memory ("cuda_allocated", "cpu_peak_rss"; None where a summary does not say)."""
    return {stage.summary.get("mem_kind") for run in runs for stage in (*run.earlier, run) if stage.summary}


def summarize_row(row: Row, runs: list[Run]) -> RowResult:
    finished = [run for run in runs if run.status == "finished"]
    statuses = {run.status for run in runs}
    if "out of memory" in statuses:
        status = "no: out of memory"
    elif "failed" in statuses:
        status = "failed"
    else:
        status = "yes" if finished else "not run yet"
    # A GPU's seconds and memory and a CPU's have no common median: none where the seeds ran on both.
    kinds = device_kinds(finished)
    timed = finished if len(kinds) == 1 and None not in kinds else []
    return RowResult(
        row=row, seeds=len(runs), accs=[run.summary["test_acc"] for run in finished],
        chance_epochs=[epochs for epochs in map(run_epochs_at_chance, finished) if epochs is not None],
        all_stages_s=median_of_known([all_stages_seconds(run) for run in timed]),
        images_per_s=median_of_known([run.summary["images_per_s"] for run in timed]),
        epoch_s=median_of_known([epoch_seconds(run.history) for run in timed]),
        peak_mem_mib=median_of_known([run.summary["peak_mem_mib"] for run in timed]),
        status=status, mixed_devices=bool(finished) and not timed, mem_kind=next(iter(kinds)) if timed else None,
    )


def summarize_rows(rows: list[Row], runs: list[Run]) -> list[RowResult]:
    return [summarize_row(row, [run for run in runs if run.row == row]) for row in rows]


@dataclass
class FinishedRun:
    """A finished training run: what it was trained with and what it reported."""

    row: str
    seed: int
    run_dir: Path
    config: TrainConfig
    summary: dict[str, Any]
    mean: tuple[float, ...]  # the normalization it was trained with
    std: tuple[float, ...]
    second_stage: Path | None = None  # the same model trained on at the larger size, if it was

    @property
    def weights(self) -> str:
        """The weights its run reported: chosen on validation, or the last epoch's where there was none."""
        return "last" if self.summary.get("selected_on") == "test" else "best"


def started_from(config: TrainConfig) -> Path | None:
    """The run directory whose weights ``config`` starts from: the one its ``initial_checkpoint`` names, or the
    nearest above the weights file it names (a run's best weights, a checkpoint's), kept or since deleted (a run
    copied without its weights is still the run it was started from); None for fresh or published weights, a
    file outside any run, or a run folder that is not there (any more)."""
    if config.initial_checkpoint is None:
        return None
    start = Path(config.initial_checkpoint)
    folders = [start] if start.is_dir() else start.parents
    return next((folder for folder in folders if (folder / CONFIG_FILE).is_file()), None)


def read_finished(row: str, seed: int, run_dir: Path) -> FinishedRun:
    """The finished run in ``run_dir``; ValueError (one line naming the file) for one that is not."""
    for name in (CONFIG_FILE, SUMMARY_FILE):
        if not (run_dir / name).is_file():
            raise ValueError(f"{run_dir / name} does not exist: not a finished training run")
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        test_acc = summary["test_acc"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{run_dir / SUMMARY_FILE}: not a summary written by train.py (no test_acc)") from None
    if not isinstance(test_acc, (int, float)):
        raise ValueError(f"{run_dir / SUMMARY_FILE}: test_acc is {test_acc!r}, not a number")
    data_config = recorded_data_config(read_model_file(run_dir))
    return FinishedRun(row, seed, run_dir, make_config(read_yaml(run_dir / CONFIG_FILE)), summary,
                       data_config["mean"], data_config["std"])
