"""Convert a trained softmax ViT to each attention type and tabulate test accuracy after the conversion, after
attention transfer and after each fine-tune epoch, beside the same fine-tune without transfer and the type
trained from scratch, with the training images and seconds each took.

    # the parents and the rows from scratch: an accuracy table of softmax and the types, three seeds
    python -m visattn.experiments.accuracy --config configs/cluttered-digits-curriculum.yaml \\
        --stage "--img-size 64 --epochs 4" --seeds 0 1 2 --run-root runs/table-cluttered-curriculum \\
        --attn softmax linear linear:dwconv_kernel=null axial neighborhood sparse --output cluttered.md
    # each seed from its own parent; from scratch read from the same run root
    R=runs/table-cluttered-curriculum
    python -m visattn.experiments.transfer --parent $R/softmax/seed0 $R/softmax/seed1 $R/softmax/seed2 \\
        --seeds 0 1 2 --from-scratch-root $R --from-scratch-rows linear:dwconv_kernel=null linear axial \\
        neighborhood sparse --run-root runs/transfer-cluttered --output transfer-cluttered.md
    # resolution transfer: parents trained at 64 px (256 tokens), converted and trained on at 128 px (1,024)
    python -m visattn.experiments.transfer --parent $R/softmax/seed0-stage1 --attn softmax axial \\
        --run-root runs/transfer-64-to-128 --output transfer-64-to-128.md -- --img-size 128

The parents (``--parent RUN_DIR [RUN_DIR ...]``): finished softmax runs (``attn`` softmax, or timm's own
Attention), one for every seed or one per seed of ``--seeds``, in order, all of one recipe but for their seeds.
They are not trained here: the accuracy runner (``visattn.experiments.accuracy``) trains them with their
recipe's curriculum, and its run root also holds the types trained from scratch that the table compares with.

Rows (``--attn``): as the accuracy runner takes them, ``TYPE`` or ``TYPE:KEY=VALUE[,KEY=VALUE...]``, the options
laid over the parent's ``attn_kwargs`` (its rope, say); by default linear with a learned feature map without
and with its 3x3 locality term, axial, neighborhood and sparse. Each (row, seed) is trained twice, each a
train.py process with the parent's saved ``config.yaml`` as its recipe, the words after ``--`` over it, and
``--initial-checkpoint <its seed's parent> --epochs K --test-every-epoch`` (K the largest ``--finetune-epochs``):
the transfer arm, ``<run-root>/transfer/<row>/seed<k>``, ``--transfer-epochs N`` (``--transfer-epochs``) of
attention transfer and then K fine-tune epochs; the arm without transfer, ``<run-root>/no-transfer/<row>/seed<k>``,
``--transfer-epochs 0`` and the same K epochs.

After k fine-tune epochs: epoch k of the one K-epoch fine-tune each run trains, tested after every epoch (the
model as it stands, not chosen on validation), not a run of its own per k. Every k is then of the same run,
and each run costs one transfer and K epochs rather than one transfer and k epochs per k; the price is that
epoch k < K sits in a K-epoch cosine schedule, whose learning rate has not decayed as a k-epoch fine-tune's
would: the table says so in its note.

Types with nothing to learn: attention transfer trains the parameters a type adds to the parent's ``qkv``,
``proj`` and norms (a learned feature map, a locality convolution, decay rates); a type that adds none (axial,
neighborhood, sparse, linear with none of those) is refused by it. Such a row's transfer trains those projections
too (``--transfer-projections`` of train.py): the runner says so in a line at the start, and the table in the
row's transfer stage and its note. ``--transfer-projections`` here does so for every row.

From scratch (``--from-scratch-root ROOT``): an accuracy table's run root, ``ROOT/<row>/seed<k>`` finished runs of
the same task and model at the same size, one row per ``--attn`` row (``--from-scratch-rows``, in order; by default
the ``--attn`` rows themselves): their reported test accuracy and their training over all their stages. Without it
the table leaves them out, and says so.

A run of this config that finished is reused, a stopped one resumed, any other trained afresh (``--retrain``: every
run), one line per run, as the accuracy runner does; a table of hours is so built over several invocations. A parent
is the same whichever way its path is spelled; a run that started before its parent last finished (the parent
retrained in place since) is trained afresh. Written after every run (``--output NAME.md``): the markdown table, a
line per row and stage (the parent's first) with test accuracy (median [min-max] over the seeds that finished, and
their count), each seed's accuracy minus its parent's in points, the training images and seconds since the parent's
weights (medians), and how many runs finished; ``NAME.json``, the lines, every stage of every run and every run's
per-epoch records; ``NAME.csv``, every stage of every run, parent and run from scratch. The note below the table
names the command that wrote it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import visattn
from visattn.experiments.execute import (
    add_grid_arguments, check_grid_arguments, choose_action, config_differences, run_grid,
)
from visattn.experiments.plan import (
    TABLE_FLAGS, Grid, Row, Run, expected_config, flag_names, parse_rows, plan, run_folder, split_at_separator,
    train_flags_problem,
)
from visattn.experiments.report import command_line
from visattn.experiments.summarize import FinishedRun, read_finished
from visattn.experiments.transfer_table import (
    PROJECTIONS, TransferTable, UncountableRecords, lineage_cost, write_transfer,
)
from visattn.models import TIMM_ATTENTION, create_model
from visattn.models.transfer import trainable_attention_parameters
from visattn.predict import BEST_WEIGHTS, read_model_file
from visattn.train import CONFIG_FILE, SUMMARY_FILE, ConfigError, TrainConfig
from visattn.train.transfer import PARENT_ATTENTION

DEFAULT_ROWS = ["linear:feature_map=learned,dwconv_kernel=null", "linear:feature_map=learned", "axial",
                "neighborhood", "sparse"]
# train.py flags the table sets for every run: they cannot also come after --.
SET_BY_TABLE = (*TABLE_FLAGS, "--config", "--initial-checkpoint", "--epochs", "--transfer-epochs", "--test-every-epoch",
                "--no-test-every-epoch", "--transfer-projections", "--no-transfer-projections")
# The arm without transfer: a row's own flags, after the table's --transfer-epochs N.
NO_TRANSFER = ("--transfer-epochs", "0")
# What a run trained from scratch must share with the table's runs to be compared with them: the task, the size
# and the model but for its attention.
SAME_TASK_AND_MODEL = ("dataset", "dataset_kwargs", "image_hw", "patch_size", "model", "stem", "embed_dim", "depth",
                       "num_heads", "mlp_ratio", "global_pool", "class_token", "model_kwargs")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    own, train_args = split_at_separator(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(
        prog="python -m visattn.experiments.transfer", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--parent", nargs="+", required=True, type=Path, metavar="RUN_DIR",
                        help="finished softmax runs: one for every seed, or one per seed of --seeds, in order")
    parser.add_argument("--attn", nargs="+", metavar="ROW", default=DEFAULT_ROWS,
                        help=f"rows: TYPE or TYPE:KEY=VALUE[,KEY=VALUE...], TYPE one of "
                             f"{', '.join(visattn.list_attentions())} (default: {' '.join(DEFAULT_ROWS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="train.py --seed of each run (default: 0)")
    parser.add_argument("--transfer-epochs", type=int, default=2, help="attention transfer epochs (default: 2)")
    parser.add_argument("--finetune-epochs", nargs="+", type=int, default=[1, 2, 4], metavar="K",
                        help="fine-tune epochs to test after; each run trains the largest (default: 1 2 4)")
    parser.add_argument("--transfer-projections", action="store_true",
                        help="every row's transfer trains qkv, proj and norms too (default: only the rows whose type "
                             "adds no parameters)")
    parser.add_argument("--from-scratch-root", type=Path, metavar="ROOT",
                        help="an accuracy table's run root: ROOT/<row>/seed<k>, the types trained from scratch")
    parser.add_argument("--from-scratch-rows", nargs="+", metavar="ROW",
                        help="with --from-scratch-root: its row for each --attn row, in order (default: the same rows)")
    parser.add_argument("--run-root", default="runs/transfer_table",
                        help="<run-root>/transfer/<row>/seed<k> and <run-root>/no-transfer/<row>/seed<k> hold the runs")
    parser.add_argument("--output", default="transfer_table.md", help="the markdown table; .json, .csv beside it")
    add_grid_arguments(parser)
    args = parser.parse_args(own)
    check_grid_arguments(parser, args)
    try:
        args.rows = parse_rows(args.attn)
    except ValueError as error:
        parser.error(f"--attn: {error}")
    if any(row.attn == TIMM_ATTENTION for row in args.rows):
        parser.error(f"--attn: {TIMM_ATTENTION} (timm's own Attention) is no conversion target; accepted: "
                     f"{', '.join(visattn.list_attentions())}")
    for flag, values in (("--seeds", args.seeds), ("--finetune-epochs", args.finetune_epochs)):
        if len(set(values)) != len(values):
            parser.error(f"{flag}: each value once, got {' '.join(map(str, values))}")
    if min(args.finetune_epochs) < 1:
        parser.error(f"--finetune-epochs: epochs >= 1, got {' '.join(map(str, args.finetune_epochs))}")
    args.finetune_epochs = sorted(args.finetune_epochs)
    if args.transfer_epochs < 1:
        parser.error(f"--transfer-epochs: must be >= 1 (the arm without transfer is trained beside it), got "
                     f"{args.transfer_epochs}")
    if len(args.parent) not in (1, len(args.seeds)):
        parser.error(f"--parent: {len(args.parent)} runs for {len(args.seeds)} seeds; accepted: one parent for "
                     "every seed, or one per seed of --seeds, in order")
    args.parents = dict(zip(args.seeds, args.parent * len(args.seeds) if len(args.parent) == 1 else args.parent))
    args.scratch_rows = scratch_rows(args, parser)
    taken = sorted(flag_names(train_args) & set(SET_BY_TABLE))
    if taken:
        parser.error(f"after --: {', '.join(taken)} set by the table for each run; use --parent, --attn, --seeds, "
                     "--transfer-epochs, --finetune-epochs and --transfer-projections")
    problem = train_flags_problem(train_args)
    if problem:
        parser.error(f"after --: {problem}")
    if not args.output.endswith(".md"):
        parser.error(f"--output: a markdown file name ending in .md, got {args.output!r}")
    return args, train_args


def scratch_rows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Row]:
    """The from-scratch row of each ``--attn`` row: ``--from-scratch-rows``, one word each, of the same type."""
    if args.from_scratch_rows is None:
        return args.rows
    if args.from_scratch_root is None:
        parser.error("--from-scratch-rows: give --from-scratch-root, the run root that holds them")
    if len(args.from_scratch_rows) != len(args.rows):
        parser.error(f"--from-scratch-rows: {len(args.from_scratch_rows)} rows for {len(args.rows)} --attn rows; "
                     "accepted: one per --attn row, in order")
    rows = []
    for word, row in zip(args.from_scratch_rows, args.rows):
        try:
            parsed = parse_rows([word])
        except ValueError as error:
            parser.error(f"--from-scratch-rows: {error}")
        if len(parsed) != 1:
            parser.error(f"--from-scratch-rows: {word!r} is {len(parsed)} rows; accepted: one row per word")
        scratch = parsed[0]
        if scratch.attn != row.attn:
            parser.error(f"--from-scratch-rows: {scratch.text!r} for row {row.text!r} is another type; accepted: a row "
                         f"of type {row.attn}")
        rows.append(scratch)
    return rows


def read_parents(paths: dict[int, Path]) -> dict[int, FinishedRun]:
    """The finished softmax run each seed starts from; ValueError (one line) for a run that is not one, or for
    parents of different recipes."""
    parents = {}
    for seed, path in paths.items():
        try:
            parent = read_finished("parent", seed, path)
        except (ValueError, OSError) as error:
            raise ValueError(f"--parent: {error}") from None
        if parent.config.attn not in (PARENT_ATTENTION, TIMM_ATTENTION):
            raise ValueError(f"--parent: {path} was trained with attn {parent.config.attn!r}; accepted: a run of "
                             f"{PARENT_ATTENTION} or {TIMM_ATTENTION} attention")
        parents[seed] = parent
    first = next(iter(parents.values()))
    for parent in parents.values():
        differences = config_differences(first.config, parent.config, ignored=("seed", "initial_checkpoint"))
        if differences:
            raise ValueError(f"--parent: {first.run_dir} and {parent.run_dir} differ in {'; '.join(differences)}; "
                             "accepted: parents of one recipe, but for their seeds")
    return parents


def adds_parameters(config: TrainConfig, num_classes: int) -> bool:
    """Whether the attention of ``config``'s model has parameters besides those it carries from its parent
    (``qkv``, ``proj``, norms): what attention transfer trains without ``transfer_projections`` (with
    ``lora_rank``, the adapters on those: something to train for every type)."""
    if config.lora_rank:
        return True
    try:
        model = create_model(config.model, **config.model_kwargs_for_timm(num_classes))
    except (ValueError, TypeError) as error:
        raise ConfigError(f"attn {config.attn!r} with options {config.attn_kwargs}: cannot build its model: {error}") from None
    return any(trainable_attention_parameters(model))


def arm_grid(args: argparse.Namespace, train_args: list[str], parent: FinishedRun, seed: int, rows: list[Row],
             arm: str) -> Grid:
    """One seed's runs of one arm: the parent's recipe, the words after --, and the table's flags."""
    flags = [*train_args, "--initial-checkpoint", str(parent.run_dir), "--transfer-epochs", str(args.transfer_epochs),
             "--test-every-epoch", "--no-transfer-projections"]
    return Grid(config=str(parent.run_dir / CONFIG_FILE), rows=rows, seeds=[seed], run_root=Path(args.run_root) / arm,
                epochs=max(args.finetune_epochs), train_args=flags)


def transfer_rows(args: argparse.Namespace, train_args: list[str], parents: dict[int, FinishedRun]) -> list[Row]:
    """The rows as the transfer arm trains them: with PROJECTIONS where the type adds no parameter for the
    transfer to train, or every row with ``--transfer-projections``."""
    seed, parent = next(iter(parents.items()))
    num_classes = read_model_file(parent.run_dir)["kwargs"]["num_classes"]
    runs = plan(arm_grid(args, train_args, parent, seed, args.rows, "transfer"))
    return [
        replace(row, train_flags=PROJECTIONS)
        if args.transfer_projections or not adds_parameters(expected_config(run.argv), num_classes) else row
        for row, run in zip(args.rows, runs)
    ]


def read_from_scratch(root: Path, rows: list[Row], seeds: list[int], runs_config: TrainConfig
                      ) -> dict[tuple[str, int], FinishedRun]:
    """The finished runs of ``rows`` and ``seeds`` under ``root``; ValueError (one line) for a root that does not
    exist or a run of another task, size or model than the table's runs."""
    if not root.is_dir():
        raise ValueError(f"--from-scratch-root: {root} does not exist; accepted: an accuracy table's run root")
    found = {}
    for row in rows:
        for seed in seeds:
            run_dir = root / row.folder / run_folder(seed)
            if not (run_dir / SUMMARY_FILE).is_file():
                continue
            try:
                run = read_finished(row.text, seed, run_dir)
            except (ValueError, OSError) as error:
                raise ValueError(f"--from-scratch-root: {error}") from None
            differ = [f"{key} {getattr(run.config, key)!r} (the table's runs: {getattr(runs_config, key)!r})"
                      for key in SAME_TASK_AND_MODEL if getattr(run.config, key) != getattr(runs_config, key)]
            if differ:
                raise ValueError(f"--from-scratch-root: {run_dir} differs in {', '.join(differ)}; accepted: runs of "
                                 "the same task and model (but for its attention) at the same size")
            found[(row.text, seed)] = run
    return found


def plan_table(args: argparse.Namespace, train_args: list[str]) -> tuple[TransferTable, list[Run]]:
    """The table and its runs in the order they train: every row of both arms with the first seed, then with
    the next. ValueError or ConfigError (one line) for a parent, a run or a run from scratch it cannot take."""
    parents = read_parents(args.parents)
    rows = transfer_rows(args, train_args, parents)
    no_transfer = [replace(row, train_flags=NO_TRANSFER) for row in args.rows]
    transfer_runs, no_transfer_runs, runs = [], [], []
    for seed, parent in parents.items():
        with_transfer = plan(arm_grid(args, train_args, parent, seed, rows, "transfer"))
        without = plan(arm_grid(args, train_args, parent, seed, no_transfer, "no-transfer"))
        transfer_runs += with_transfer
        no_transfer_runs += without
        runs += [*with_transfer, *without]
    from_scratch = {}
    if args.from_scratch_root is not None:
        from_scratch = read_from_scratch(args.from_scratch_root, args.scratch_rows, args.seeds,
                                         expected_config(transfer_runs[0].argv))
    for finished in (*parents.values(), *from_scratch.values()):
        lineage_cost(finished.run_dir)  # a record the table cannot count stops it now, not after the first run
    table = TransferTable(rows, transfer_runs, no_transfer_runs, parents, args.transfer_epochs, args.finetune_epochs,
                          args.from_scratch_root, args.scratch_rows, from_scratch)
    return table, runs


def parents_without_weights(table: TransferTable, runs: list[Run], retrain: bool) -> list[Path]:
    """The parents whose best weights are not there while a run of their seed is to be trained."""
    seeds = {run.seed for run in runs if choose_action(run, retrain)[0] != "reuse"}
    return [parent.run_dir for seed, parent in table.parents.items()
            if seed in seeds and not (parent.run_dir / BEST_WEIGHTS).is_file()]


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    try:
        table, runs = plan_table(args, train_args)
    except (ValueError, OSError) as error:  # ConfigError among the ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = command_line("visattn.experiments.transfer", sys.argv[1:] if argv is None else argv)
    if args.transfer_projections:
        print("every row's transfer trains qkv, proj and norms too (--transfer-projections)", flush=True)
    else:
        for row in table.rows:
            if row.train_flags == PROJECTIONS:
                print(f"{row.text}: adds no parameters to the parent's qkv, proj and norms: its transfer trains those "
                      "(--transfer-projections)", flush=True)
    if not args.tables_only:
        missing = parents_without_weights(table, runs, args.retrain)
        if missing:
            print(f"error: --parent: {missing[0]} has no {BEST_WEIGHTS} (a run copied without its weights?), which "
                  "its seed's runs start from; accepted: a finished run with its best weights", file=sys.stderr)
            return 2
    output = Path(args.output)
    try:
        run_grid(runs, args.retrain, lambda: write_transfer(output, table, command), train=not args.tables_only,
                 jobs=args.jobs)
        print(write_transfer(output, table, command))
    except UncountableRecords as error:  # a run's own transfer records, older than their train_images
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0 if all(run.status == "finished" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
