"""Train every attention type with one recipe over several seeds, and tabulate accuracy, speed and memory.

    python -m visattn.experiments.accuracy                                   # timm + every type, configs/digits.yaml, seed 0
    python -m visattn.experiments.accuracy --epochs 2 --attn axial,softmax   # a quicker, partial table
    python -m visattn.experiments.accuracy --config configs/cluttered-digits.yaml --seeds 0 1 2 \\
        --run-root runs/table-cluttered-digits --output tables/cluttered-digits.md
    python -m visattn.experiments.accuracy --attn timm linear linear:dwconv_kernel=null   # a row with options
    python -m visattn.experiments.accuracy --epochs 1 -- --max-train-samples 256          # after --: to every train.py
    python -m visattn.experiments.accuracy --config configs/cluttered-digits-curriculum.yaml \\
        --stage "--img-size 64 --epochs 4"                                        # a curriculum: 64 px, then 128
    D="seed=0 train_size=10000 val_size=2000 test_size=2000"   # a stage's --dataset-kwargs replaces them all
    python -m visattn.experiments.accuracy --config configs/pathfinder.yaml --epochs 10 \\
        --stage "--epochs 20 --dataset-kwargs level=easy contour_length=2 distractors=0 $D" \\
        --stage "--epochs 10 --dataset-kwargs level=easy $D" \\
        --stage "--epochs 10 --dataset-kwargs level=intermediate $D" \\
        -- --img-size 64 --patch-size 8                                  # a ladder of easier tasks, then hard
    python -m visattn.experiments.accuracy --config configs/cluttered-digits-curriculum.yaml \\
        --stage "--img-size 64 --epochs 4" --variants tuning --output tables/tuning.md   # on other data

Rows (``--attn``): attention types of ``visattn.list_attentions()`` and ``timm``, timm's own Attention in a
stock timm ViT of the same shape (``train.py --attn timm``), the reference of the speed-up column; by
default ``timm`` and then every type. A row with options is ``TYPE:KEY=VALUE[,KEY=VALUE...]``, its options
laid over the recipe's ``attn_kwargs``; a word without ``:`` may name several rows, comma-separated.

Each (row, seed) is trained by its own ``train.py`` process into ``<run-root>/<row>/seed<k>`` (its output in
``seed<k>.log`` beside it), one after the other: every row with the first seed, then every row with the next
(``--jobs N``: N at a time in that order, each stage once the one before it has ended).
A curriculum (``--stage FLAGS``, once per earlier stage) trains each run in several ``train.py`` processes:
stage i with the recipe, the words after ``--`` and then the i-th ``--stage``'s train.py flags (one word, quoted:
``"--img-size 64 --epochs 4"``; a flag there replaces the same flag's value, ``--dataset-kwargs`` all of its
options; a generated dataset is drawn afresh at each stage's size and options) into
``seed<k>-stage<i>``, each stage from the previous one's best weights, chosen on validation, and last the
recipe itself into ``seed<k>`` from the last stage's (``--initial-checkpoint``, which resamples the position
embedding to the new grid; a ``--initial-checkpoint`` after ``--`` starts the first stage).

Variants of the data (``--variants NAME [NAME ...]``, each word a variant of ``visattn/experiments/variants.py``
or a group of them, ``tuning`` or ``held-out``): every run above once per variant, into
``<run-root>/<variant>/<row>/seed<k>``, the variant's dataset options laid over the recipe's in every stage (a
``--dataset-kwargs`` in a ``--stage`` or after ``--`` is refused: the variant sets the data). Every recipe
decision is made on the tuning variants and reported on the held-out ones.

A run whose ``summary.json`` is there and whose saved ``config.yaml`` is the config this command would train
is reused, not retrained; one with that config and a checkpoint but no summary (an invocation that was
stopped) is resumed; any other is trained afresh (``--retrain``: every run). A stage started before the stage
it starts from last finished is trained afresh, whatever its config. A table that needs hours is so built over
several invocations. One line per run says when it starts and ends, with its time and the estimated time of
the runs left.

Written after every run (``--output NAME.md``): the markdown table; ``NAME.png``, test accuracy per row with
its range over the seeds, and the validation accuracy of every epoch per row; ``NAME.json`` and ``NAME.csv``,
every run with its summary (the JSON also with its per-epoch records). Columns: test accuracy of the weights
chosen on validation (median [min-max] over the seeds that finished, and their count); epochs at chance, the
leading epochs of the first stage whose validation accuracy is below 1/C + 3 sqrt((1/C)(1 - 1/C)/n) (C classes,
n validation images: chance plus three standard errors; median [min-max] over the seeds); training images/s
and seconds per epoch (training plus validation) from each run's own records, and the peak memory (GPU
memory allocated by tensors on CUDA; the whole process's peak resident memory on CPU, Python runtime and
dataset included), each the median over seeds and, with a curriculum, of the last stage alone; the speed-up
over the ``timm`` row (ratio of images/s); and whether the row ran at the recipe's token count (no: out of
memory, or failed, with its log). With ``--variants``: these files for each variant as ``NAME-<variant>.md``
(and .png, .json, .csv), and ``NAME.md`` (with ``NAME.json``), one row per variant and row: its group, test
accuracy, seconds for all stages together (median over the seeds), and epochs at chance. Each table names the
command that wrote it (the summary above its rows, the others in the note below them).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import visattn
from visattn.experiments.execute import add_grid_arguments, check_grid_arguments, run_grid
from visattn.experiments.plan import (
    REPO, TABLE_FLAGS, Grid, Row, Run, expected_config, flag_names, parse_rows, plan, split_at_separator, stage_words,
    train_flags_problem,
)
from visattn.experiments.report import command_line, variant_output, write_accuracy, write_variants
from visattn.experiments.summarize import summarize_rows
from visattn.experiments.variants import Variant, parse_variants
from visattn.models import TIMM_ATTENTION
from visattn.train import ConfigError


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the table's arguments, checked and parsed into rows, stages and variants; the train.py flags after --)."""
    own, train_args = split_at_separator(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(stage_values_joined(own))
    check_args(parser, args, train_args)
    return args, train_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m visattn.experiments.accuracy", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "digits.yaml"), help="the recipe every row trains with")
    parser.add_argument("--epochs", type=int,
                        help="override the recipe's epochs (fewer for a quick table); with a curriculum, the last stage's")
    parser.add_argument(
        "--attn", nargs="+", metavar="ROW",
        help=f"rows: TYPE or TYPE:KEY=VALUE[,KEY=VALUE...], TYPE one of {TIMM_ATTENTION}, "
             f"{', '.join(visattn.list_attentions())} (default: {TIMM_ATTENTION} and every type)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="train.py --seed of each run (default: 0)")
    parser.add_argument("--run-root", default="runs/accuracy_table",
                        help="<run-root>/<row>/seed<k> holds each run (with --variants, "
                             "<run-root>/<variant>/<row>/seed<k>)")
    parser.add_argument("--output", default="accuracy_table.md",
                        help="the markdown table; .png, .json, .csv beside it (with --variants: the summary table, "
                             "each variant's table as NAME-<variant>.md beside it)")
    add_grid_arguments(parser)
    parser.add_argument(
        "--stage", action="append", default=[], metavar="FLAGS", dest="stages",
        help="a curriculum: an earlier stage, train.py flags in one quoted word laid over the recipe and the words "
             "after -- (\"--img-size 64 --epochs 4\"); once per stage, in order, each from the previous one's weights",
    )
    parser.add_argument(
        "--variants", nargs="+", metavar="VARIANT", default=[],
        help="train the grid on each of these variants of the data: names of visattn/experiments/variants.py, or "
             "tuning / held-out (all of that group); runs in <run-root>/<variant>/<row>/seed<k>",
    )
    return parser


def stage_values_joined(own: list[str]) -> list[str]:
    """``own`` with each ``--stage`` joined to its value: a stage is one word that starts with "--", which argparse
    takes as the flag's value only when joined to it, even without a space in it ("--stage --epochs=4")."""
    pending, joined = list(own), []
    while pending:
        word = pending.pop(0)
        joined.append(f"--stage={pending.pop(0)}" if word == "--stage" and pending else word)
    return joined


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, train_args: list[str]) -> None:
    """The parser's error for a value out of range or flags that cannot go together; ``args`` given ``rows``,
    ``stage_flags`` and its ``variants`` parsed."""
    check_grid_arguments(parser, args)
    try:
        args.rows = parse_rows(args.attn or [TIMM_ATTENTION, *visattn.list_attentions()])
    except ValueError as error:
        parser.error(f"--attn: {error}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: each seed once, got {' '.join(map(str, args.seeds))}")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs: must be >= 1, got {args.epochs}")
    taken = sorted(flag_names(train_args) & set(TABLE_FLAGS))
    if taken:
        parser.error(f"after --: {', '.join(taken)} set by the table for each run; use --attn ROW and --seeds")
    problem = train_flags_problem(train_args)
    if problem:
        parser.error(f"after --: {problem}")
    args.stage_flags = []
    for number, text in enumerate(args.stages, start=1):
        args.stage_flags.append(stage_words(text, lambda problem: parser.error(f"--stage {number} {text!r}: {problem}")))
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as error:
        parser.error(f"--variants: {error}")
    if args.variants:
        stages = [(f"--stage {number}", words) for number, words in enumerate(args.stage_flags, start=1)]
        for where, words in [("after --", train_args), *stages]:
            if "--dataset-kwargs" in flag_names(words):
                parser.error(f"{where}: --dataset-kwargs is set by --variants in every stage; leave it out")
    if not args.output.endswith(".md"):
        parser.error(f"--output: a markdown file name ending in .md, got {args.output!r}")


def grid(args: argparse.Namespace, train_args: list[str]) -> Grid:
    """The runs ``parse_args`` asks for."""
    return Grid(config=args.config, rows=args.rows, seeds=args.seeds, run_root=Path(args.run_root), epochs=args.epochs,
                stage_flags=args.stage_flags, train_args=train_args, variants=args.variants)


def write_tables(output: Path, rows: list[Row], variants: list[Variant], runs: list[Run], command: str) -> str:
    """The accuracy table of ``runs``, or with variants each variant's (``NAME-<variant>.md``) and the summary
    (``output``); returns the table, or the summary."""
    if not variants:
        return write_accuracy(output, summarize_rows(rows, runs), runs, expected_config(runs[0].argv), command)
    per_variant = []
    for variant in variants:
        mine = [run for run in runs if run.variant == variant.name]
        results = summarize_rows(rows, mine)
        write_accuracy(variant_output(output, variant), results, mine, expected_config(mine[0].argv), command)
        per_variant.append((variant, results))
    return write_variants(output, per_variant, command)


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    try:
        runs = plan(grid(args, train_args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = command_line("visattn.experiments.accuracy", sys.argv[1:] if argv is None else argv)
    output = Path(args.output)
    run_grid(runs, args.retrain, lambda: write_tables(output, args.rows, args.variants, runs, command),
             train=not args.tables_only, jobs=args.jobs)
    print(write_tables(output, args.rows, args.variants, runs, command))
    return 0 if all(run.status == "finished" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
