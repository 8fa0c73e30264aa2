"""The grid of an accuracy table: rows (attention types with options) x seeds x curriculum stages (x variants of
the data), each a ``train.py`` run with the flags train.py reads."""
from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import visattn
from visattn.experiments.variants import Variant
from visattn.layers.options import parse_key_values
from visattn.models import TIMM_ATTENTION
from visattn.train import ConfigError, TrainConfig, build_parser, resolve_attention, resolve_config

# The source checkout: train.py and configs/ live there.
REPO = Path(__file__).resolve().parents[2]
# train.py flags the table sets for each run; they cannot also come after --.
TABLE_FLAGS = ("--attn", "--attn-kwargs", "--seed", "--run-dir", "--resume", "--resume-from", "--overwrite")
# ... and, in a --stage, the weights it starts from: the previous stage's (the first stage's can come after --).
STAGE_FLAGS = (*TABLE_FLAGS, "--initial-checkpoint")


@dataclass(frozen=True)
class Row:
    """One row of the table: an attention type (or ``timm``) with the options its text gives."""

    text: str  # as given: "linear" or "linear:dwconv_kernel=null"
    attn: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    train_flags: tuple[str, ...] = ()  # train.py flags of this row alone, after the table's (a transfer table's)

    @property
    def label(self) -> str:
        return self.attn if not self.options else f"{self.attn} ({self.text.partition(':')[2]})"

    @property
    def folder(self) -> str:
        """The row's folder under the run root: its text with ':' and ',' (and anything unsafe) as '+'."""
        return re.sub(r"[^\w.=-]+", "+", self.text)


def split_at_separator(argv: list[str]) -> tuple[list[str], list[str]]:
    """(a runner's own words, the train.py words after ``--``) of its command line."""
    if "--" not in argv:
        return list(argv), []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


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


def run_folder(seed: int, stage: int | None = None) -> str:
    """A run's folder in its row's: ``seed<k>`` for the recipe's run, ``seed<k>-stage<i>`` for its i-th earlier
    stage."""
    return f"seed{seed}" if stage is None else f"seed{seed}-stage{stage}"


def flag_names(words: list[str]) -> set[str]:
    """The flags among train.py ``words``, with any ``=VALUE`` cut off (``--epochs=4`` -> ``--epochs``)."""
    return {word.partition("=")[0] for word in words}


def train_flags_problem(words: list[str]) -> str | None:
    """Why train.py would not take ``words`` as its flags (None if it would), abbreviations refused: the table
    recognises the flags it sets by their full names."""
    train_parser = build_parser()
    train_parser.exit_on_error = False
    train_parser.allow_abbrev = False
    try:
        unknown = train_parser.parse_known_args(words)[1]
    except argparse.ArgumentError as error:  # a flag without its value
        return str(error)
    return f"not train.py flags: {' '.join(unknown)} (python train.py --help lists them, in full)" if unknown else None


def stage_words(text: str, fail: Callable[[str], NoReturn]) -> list[str]:
    """The train.py flags of one ``--stage`` word; ``fail(problem)``, which does not return, for a word that
    train.py would not take or that sets what the table sets itself."""
    example = 'give train.py flags in one quoted word, as "--img-size 64 --epochs 4"'
    try:
        words = shlex.split(text)
    except ValueError as error:
        fail(f"{error}; {example}")
    if not words:
        fail(f"empty; {example}")
    taken = sorted(flag_names(words) & set(STAGE_FLAGS))
    if taken:
        fail(f"{', '.join(taken)} set by the table for each stage; {example}")
    problem = train_flags_problem(words)
    if problem:
        fail(problem if problem.startswith("not train.py flags") else f"{problem}; {example}")
    return words


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
    variant: str | None = None  # with --variants: the name of the variant of the data it trains on
    num_classes: int | None = None  # of its model, once finished (from its model.json)

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


@dataclass(frozen=True)
class Grid:
    """What an accuracy table trains: its recipe, rows, seeds and stages, and the flags for every run."""

    config: str  # the recipe's YAML file
    rows: list[Row]
    seeds: list[int]
    run_root: Path
    epochs: int | None = None  # the last stage's epochs, over the recipe's
    stage_flags: list[list[str]] = field(default_factory=list)  # each earlier stage's train.py flags
    train_args: list[str] = field(default_factory=list)  # the words after --, to every run
    variants: list[Variant] = field(default_factory=list)  # each a table of its own; none: the recipe's data


def train_argv(grid: Grid, row: Row, seed: int, run_dir: Path, stage: list[str],
               variant: Variant | None = None) -> list[str]:
    """train.py's arguments for ``row`` and ``seed``: the recipe, the arguments after --, the stage's own
    (its ``--stage`` flags and starting weights, or the last stage's ``--epochs``), the variant's dataset options
    laid over the recipe's, then the table's (the row's own flags among them). ConfigError for a variant of another dataset than the recipe's."""
    argv = ["--config", grid.config, *grid.train_args, *stage]
    if variant is not None:
        recipe = resolve_config(argv)[0]
        if recipe.dataset != variant.dataset:
            raise ConfigError(f"--variants {variant.name}: a variant of {variant.dataset}, but the recipe trains on "
                              f"{recipe.dataset}")
        argv += ["--dataset-kwargs", json.dumps({**recipe.dataset_kwargs, **variant.dataset_kwargs})]
    argv += ["--attn", row.attn]
    if row.options:
        recipe = resolve_config(argv)[0]  # the row's options over the recipe's, as one mapping
        argv += ["--attn-kwargs", json.dumps({**recipe.attn_kwargs, **row.options})]
    return argv + [*row.train_flags, "--seed", str(seed), "--run-dir", str(run_dir)]


def expected_config(argv: list[str]) -> TrainConfig:
    """The config ``train.py argv`` trains with, its attention resolved as the run resolves it (as saved)."""
    config = resolve_config(argv)[0]
    resolve_attention(config)
    return config


def plan(grid: Grid) -> list[Run]:
    """Every (row, seed) run, each with its earlier stages, and with variants every (variant, row, seed) run in
    ``<run_root>/<variant>``; a config train.py would refuse stops here (ConfigError)."""
    runs = []
    # every row's first seed, then every row's second (with variants: every variant's rows): a partial table
    # has every row
    for seed in grid.seeds:
        for variant in grid.variants or [None]:
            root = grid.run_root if variant is None else grid.run_root / variant.name
            name = None if variant is None else variant.name
            for row in grid.rows:
                run_dir = root / row.folder / run_folder(seed)
                previous = None
                for number, stage_flags in enumerate(grid.stage_flags, start=1):
                    stage_dir = run_dir.with_name(run_folder(seed, number))
                    start = [] if previous is None else ["--initial-checkpoint", str(previous.run_dir)]
                    try:  # a ConfigError now rather than after hours of other rows
                        stage_argv = train_argv(grid, row, seed, stage_dir, [*stage_flags, *start], variant)
                        expected_config(stage_argv)
                    except ConfigError as error:
                        raise ConfigError(f"in stage {number} (--stage {shlex.join(stage_flags)}): {error}") from None
                    previous = Run(row, seed, stage_dir, stage_argv, stage=number, previous=previous, last=False,
                                   variant=name)
                flags = ["--epochs", str(grid.epochs)] if grid.epochs is not None else []
                if previous is not None:
                    flags += ["--initial-checkpoint", str(previous.run_dir)]
                run = Run(row, seed, run_dir, train_argv(grid, row, seed, run_dir, flags, variant),
                          stage=None if previous is None else previous.stage + 1, previous=previous, variant=name)
                expected_config(run.argv)
                runs.append(run)
    return runs


def all_runs(runs: list[Run]) -> list[Run]:
    """Every train.py run, in the order they train: each run's earlier stages just before it."""
    return [each for run in runs for each in (*run.earlier, run)]


def run_name(run: Run) -> str:
    variant = "" if run.variant is None else f"{run.variant}: "
    flags = f" ({shlex.join(run.row.train_flags)})" if run.row.train_flags else ""
    return f"{variant}{run.row.text}{flags} seed {run.seed}{'' if run.last else f' (stage {run.stage})'}"
