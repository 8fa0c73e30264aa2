"""Models trained at a small image size, tested at a larger one: whole at that size, and tiled.

    python scripts/resolution_table.py --run-root runs/table-cluttered-curriculum --img-size 128 \\
        --attn timm softmax linear linear:rope=null --overlap 0 32 --output resolution.md

The runs are the first stages of a curriculum table with one earlier stage (``scripts/accuracy_table.py
--stage`` given once; a root with a second earlier stage, ``seed<k>-stage2`` of ``--stage`` given twice, is
refused):
``<run-root>/<row>/seed<k>-stage1``, each trained at the first stage's size, and finished. Each model is
tested at ``--img-size`` (square) without any training, its inputs normalized as it was trained (the mean
and std its run recorded), with the weights its run reported (``best``, or ``last`` where it chose them on
test):

- **upsampled**: its own test images resized to ``--img-size`` as evaluation resizes them (bicubic), the
  model built at that size: its position embedding resampled to the larger grid (timm's
  ``checkpoint_filter_fn``, bicubic), rotary angles (``rope``) taken from the larger grid as always. The
  same images on a larger grid: this compares rope with the interpolated absolute embedding.
- **whole**: the same model on the test split drawn at ``--img-size`` (its config with only the image size
  changed): for a generated dataset the images its generator draws at that size (cluttered digits: larger
  canvases, the digits at the size they were trained at; pathfinder: the same kind of scene at a larger scale,
  strokes and markers included) and, for a curriculum table, the images its second stage was tested on. For a
  dataset of files, the upsampled images again.
- **tiled**: ``visattn.tiled.TiledViT`` over those images, with tiles of the size the model was trained at,
  overlapping by each ``--overlap`` (pixels), merged with ``--merge`` and pooled by the model's own head:
  what a user does with a model that exists only at the small size.
- **most confident tile**: the same tiles (the largest overlap), each classified alone, and each image given
  the class of its tile with the highest probability: the vote for an object that fills one tile.

Beside them, from the runs' ``summary.json``: the test accuracy at the size the model was trained at, and that
of its second stage (``seed<k>``, the same model trained on at ``--img-size``) where there is one. Accuracies
are the median over ``--seeds`` with their range (``--runs``, below: one run per row). A column that cannot be
tested for a run (a model that cannot be built at the larger size) is one line on stderr, ``error`` in its
cell and the reason in the JSON, and the exit status is 1; a run that is missing or unfinished, or a size its
tiles cannot take, stops the script before anything is tested, with one line, exit status 2. Writes the
markdown table (``--output``) and the same as JSON, with each column's seconds (the forward passes over the
test split).

Runs trained outside a table are named instead of a run root: ``--runs FIRST[:SECOND] ...``, one row per run
(named by FIRST's path, with the seed it was trained with), FIRST tested as above and SECOND, if given, a
finished run at ``--img-size`` of the same model and data that started from FIRST's weights
(``--initial-checkpoint``), for the last column:

    python scripts/resolution_table.py --runs runs/pf64-easy-softmax:runs/pf128-easy-softmax --img-size 128 \\
        --overlap 0 32 --output pathfinder-resolution.md
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from timm.data import create_transform
from torch.utils.data import DataLoader, TensorDataset

from visattn.predict import load_trained_model
from visattn.predict.run_dir import read_model_file, recorded_data_config
from visattn.tiled import MERGES, TiledViT
from visattn.tiled.functional import cut_tiles, model_tile
from visattn.tiled.layout import tile_layout
from visattn.train.build import default_cpu_threads
from visattn.train.config import ConfigError, TrainConfig, make_config, read_yaml
from visattn.train.data import eval_data_config, load_splits, without_images
from visattn.train.datasets import DataError
from visattn.train.rundir import CONFIG_FILE
from visattn.train.run_log import SUMMARY_FILE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_table import Row, parse_rows, run_folder  # noqa: E402  (rows and folders as the table names them)

TRAINED = "trained size"
UPSAMPLED = "upsampled"
WHOLE = "whole"
MOST_CONFIDENT = "most confident tile"
SECOND_STAGE = "second stage"


def tiled_column(overlap: int) -> str:
    return f"tiled, overlap {overlap} px"


def columns(overlaps: list[int]) -> list[str]:
    return [TRAINED, UPSAMPLED, WHOLE, *(tiled_column(overlap) for overlap in overlaps), MOST_CONFIDENT, SECOND_STAGE]


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


@dataclass
class Evaluation:
    """One first stage tested at the larger size."""

    row: str
    seed: int
    run_dir: str
    trained_hw: tuple[int, int]
    accuracy: dict[str, float | None] = field(default_factory=dict)  # a column -> test accuracy (None: no such run)
    seconds: dict[str, float] = field(default_factory=dict)  # a column tested here -> seconds of its forward passes
    errors: dict[str, str] = field(default_factory=dict)  # a column that could not be tested -> why


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-root", help="a curriculum table's run root: <run-root>/<row>/seed<k>-stage1")
    parser.add_argument("--attn", nargs="+", metavar="ROW", help="rows, as scripts/accuracy_table.py takes them (with --run-root)")
    parser.add_argument("--seeds", nargs="+", type=int, help="the seeds of the runs (with --run-root; default: 0)")
    parser.add_argument("--runs", nargs="+", type=run_pair, metavar="FIRST[:SECOND]",
                        help="instead of --run-root and --attn: finished runs, one row each, and the runs that "
                             "trained them on at --img-size")
    parser.add_argument("--img-size", type=int, required=True, metavar="PX", help="the larger (square) image size to test at")
    parser.add_argument("--overlap", nargs="+", type=int, default=[0], metavar="PX",
                        help="overlaps of neighbouring tiles in pixels, one tiled column each (default: 0)")
    parser.add_argument("--merge", choices=MERGES, default="crop", help="how overlapping tiles are merged")
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass")
    parser.add_argument("--output", default="resolution_table.md", help="the markdown table; .json beside it")
    args = parser.parse_args(argv)
    if args.runs is not None:
        for flag, value, why in (("--run-root", args.run_root, "give one or the other"),
                                 ("--attn", args.attn, "give one or the other"),
                                 ("--seeds", args.seeds, "each run has the seed it was trained with")):
            if value is not None:
                parser.error(f"{flag}: not with --runs ({why})")
        named: dict[Path, Path] = {}  # a run's resolved folder -> the spelling first given
        for folder in [first for first, _ in args.runs] + [second for _, second in args.runs if second is not None]:
            same = named.setdefault(folder.resolve(), folder)
            if same is not folder:
                parser.error(f"--runs: {same} and {folder} name the same run; accepted: each run once, as a FIRST "
                             f"or as a SECOND")
    elif args.run_root is None or args.attn is None:
        parser.error("either --run-root with --attn, or --runs")
    else:
        try:
            args.rows = parse_rows(args.attn)
        except ValueError as error:
            parser.error(f"--attn: {error}")
        args.seeds = [0] if args.seeds is None else args.seeds
    for flag, value in (("--img-size", args.img_size), ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag}: must be >= 1, got {value}")
    if min(args.overlap) < 0:
        parser.error(f"--overlap: pixels >= 0, got {min(args.overlap)}")
    for flag, values in (("--overlap", args.overlap), ("--seeds", args.seeds or [])):
        if len(set(values)) != len(values):
            parser.error(f"{flag}: each value once, got {' '.join(map(str, values))}")
    if not args.output.endswith(".md"):
        parser.error(f"--output: a markdown file name ending in .md, got {args.output!r}")
    return args


def run_pair(word: str) -> tuple[Path, Path | None]:
    """``FIRST[:SECOND]`` -> (FIRST, SECOND or None)."""
    parts = word.split(":")
    if len(parts) > 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"a run folder, or two joined by one ':' (FIRST:SECOND), got {word!r}")
    return Path(parts[0]), Path(parts[1]) if len(parts) == 2 else None


def read_run(row: str, seed: int, run_dir: Path) -> FinishedRun:
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


def check_sizes(stage: FinishedRun, img_size: int, overlaps: list[int]) -> None:
    """ValueError, naming the flag, for a size or an overlap the tiles of ``stage``'s model cannot take."""
    trained, patch = stage.config.image_hw, stage.config.patch_size
    if img_size < max(trained) or img_size % patch:
        raise ValueError(f"--img-size: must be a multiple of the patch size ({patch} px) and at least the size "
                         f"{stage.run_dir} was trained at ({trained[0]}x{trained[1]} px), got {img_size}")
    for overlap in overlaps:
        try:
            tile_layout((img_size, img_size), trained, overlap, (patch, patch))
        except ValueError as error:
            raise ValueError(f"--overlap: {error} (tiles of {stage.run_dir}'s {trained[0]}x{trained[1]} px)") from None


def split_images(stage: FinishedRun, drawn_hw: tuple[int, int], img_size: int, cache: dict[str, TensorDataset]) -> TensorDataset:
    """The test split of ``stage``'s dataset (a generated one drawn at ``drawn_hw``) as train.py's evaluation
    transforms it to ``img_size`` pixels, normalized with ``stage``'s own mean and std, without the files
    its run left out; transformed once and kept in ``cache`` for every run of the same data."""
    drawn = replace(stage.config, img_size=list(drawn_hw))
    skipped = stage.summary.get("skipped_image_files") or []
    key = json.dumps([drawn.dataset, drawn.dataset_kwargs, drawn.data_dir, drawn.eval_fraction, drawn.max_eval_samples,
                      drawn_hw, img_size, stage.mean, stage.std, sorted(skipped)], default=str)
    if key not in cache:
        splits = load_splits(drawn)
        if skipped:
            splits = without_images(splits, set(skipped))
        data_config = {**eval_data_config(replace(drawn, img_size=img_size), splits), "mean": stage.mean, "std": stage.std}
        transform = create_transform(is_training=False, **data_config)
        images, labels = zip(*((transform(image), label) for image, label in splits.eval))
        cache[key] = TensorDataset(torch.stack(images), torch.tensor(labels))
    return cache[key]


class MostConfidentTile(nn.Module):
    """Classifies every tile of the size ``model`` was built at alone; an image takes the class of the tile
    whose top probability is the highest. (B, C, H, W) -> (B, num_classes): that tile's logits."""

    def __init__(self, model: nn.Module, overlap: int) -> None:
        super().__init__()
        self.model, self.overlap = model, overlap

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        layout = tile_layout(tuple(images.shape[-2:]), model_tile(self.model), self.overlap,
                             tuple(self.model.patch_embed.patch_size))
        logits = self.model(cut_tiles(images, layout)).unflatten(0, (len(images), layout.num_tiles))  # (B, tiles, classes)
        best = logits.softmax(dim=-1).amax(dim=-1).argmax(dim=1)  # (B,): the tile with the top probability
        return logits[torch.arange(len(images), device=logits.device), best]


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int) -> float:
    """Top-1 accuracy of ``model`` over the whole of ``dataset``."""
    model.eval()
    correct = 0
    for images, targets in DataLoader(dataset, batch_size=batch_size):
        correct += (model(images).argmax(dim=-1) == targets).sum().item()
    return correct / len(dataset)


def evaluate(stage: FinishedRun, img_size: int, overlaps: list[int], merge: str, batch_size: int,
             cache: dict[str, TensorDataset]) -> Evaluation:
    """Every column of ``stage`` at ``img_size``; a column whose model cannot be built or run is recorded in
    ``errors`` and the others are tested all the same."""
    evaluation = Evaluation(stage.row, stage.seed, str(stage.run_dir), stage.config.image_hw)
    evaluation.accuracy[TRAINED] = stage.summary["test_acc"]

    def attempt(column: str, build: Callable[[], nn.Module], dataset: Callable[[], TensorDataset]) -> None:
        try:
            model, images = build(), dataset()
            start = time.perf_counter()
            evaluation.accuracy[column] = accuracy(model, images, batch_size)
            evaluation.seconds[column] = time.perf_counter() - start
        except (ValueError, RuntimeError, OSError, DataError) as error:
            evaluation.accuracy[column] = None
            evaluation.errors[column] = (str(error).splitlines() or [type(error).__name__])[0]

    # Each model is read once for the columns that share it; one that fails is tried again by each, which
    # then records the error.
    @functools.cache
    def whole() -> nn.Module:
        return load_trained_model(stage.run_dir, stage.weights, img_size=img_size)

    @functools.cache
    def small() -> nn.Module:
        return load_trained_model(stage.run_dir, stage.weights)

    def upsampled() -> TensorDataset:
        return split_images(stage, stage.config.image_hw, img_size, cache)

    def larger() -> TensorDataset:
        return split_images(stage, (img_size, img_size), img_size, cache)

    attempt(UPSAMPLED, whole, upsampled)
    attempt(WHOLE, whole, larger)
    for overlap in overlaps:
        attempt(tiled_column(overlap), lambda: TiledViT(small(), overlap=overlap, merge=merge), larger)
    attempt(MOST_CONFIDENT, lambda: MostConfidentTile(small(), max(overlaps)), larger)
    return evaluation


def first_stage(row_dir: Path, seed: int) -> Path:
    """``<row_dir>/seed<seed>-stage1``; ValueError where the row's curriculum has more than one earlier stage:
    its ``seed<k>`` starts from the last of them, not from ``seed<k>-stage1``, so it is no second stage of it."""
    first = run_folder(seed, 1)
    later: dict[int, str] = {}  # stage number: folder name
    for path in row_dir.glob(f"{run_folder(seed)}-stage*"):
        match = re.fullmatch(rf"{run_folder(seed)}-stage([1-9]\d*)", path.name)  # not the table's logs beside them
        if match and int(match[1]) > 1:
            later[int(match[1])] = path.name
    if later:
        raise ValueError(
            f"--run-root: {row_dir} holds {', '.join(later[number] for number in sorted(later))} beside "
            f"{first}: a curriculum of more than one earlier stage; accepted: a table trained with one --stage"
        )
    return row_dir / first


def table_stages(run_root: Path, rows: list[Row], seeds: list[int]) -> list[FinishedRun]:
    """The first stages of a table's rows and seeds, each with its second stage (``seed<k>`` beside it)."""
    stages = []
    for row in rows:
        for seed in seeds:
            stage = read_run(row.label, seed, first_stage(run_root / row.folder, seed))
            stages.append(replace(stage, second_stage=stage.run_dir.parent / run_folder(seed)))
    return stages


# What a second stage must share with its first: the model and the data, all but the image size.
SAME_IN_BOTH_STAGES = ("model", "attn", "attn_kwargs", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio",
                       "global_pool", "class_token", "model_kwargs", "dataset", "dataset_kwargs")


def _inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or a file under it (both resolved)."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def check_second_stage(first: FinishedRun, second: FinishedRun, img_size: int) -> None:
    """ValueError, one line, unless ``second`` is ``first``'s model trained on at ``img_size``: trained at that
    size with the same model and data, from a checkpoint in ``first``'s folder or, where that checkpoint no
    longer exists (``first`` renamed since), in the folder ``first`` recorded as its ``run_dir``."""
    trained = second.config.image_hw
    if trained != (img_size, img_size):
        raise ValueError(f"--runs: {second.run_dir} was trained at {trained[0]}x{trained[1]} px, not at --img-size "
                         f"{img_size}: not a second stage of {first.run_dir} at that size")
    start = second.config.initial_checkpoint
    recorded = first.config.run_dir
    if start is None or not (_inside(start, first.run_dir) if Path(start).exists()
                             else recorded is not None and _inside(start, recorded)):
        also = f" or the folder it recorded as its run_dir ({recorded})" if recorded else ""
        raise ValueError(f"--runs: {second.run_dir} starts from {start or 'no checkpoint'}, not from {first.run_dir}"
                         f"{also}; accepted: a run trained with --initial-checkpoint {first.run_dir}")
    differ = [name for name in SAME_IN_BOTH_STAGES if getattr(first.config, name) != getattr(second.config, name)]
    if differ:
        raise ValueError(f"--runs: {second.run_dir} differs from {first.run_dir} in {', '.join(differ)}; accepted: "
                         f"the same model and data at another image size")


def named_stages(runs: list[tuple[Path, Path | None]], img_size: int) -> list[FinishedRun]:
    """Each run of ``--runs`` as a row named by its path, with the seed it was trained with and its second
    stage, checked by :func:`check_second_stage`. ValueError, one line naming the run, otherwise."""
    stages = []
    for first, second in runs:
        stage = read_run(str(first), 0, first)
        stage = replace(stage, seed=stage.config.seed, second_stage=second)
        if second is not None:
            try:
                stage_two = read_run(str(first), stage.seed, second)
            except (ValueError, OSError) as error:
                raise ValueError(f"--runs: second stage of {first}: {error}") from None
            check_second_stage(stage, stage_two, img_size)
        stages.append(stage)
    return stages


def second_stage_accuracy(stage: FinishedRun, img_size: int) -> float | None:
    """The test accuracy of ``stage``'s second stage, if it has one that finished at ``img_size``."""
    if stage.second_stage is None:
        return None
    try:
        stage_two = read_run(stage.row, stage.seed, stage.second_stage)
    except (ValueError, ConfigError, OSError):
        return None
    return stage_two.summary["test_acc"] if stage_two.config.image_hw == (img_size, img_size) else None


def _cell(values: list[float | None], failed: bool) -> str:
    if failed:
        return "error"
    values = [value for value in values if value is not None]
    if not values:
        return "–"
    median = 100 * statistics.median(values)
    if len(values) == 1:
        return f"{median:.2f}%"
    return f"{median:.2f}% [{100 * min(values):.2f}–{100 * max(values):.2f}]"


def _size(hw: tuple[int, int]) -> str:
    return f"{hw[0]} px" if hw[0] == hw[1] else f"{hw[0]}x{hw[1]} px"


def markdown(evaluations: list[Evaluation], rows: list[str], overlaps: list[int], img_size: int, command: str,
             named_runs: bool = False) -> str:
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/resolution_table.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.runs is None:
            stages = table_stages(Path(args.run_root), args.rows, args.seeds)
        else:
            stages = named_stages(args.runs, args.img_size)
        for stage in stages:
            check_sizes(stage, args.img_size, args.overlap)
    except (ValueError, ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cache: dict[str, TensorDataset] = {}
    evaluations = []
    for stage in stages:
        evaluation = evaluate(stage, args.img_size, args.overlap, args.merge, args.batch_size, cache)
        evaluations.append(evaluation)
        shown = ", ".join(f"{key} {100 * value:.2f}%" for key, value in evaluation.accuracy.items() if value is not None)
        print(f"{stage.row} seed {stage.seed}: {shown}", flush=True)
        for column, reason in evaluation.errors.items():
            print(f"error: {stage.row} seed {stage.seed}, {column}: {reason}", file=sys.stderr, flush=True)
    for stage, evaluation in zip(stages, evaluations):  # read last: a table's second stage may finish meanwhile
        evaluation.accuracy[SECOND_STAGE] = second_stage_accuracy(stage, args.img_size)
    rows = [row.label for row in args.rows] if args.runs is None else [stage.row for stage in stages]
    text = markdown(evaluations, rows, args.overlap, args.img_size, command, named_runs=args.runs is not None)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    output.with_suffix(".json").write_text(json.dumps(
        {"command": command, "img_size": args.img_size, "runs": [evaluation.__dict__ for evaluation in evaluations]},
        indent=1,
    ))
    print(text)
    return 1 if any(evaluation.errors for evaluation in evaluations) else 0


if __name__ == "__main__":
    default_cpu_threads()
    sys.exit(main())
