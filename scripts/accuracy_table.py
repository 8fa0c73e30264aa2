"""Train every attention type with one recipe over several seeds, and tabulate accuracy, speed and memory.

    python scripts/accuracy_table.py                                   # timm + every type, configs/digits.yaml, seed 0
    python scripts/accuracy_table.py --epochs 2 --attn axial,softmax   # a quicker, partial table
    python scripts/accuracy_table.py --config configs/cluttered-digits.yaml --seeds 0 1 2 \\
        --run-root runs/table-cluttered-digits --output tables/cluttered-digits.md
    python scripts/accuracy_table.py --attn timm linear linear:dwconv_kernel=null   # a row with options
    python scripts/accuracy_table.py --epochs 1 -- --max-train-samples 256          # after --: to every train.py
    python scripts/accuracy_table.py --config configs/cluttered-digits-curriculum.yaml \\
        --stage "--img-size 64 --epochs 4"                                        # a curriculum: 64 px, then 128
    D="seed=0 train_size=10000 val_size=2000 test_size=2000"   # a stage's --dataset-kwargs replaces them all
    python scripts/accuracy_table.py --config configs/pathfinder.yaml --epochs 10 \\
        --stage "--epochs 20 --dataset-kwargs level=easy contour_length=2 distractors=0 $D" \\
        --stage "--epochs 10 --dataset-kwargs level=easy $D" \\
        --stage "--epochs 10 --dataset-kwargs level=intermediate $D" \\
        -- --img-size 64 --patch-size 8                                  # a ladder of easier tasks, then hard

Rows (``--attn``): attention types of ``visattn.list_attentions()`` and ``timm``, timm's own Attention in a
stock timm ViT of the same shape (``train.py --attn timm``), the reference of the speed-up column; by
default ``timm`` and then every type. A row with options is ``TYPE:KEY=VALUE[,KEY=VALUE...]``, its options
laid over the recipe's ``attn_kwargs``; a word without ``:`` may name several rows, comma-separated.

Each (row, seed) is trained by its own ``train.py`` process into ``<run-root>/<row>/seed<k>`` (its output in
``seed<k>.log`` beside it), one after the other: every row with the first seed, then every row with the next.
A curriculum (``--stage FLAGS``, once per earlier stage) trains each run in several ``train.py`` processes:
stage i with the recipe, the words after ``--`` and then the i-th ``--stage``'s train.py flags (one word, quoted:
``"--img-size 64 --epochs 4"``; a flag there replaces the same flag's value, ``--dataset-kwargs`` all of its
options; a generated dataset is drawn afresh at each stage's size and options) into
``seed<k>-stage<i>``, each stage from the previous one's best weights, chosen on validation, and last the
recipe itself into ``seed<k>`` from the last stage's (``--initial-checkpoint``, which resamples the position
embedding to the new grid; a ``--initial-checkpoint`` after ``--`` starts the first stage).

A run whose ``summary.json`` is there and whose saved ``config.yaml`` is the config this command would train
is reused, not retrained; one with that config and a checkpoint but no summary (an invocation that was
stopped) is resumed; any other is trained afresh (``--retrain``: every run). A stage started before the stage
it starts from last finished is trained afresh, whatever its config. A table that needs hours is so built over
several invocations. One line per run says when it starts and ends, with its time and the estimated time of
the runs left.

Written after every run (``--output NAME.md``): the markdown table; ``NAME.png``, test accuracy per row with
its range over the seeds, and the validation accuracy of every epoch per row; ``NAME.json`` and ``NAME.csv``,
every run with its summary (the JSON also with its per-epoch records). Columns: test accuracy of the weights
chosen on validation (median [min-max] over the seeds that finished, and their count); training images/s
and seconds per epoch (training plus validation) from each run's own records, and the peak memory (GPU
memory allocated by tensors on CUDA; the whole process's peak resident memory on CPU, Python runtime and
dataset included), each the median over seeds and, with a curriculum, of the last stage alone; the speed-up
over the ``timm`` row (ratio of images/s); and whether the row ran at the recipe's token count (no: out of
memory, or failed, with its log).
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import visattn
from visattn.layers.options import parse_key_values
from visattn.models import TIMM_ATTENTION
from visattn.train.attention import resolve_attention
from visattn.train.cli import build_parser as build_train_parser
from visattn.train.cli import resolve_config
from visattn.train.config import ConfigError, TrainConfig, make_config, read_yaml
from visattn.train.rundir import CONFIG_FILE, list_checkpoints
from visattn.train.run_log import METRICS_FILE, SUMMARY_FILE

REPO = Path(__file__).resolve().parents[1]
# Config keys that say where and how a run is kept, not what it trains: a run that differs only in them is reused.
BOOKKEEPING_KEYS = ("run_dir", "num_workers", "save_every", "keep_checkpoints", "log_with")
# train.py flags the table sets for each run; they cannot also come after --.
TABLE_FLAGS = ("--attn", "--attn-kwargs", "--seed", "--run-dir", "--resume", "--resume-from", "--overwrite")
# ... and, in a --stage, the weights it starts from: the previous stage's (the first stage's can come after --).
STAGE_FLAGS = (*TABLE_FLAGS, "--initial-checkpoint")
# What a run that ran out of memory leaves in its log (CPU allocator, CUDA, Python).
OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory|MemoryError", re.IGNORECASE)
SIGKILL_EXIT = -9  # what subprocess reports for a process the kernel's OOM killer ends


@dataclass(frozen=True)
class Row:
    """One row of the table: an attention type (or ``timm``) with the options its text gives."""

    text: str  # as given: "linear" or "linear:dwconv_kernel=null"
    attn: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        return self.attn if not self.options else f"{self.attn} ({self.text.partition(':')[2]})"

    @property
    def folder(self) -> str:
        """The row's folder under the run root: its text with ':' and ',' (and anything unsafe) as '+'."""
        return re.sub(r"[^\w.=-]+", "+", self.text)


def parse_rows(words: list[str]) -> list[Row]:
    """The rows of ``--attn`` words; ValueError naming the bad word and what is accepted."""
    valid = [TIMM_ATTENTION, *visattn.list_attentions()]
    texts = [text for word in words for text in ([word] if ":" in word else word.split(",")) if text.strip()]
    rows = []
    for text in texts:
        attn, _, options_text = text.strip().partition(":")
        if attn not in valid:
            raise ValueError(f"unknown attention {attn!r} in row {text!r}; valid: {', '.join(valid)}")
        try:
            options = parse_key_values(options_text) if options_text else {}
        except ValueError as error:
            raise ValueError(f"row {text!r}: {error}; write TYPE:KEY=VALUE[,KEY=VALUE...]") from None
        if options and attn == TIMM_ATTENTION:
            raise ValueError(f"row {text!r}: {TIMM_ATTENTION} (timm's own Attention) takes no options")
        rows.append(Row(text.strip(), attn, options))
    folders = [row.folder for row in rows]
    repeated = sorted({folder for folder in folders if folders.count(folder) > 1})
    if repeated:
        raise ValueError(f"rows given twice (or that share a folder): {', '.join(repeated)}")
    return rows


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
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
    parser.add_argument("--run-root", default="runs/accuracy_table", help="<run-root>/<row>/seed<k> holds each run")
    parser.add_argument("--output", default="accuracy_table.md", help="the markdown table; .png, .json, .csv beside it")
    parser.add_argument("--retrain", action="store_true", help="train every run afresh, even a finished one")
    parser.add_argument(
        "--stage", action="append", default=[], metavar="FLAGS", dest="stages",
        help="a curriculum: an earlier stage, train.py flags in one quoted word laid over the recipe and the words "
             "after -- (\"--img-size 64 --epochs 4\"); once per stage, in order, each from the previous one's weights",
    )
    # A stage is one word that starts with "--": joined to its flag, argparse takes it as the flag's value
    # even without a space in it ("--stage --epochs=4").
    pending, own = own, []
    while pending:
        word = pending.pop(0)
        own.append(f"--stage={pending.pop(0)}" if word == "--stage" and pending else word)
    args = parser.parse_args(own)
    try:
        args.rows = parse_rows(args.attn or [TIMM_ATTENTION, *visattn.list_attentions()])
    except ValueError as error:
        parser.error(f"--attn: {error}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: each seed once, got {' '.join(map(str, args.seeds))}")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs: must be >= 1, got {args.epochs}")
    taken = sorted({arg.partition("=")[0] for arg in train_args} & set(TABLE_FLAGS))
    if taken:
        parser.error(f"after --: {', '.join(taken)} set by the table for each run; use --attn ROW and --seeds")
    problem = train_flags_problem(train_args)
    if problem:
        parser.error(f"after --: {problem}")
    args.stage_flags = []
    for number, text in enumerate(args.stages, start=1):
        args.stage_flags.append(stage_words(text, lambda problem: parser.error(f"--stage {number} {text!r}: {problem}")))
    if not args.output.endswith(".md"):
        parser.error(f"--output: a markdown file name ending in .md, got {args.output!r}")
    return args, train_args


def stage_words(text: str, fail) -> list[str]:
    """The train.py flags of one ``--stage`` word; ``fail(problem)``, which does not return, for a word that
    train.py would not take or that sets what the table sets itself."""
    example = 'give train.py flags in one quoted word, as "--img-size 64 --epochs 4"'
    try:
        words = shlex.split(text)
    except ValueError as error:
        fail(f"{error}; {example}")
    if not words:
        fail(f"empty; {example}")
    taken = sorted({word.partition("=")[0] for word in words} & set(STAGE_FLAGS))
    if taken:
        fail(f"{', '.join(taken)} set by the table for each stage; {example}")
    problem = train_flags_problem(words)
    if problem:
        fail(problem if problem.startswith("not train.py flags") else f"{problem}; {example}")
    return words


def train_flags_problem(words: list[str]) -> str | None:
    """Why train.py would not take ``words`` as its flags (None if it would), abbreviations refused: the table
    recognises the flags it sets by their full names."""
    train_parser = build_train_parser()
    train_parser.exit_on_error = False
    train_parser.allow_abbrev = False
    try:
        unknown = train_parser.parse_known_args(words)[1]
    except argparse.ArgumentError as error:  # a flag without its value
        return str(error)
    return f"not train.py flags: {' '.join(unknown)} (python train.py --help lists them, in full)" if unknown else None


# -- the runs ---------------------------------------------------------------------------------------
@dataclass
class Run:
    """One train.py run of a (row, seed), or of one stage of it: where it lives, what this invocation does
    with it, and what it left."""

    row: Row
    seed: int
    run_dir: Path
    argv: list[str]  # train.py's arguments, but for --overwrite/--resume
    action: str = "train"  # "reuse", "resume" or "train"
    status: str = "not run"  # "finished", "out of memory", "failed" or "not run"
    seconds: float | None = None  # the train.py process's time in this invocation
    summary: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    stage: int | None = None  # with a curriculum: 1, 2, ... up to the recipe's own; None without one
    previous: Run | None = None  # with a curriculum: the stage this one starts from
    last: bool = True  # the recipe's own run (the table's), not an earlier stage

    @property
    def log(self) -> Path:
        return self.run_dir.with_name(f"{self.run_dir.name}.log")

    @property
    def earlier(self) -> list[Run]:
        """The stages before this one, first to last."""
        stages: list[Run] = []
        run = self.previous
        while run is not None:
            stages.insert(0, run)
            run = run.previous
        return stages

    @property
    def cause(self) -> Run:
        """The run whose failure this one's is: the first earlier stage that did not finish, else itself."""
        return next((run for run in self.earlier if run.status not in ("finished", "not run")), self)

    @property
    def failed_log(self) -> Path:
        """The log that says why this run did not finish."""
        return self.cause.log


def train_argv(
    args: argparse.Namespace, train_args: list[str], row: Row, seed: int, run_dir: Path, stage: list[str],
) -> list[str]:
    """train.py's arguments for ``row`` and ``seed``: the recipe, the arguments after --, the stage's own
    (its ``--stage`` flags and starting weights, or the last stage's ``--epochs``), then the table's."""
    argv = ["--config", args.config, *train_args, *stage, "--attn", row.attn]
    if row.options:
        recipe = resolve_config(argv)[0]  # the row's options over the recipe's, as one mapping
        argv += ["--attn-kwargs", json.dumps({**recipe.attn_kwargs, **row.options})]
    return argv + ["--seed", str(seed), "--run-dir", str(run_dir)]


def expected_config(argv: list[str]) -> TrainConfig:
    """The config ``train.py argv`` trains with, its attention resolved as the run resolves it (as saved)."""
    config = resolve_config(argv)[0]
    resolve_attention(config)
    return config


def config_differences(saved: TrainConfig, expected: TrainConfig, ignored: tuple[str, ...] = ()) -> list[str]:
    """'key: saved -> expected' for every setting that changes what is trained (but ``ignored``)."""
    old, new = saved.to_dict(), expected.to_dict()
    skip = (*BOOKKEEPING_KEYS, *ignored)
    return [f"{key}: {old[key]!r} -> {new[key]!r}" for key in old if key not in skip and old[key] != new[key]]


def choose_action(run: Run, retrain: bool) -> tuple[str, str]:
    """(action, why): reuse a finished run of this config, resume a stopped one, or train afresh."""
    if retrain:
        return "train", "--retrain"
    config_file = run.run_dir / CONFIG_FILE
    if not config_file.is_file():
        return "train", "new"
    try:
        saved = make_config(read_yaml(config_file))
    except ConfigError as error:
        return "train", f"its saved config is unreadable here ({error})"
    # A later stage's initial_checkpoint names its previous stage's folder, however --run-root was spelled:
    # compared as that folder, and by whether it started after that stage last finished.
    ignored = ("initial_checkpoint",) if run.previous is not None else ()
    differences = config_differences(saved, expected_config(run.argv), ignored)
    if run.previous is not None and not starts_from(saved, run.previous):
        differences.append(f"initial_checkpoint: {saved.initial_checkpoint!r} -> {str(run.previous.run_dir)!r}")
    if differences:
        return "train", f"its config differs: {'; '.join(differences)}"
    if run.previous is not None and started_before(run, run.previous):
        return "train", "the stage it starts from finished again after it started"
    if (run.run_dir / SUMMARY_FILE).is_file():
        return "reuse", "finished with this config"
    if list_checkpoints(run.run_dir):
        return "resume", "stopped before the end, resumed from its last checkpoint"
    return "train", "no checkpoint to resume from"


def starts_from(saved: TrainConfig, previous: Run) -> bool:
    """Whether a saved config starts from ``previous``'s folder (its weights), however the path is spelled."""
    return (saved.initial_checkpoint is not None
            and Path(saved.initial_checkpoint).resolve() == previous.run_dir.resolve())


def started_before(run: Run, previous: Run) -> bool:
    """Whether ``run`` started (wrote its config) before ``previous`` last finished (wrote its summary)."""
    summary = previous.run_dir / SUMMARY_FILE
    return summary.is_file() and (run.run_dir / CONFIG_FILE).stat().st_mtime < summary.stat().st_mtime


def read_run(run: Run) -> None:
    """Fill ``run.summary`` and ``run.history`` from its run directory (status "finished")."""
    run.summary = json.loads((run.run_dir / SUMMARY_FILE).read_text())
    metrics = run.run_dir / METRICS_FILE
    run.history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    run.status = "finished"


def failure(returncode: int, log_text: str) -> str:
    """Why a train.py process failed: "out of memory" (its log, or killed by the kernel) or "failed"."""
    if returncode == SIGKILL_EXIT or OUT_OF_MEMORY.search(log_text):
        return "out of memory"
    return "failed"


def execute(run: Run) -> None:
    """Train (or resume) ``run`` in its own train.py process, its output in ``run.log``."""
    flag = "--resume" if run.action == "resume" else "--overwrite"
    command = [sys.executable, str(REPO / "train.py"), *run.argv, flag]
    run.log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(run.log, "w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    run.seconds = time.perf_counter() - started
    if result.returncode == 0 and (run.run_dir / SUMMARY_FILE).is_file():
        read_run(run)
    else:
        run.status = failure(result.returncode, run.log.read_text(errors="replace"))


def eta_seconds(runs: list[Run]) -> float | None:
    """Time the runs still to train should take: each at its row's mean time (of the same stage) in this
    invocation so far, or else the mean over all rows of its stage, or else over all runs (None before any
    run is timed)."""
    timed = [run for run in runs if run.seconds is not None]
    if not timed:
        return None
    per_row: dict[tuple[str, int | None], list[float]] = {}
    per_stage: dict[int | None, list[float]] = {}
    for run in timed:
        per_row.setdefault((run.row.text, run.stage), []).append(run.seconds)
        per_stage.setdefault(run.stage, []).append(run.seconds)
    overall = [run.seconds for run in timed]
    pending = [
        run for run in runs
        if run.action != "reuse" and run.seconds is None and run.status == "not run"
        and run.cause is run  # else it will not start
    ]
    return sum(
        statistics.fmean(per_row.get((run.row.text, run.stage)) or per_stage.get(run.stage) or overall)
        for run in pending
    )


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


# -- the table --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowResult:
    """A row's runs summed up over its seeds."""

    row: Row
    seeds: int  # runs asked for
    accs: list[float]  # test accuracy of each finished run
    images_per_s: float | None
    epoch_s: float | None
    peak_mem_mib: float | None
    status: str  # "yes", "no: out of memory", "failed", "not run yet"

    @property
    def count(self) -> int:
        return len(self.accs)


def epoch_seconds(history: list[dict[str, Any]]) -> float | None:
    """Median seconds per epoch, training plus the evaluation that ends it (``eval_time_s``, where recorded)."""
    times = [record["train_time_s"] + record.get("eval_time_s", 0.0) for record in history]
    return statistics.median(times) if times else None


def _median(values: list[float | None]) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def summarize_row(row: Row, runs: list[Run]) -> RowResult:
    finished = [run for run in runs if run.status == "finished"]
    statuses = {run.status for run in runs}
    if "out of memory" in statuses:
        status = "no: out of memory"
    elif "failed" in statuses:
        status = "failed"
    else:
        status = "yes" if finished else "not run yet"
    return RowResult(
        row=row, seeds=len(runs), accs=[run.summary["test_acc"] for run in finished],
        images_per_s=_median([run.summary["images_per_s"] for run in finished]),
        epoch_s=_median([epoch_seconds(run.history) for run in finished]),
        peak_mem_mib=_median([run.summary["peak_mem_mib"] for run in finished]),
        status=status,
    )


def summarize_rows(rows: list[Row], runs: list[Run]) -> list[RowResult]:
    return [summarize_row(row, [run for run in runs if run.row == row]) for row in rows]


def accuracy_cell(result: RowResult) -> str:
    if not result.accs:
        return "—"
    median = f"{100 * statistics.median(result.accs):.2f}%"
    if result.count == 1:
        return f"{median} (1)"
    return f"{median} [{100 * min(result.accs):.2f}–{100 * max(result.accs):.2f}] ({result.count})"


def _number(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _rate(value: float | None) -> str:
    """Images/s to three figures or more: a few images/s at high resolution on a CPU keep their decimals."""
    return _number(value, 0 if value is None or value >= 100 else 1 if value >= 10 else 2)


def markdown(results: list[RowResult], runs: list[Run], recipe: TrainConfig, command: str) -> str:
    finished = [run for run in runs if run.status == "finished"]
    mem_kinds = {run.summary["mem_kind"] for run in finished}
    on_gpu = mem_kinds == {"cuda_allocated"}
    rows_, cols_ = (side // recipe.patch_size for side in recipe.image_hw)
    tokens = f"{rows_ * cols_:,} tokens"
    timm = next((result for result in results if result.row.attn == TIMM_ATTENTION), None)
    reference = timm.images_per_s if timm is not None else None
    lines = [
        f"| attention | test accuracy, median [min–max] (seeds) | train images/s | s per epoch | "
        f"{'peak GPU memory' if on_gpu else 'peak memory'} (MiB) | speed-up over timm | runs at {tokens} |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        speedup = (
            f"{result.images_per_s / reference:.2f}×" if reference and result.images_per_s is not None else "—"
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
            f"| {result.row.label} | {accuracy_cell(result)} | {_rate(result.images_per_s)} | "
            f"{_number(result.epoch_s, 1)} | {_number(result.peak_mem_mib)} | {speedup} | {status} |"
        )
    memory = (
        "GPU memory allocated by tensors" if on_gpu
        else "on CPU the whole process's peak resident set, Python runtime and dataset included"
    )
    note = (
        f"`{command}`: {recipe.dataset} at {recipe.image_hw[0]}×{recipe.image_hw[1]} px, patch {recipe.patch_size} "
        f"({rows_}×{cols_} grid, {tokens}), {recipe.model} of width {recipe.embed_dim}, depth {recipe.depth}, "
        f"{recipe.num_heads} heads, {recipe.epochs} epoch{'s' if recipe.epochs != 1 else ''}{curriculum(runs)}; seeds "
        f"{', '.join(str(seed) for seed in sorted({run.seed for run in runs}))}. Test accuracy of the weights chosen on "
        "validation; images/s over the training steps and seconds per epoch (training and validation), each from "
        f"the run's own records, and peak memory ({memory}): medians over the seeds. Speed-up: images/s over "
        "the timm row's (timm's own Attention in the same ViT)."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


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


def plot(results: list[RowResult], runs: list[Run], path: Path) -> None:
    """Test accuracy per row (median, min-max range, each seed), and validation accuracy per epoch per row
    (median over seeds, min-max band)."""
    # Imported here to choose the file-only backend before pyplot loads (no display on a training node).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_acc, ax_curve) = plt.subplots(1, 2, figsize=(16, 0.45 * len(results) + 3))
    # tab20's dark shades, then its light ones, without its two greys (floor's): 18 colours before one
    # repeats, and neighbouring rows never in two shades of one hue
    tab20 = [color for index, color in enumerate(plt.get_cmap("tab20").colors) if index not in (14, 15)]
    colors = tab20[0::2] + tab20[1::2]
    palette = iter(colors * len(results))
    for index, result in enumerate(results):
        # the references as in visattn-bench's plots: timm black, floor grey and dashed
        color = {TIMM_ATTENTION: "black", "floor": "grey"}.get(result.row.attn) or next(palette)
        position = len(results) - 1 - index
        if result.accs:
            accs = [100 * acc for acc in result.accs]
            median = statistics.median(accs)
            ax_acc.errorbar(median, position, xerr=[[median - min(accs)], [max(accs) - median]], fmt="o",
                            color=color, capsize=4)
            ax_acc.scatter(accs, [position] * len(accs), color=color, alpha=0.4, s=14)
        curves = [run.history for run in runs if run.row == result.row and run.status == "finished"]
        if curves:
            split = "val" if "val_acc" in curves[0][0] else "test"
            epochs = sorted({record["epoch"] for history in curves for record in history})
            per_epoch = [[100 * r[f"{split}_acc"] for history in curves for r in history if r["epoch"] == e] for e in epochs]
            ax_curve.plot(epochs, [statistics.median(v) for v in per_epoch], marker=".", color=color,
                          label=result.row.label, linestyle="--" if result.row.attn == "floor" else "-")
            ax_curve.fill_between(epochs, [min(v) for v in per_epoch], [max(v) for v in per_epoch], color=color, alpha=0.15)
            ax_curve.set(ylabel=f"{split} accuracy (%)")
    ax_acc.set_yticks(range(len(results)), [result.row.label for result in reversed(results)])
    ax_acc.set(title="test accuracy (%)\nmedian, range over seeds, each seed", xlabel="test accuracy (%)")
    last = " (last stage)" if any(run.previous is not None for run in runs) else ""
    ax_curve.set(title=f"accuracy per epoch{last}\nmedian over seeds, range shaded", xlabel="epoch")
    ax_curve.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax_curve.lines:  # beside the curves, never over them
        ax_curve.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    for ax in (ax_acc, ax_curve):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


CSV_FIELDS = ("row", "attn", "options", "seed", "stage", "status", "test_acc", "best_acc", "best_epoch", "epochs",
              "images_per_s", "epoch_time_s", "peak_mem_mib", "mem_kind", "wall_time_s", "run_dir")


def run_record(run: Run) -> dict[str, Any]:
    summary = run.summary or {}
    return {
        "row": run.row.text, "attn": run.row.attn, "options": run.row.options, "seed": run.seed,
        "stage": run.stage, "status": run.status,
        **{key: summary.get(key) for key in ("test_acc", "best_acc", "best_epoch", "epochs", "images_per_s",
                                              "peak_mem_mib", "mem_kind", "wall_time_s")},
        "epoch_time_s": epoch_seconds(run.history), "run_dir": str(run.run_dir),
    }


def write_outputs(output: Path, results: list[RowResult], runs: list[Run], recipe: TrainConfig, command: str) -> str:
    """The markdown table, and the PNG, JSON and CSV beside it (with every earlier stage); returns the table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(results, runs, recipe, command)
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


# -- main -------------------------------------------------------------------------------------------
def run_folder(seed: int, stage: int | None = None) -> str:
    """A run's folder in its row's: ``seed<k>`` for the recipe's run, ``seed<k>-stage<i>`` for its i-th earlier
    stage."""
    return f"seed{seed}" if stage is None else f"seed{seed}-stage{stage}"


def plan(args: argparse.Namespace, train_args: list[str]) -> list[Run]:
    """Every (row, seed) run, with what to do with it; a config train.py would refuse stops here."""
    runs = []
    for seed in args.seeds:  # every row's first seed, then every row's second: a partial table has every row
        for row in args.rows:
            run_dir = Path(args.run_root) / row.folder / run_folder(seed)
            previous = None
            for number, stage_flags in enumerate(args.stage_flags, start=1):
                stage_dir = run_dir.with_name(run_folder(seed, number))
                start = [] if previous is None else ["--initial-checkpoint", str(previous.run_dir)]
                try:  # a ConfigError now rather than after hours of other rows
                    stage_argv = train_argv(args, train_args, row, seed, stage_dir, [*stage_flags, *start])
                    expected_config(stage_argv)
                except ConfigError as error:
                    raise ConfigError(f"in stage {number} (--stage {shlex.join(stage_flags)}): {error}") from None
                previous = Run(row, seed, stage_dir, stage_argv, stage=number, previous=previous, last=False)
            flags = ["--epochs", str(args.epochs)] if args.epochs is not None else []
            if previous is not None:
                flags += ["--initial-checkpoint", str(previous.run_dir)]
            run = Run(row, seed, run_dir, train_argv(args, train_args, row, seed, run_dir, flags),
                      stage=None if previous is None else previous.stage + 1, previous=previous)
            expected_config(run.argv)
            runs.append(run)
    return runs


def all_runs(runs: list[Run]) -> list[Run]:
    """Every train.py run, in the order they train: each run's earlier stages just before it."""
    return [each for run in runs for each in (*run.earlier, run)]


def run_name(run: Run) -> str:
    return f"{run.row.text} seed {run.seed}{'' if run.last else f' (stage {run.stage})'}"


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    try:
        runs = plan(args, train_args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    recipe = expected_config(runs[0].argv)
    command = shlex.join(["python", "scripts/accuracy_table.py", *(sys.argv[1:] if argv is None else argv)])
    every_run = all_runs(runs)
    for run in every_run:
        run.action, why = choose_action(run, args.retrain)
        if run.previous is not None and run.previous.action != "reuse" and run.action != "train":
            run.action, why = "train", "the stage it starts from is trained in this invocation"
        if run.action == "reuse":
            read_run(run)
        elif run.action == "train" and why != "new":
            print(f"{run_name(run)}: trained afresh: {why}", flush=True)
    todo = [run for run in every_run if run.action != "reuse"]
    print(f"{len(every_run)} runs: {len(every_run) - len(todo)} finished before, {len(todo)} to train "
          f"({sum(run.action == 'resume' for run in todo)} resumed)", flush=True)
    output = Path(args.output)
    for number, run in enumerate(todo, start=1):
        if run.cause is not run:
            run.status = run.cause.status
            outcome = "ran out of memory" if run.cause.status == "out of memory" else run.cause.status
            print(f"[{number}/{len(todo)}] {run_name(run)}: not started, its stage {run.cause.stage} {outcome}", flush=True)
            write_outputs(output, summarize_rows(args.rows, runs), runs, recipe, command)
            continue
        eta = eta_seconds(every_run)
        remaining = f"; all {len(todo) - number + 1} left: about {duration(eta)}" if eta is not None else ""
        verb = "resumed" if run.action == "resume" else "started"
        print(f"[{number}/{len(todo)}] {run_name(run)}: {verb}{remaining}", flush=True)
        execute(run)
        outcome = f"{100 * run.summary['test_acc']:.2f}%" if run.status == "finished" else f"{run.status}, see {run.log}"
        eta = eta_seconds(every_run)
        left = f"; {len(todo) - number} left: about {duration(eta)}" if number < len(todo) and eta is not None else ""
        print(f"[{number}/{len(todo)}] {run_name(run)}: {outcome} in {duration(run.seconds)}{left}", flush=True)
        write_outputs(output, summarize_rows(args.rows, runs), runs, recipe, command)  # a table so far, should it stop
    print(write_outputs(output, summarize_rows(args.rows, runs), runs, recipe, command))
    return 0 if all(run.status == "finished" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
