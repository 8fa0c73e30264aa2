"""Models trained at a small image size, tested at a larger one: whole at that size, and tiled.

    python -m visattn.experiments.resolution --run-root runs/table-cluttered-curriculum --img-size 128 \\
        --attn timm softmax linear linear:rope=null --overlap 0 32 --output resolution.md

The runs are the first stages of a curriculum table with one earlier stage (``python -m visattn.experiments.accuracy
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

    python -m visattn.experiments.resolution --runs runs/pf64-easy-softmax:runs/pf128-easy-softmax --img-size 128 \\
        --overlap 0 32 --output pathfinder-resolution.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.utils.data import TensorDataset

from visattn.experiments.larger_size import SECOND_STAGE, check_sizes, evaluate
from visattn.experiments.plan import parse_rows
from visattn.experiments.report import command_line, resolution_markdown, write_resolution
from visattn.experiments.stages import named_stages, second_stage_accuracy, table_stages
from visattn.tiled import MERGES
from visattn.train import ConfigError, default_cpu_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m visattn.experiments.resolution", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-root", help="a curriculum table's run root: <run-root>/<row>/seed<k>-stage1")
    parser.add_argument("--attn", nargs="+", metavar="ROW", help="rows, as visattn.experiments.accuracy takes them (with --run-root)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("visattn.experiments.resolution", sys.argv[1:] if argv is None else argv)
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
    text = resolution_markdown(evaluations, rows, args.overlap, args.img_size, command, named_runs=args.runs is not None)
    write_resolution(Path(args.output), text, evaluations, args.img_size, command)
    print(text)
    return 1 if any(evaluation.errors for evaluation in evaluations) else 0


if __name__ == "__main__":
    default_cpu_threads()
    sys.exit(main())
