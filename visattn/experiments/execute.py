"""Each run of a grid reused, resumed or trained afresh, in its own ``train.py`` process, one or several at a
time, with a line each; the time the runs left should take."""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO

from visattn.experiments.plan import REPO, Row, Run, all_runs, expected_config, run_name
from visattn.experiments.summarize import read_run, started_from
from visattn.predict import BEST_WEIGHTS
from visattn.train import CONFIG_FILE, SUMMARY_FILE, ConfigError, TrainConfig, list_checkpoints, make_config, read_yaml

# Config keys that say where and how a run is kept, not what it trains: a run that differs only in them is reused.
BOOKKEEPING_KEYS = ("run_dir", "num_workers", "save_every", "keep_checkpoints", "log_with")
# What a run that ran out of memory leaves in its log (CPU allocator, CUDA, Python).
OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory|MemoryError", re.IGNORECASE)
SIGKILL_EXIT = -9  # what subprocess reports for a process the kernel's OOM killer ends


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
    # The weights a run starts from (a previous stage's, a transfer table's parent's) are compared as the folder
    # or file they are, however its path was spelled, and by whether the run started after the run that trained
    # them last finished: a run reached from weights since replaced is stale whatever its config.
    expected = expected_config(run.argv)
    differences = config_differences(saved, expected, ignored=("initial_checkpoint",))
    if not same_start(saved, expected):
        differences.append(f"initial_checkpoint: {saved.initial_checkpoint!r} -> {expected.initial_checkpoint!r}")
    if differences:
        return "train", f"its config differs: {'; '.join(differences)}"
    start = started_from(expected)
    if start is not None and started_before(run, start):
        what = "the stage it starts from" if run.previous is not None else f"the run it starts from ({start})"
        return "train", f"{what} finished again after it started"
    if (run.run_dir / SUMMARY_FILE).is_file():
        return "reuse", "finished with this config"
    if list_checkpoints(run.run_dir):
        return "resume", "stopped before the end, resumed from its last checkpoint"
    return "train", "no checkpoint to resume from"


def same_start(saved: TrainConfig, expected: TrainConfig) -> bool:
    """Whether two configs start from the same weights (or both from none), however their paths are spelled."""
    starts = saved.initial_checkpoint, expected.initial_checkpoint
    if None in starts:
        return starts == (None, None)
    return Path(starts[0]).resolve() == Path(starts[1]).resolve()


def started_before(run: Run, start: Path) -> bool:
    """Whether ``run`` started (wrote its config) before the run in ``start`` last finished (wrote its summary)."""
    summary = start / SUMMARY_FILE
    return summary.is_file() and (run.run_dir / CONFIG_FILE).stat().st_mtime < summary.stat().st_mtime


def failure(returncode: int, log_text: str) -> str:
    """Why a train.py process failed: "out of memory" (its log, or killed by the kernel) or "failed"."""
    if returncode == SIGKILL_EXIT or OUT_OF_MEMORY.search(log_text):
        return "out of memory"
    return "failed"


def run_train_process(command: list[str], log: IO[str]) -> subprocess.CompletedProcess:
    """Runs one train.py ``command`` to its end, its output and errors into ``log``."""
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)


def execute(run: Run) -> None:
    """Train (or resume) ``run`` in its own train.py process, its output in ``run.log``."""
    flag = "--resume" if run.action == "resume" else "--overwrite"
    command = [sys.executable, str(REPO / "train.py"), *run.argv, flag]
    run.log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(run.log, "w") as handle:
        result = run_train_process(command, log=handle)
    run.seconds = time.perf_counter() - started
    if result.returncode == 0 and (run.run_dir / SUMMARY_FILE).is_file():
        read_run(run)
    else:
        run.status = failure(result.returncode, run.log.read_text(errors="replace"))


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """A runner's flags for what :func:`run_grid` does with its runs: ``--retrain``, ``--tables-only``, ``--jobs``."""
    parser.add_argument("--retrain", action="store_true", help="train every run afresh, even a finished one")
    parser.add_argument("--tables-only", action="store_true",
                        help="write the tables from the runs that finished, training none (others read \"not run\")")
    parser.add_argument("--jobs", type=int, default=1,
                        help="train.py processes at a time, each a run whose earlier stages have ended (default: 1); "
                             "several small runs share one GPU, the first that CUDA_VISIBLE_DEVICES shows, and a run "
                             "that does not fit beside the others is reported out of memory")


def check_grid_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags of :func:`add_grid_arguments` that cannot go together or are out of range: the parser's error."""
    if args.tables_only and args.retrain:
        parser.error("--tables-only trains no run: leave out --retrain, or --tables-only to train")
    if args.jobs < 1:
        parser.error(f"--jobs: at least 1 process at a time, got {args.jobs}")


def run_grid(runs: list[Run], retrain: bool, write_tables: Callable[[], object], train: bool = True,
             jobs: int = 1) -> None:
    """Reuse, resume or train every run of ``runs`` and its earlier stages (:func:`choose_action`; a stage
    whose previous one trains in this invocation trains afresh too), ``jobs`` at a time in the order of the
    grid (a stage starts once the one before it has ended), with a line each as it starts and ends and the time
    the runs left should take; ``write_tables()`` after each, so that the tables so far stand should the
    invocation stop. Without ``train``: the tables of the runs that finished before, the others left as they
    are ("not run")."""
    every_run = all_runs(runs)
    if not train:
        tables_of_finished_runs(every_run, write_tables)
        return
    choose_actions(every_run, retrain)
    todo = [run for run in every_run if run.action != "reuse"]
    at_a_time = f", {jobs} at a time" if jobs > 1 else ""
    print(f"{len(every_run)} runs: {len(every_run) - len(todo)} finished before, {len(todo)} to train "
          f"({sum(run.action == 'resume' for run in todo)} resumed){at_a_time}", flush=True)
    train_in_order(every_run, todo, jobs, write_tables)


def tables_of_finished_runs(every_run: list[Run], write_tables: Callable[[], object]) -> None:
    """``--tables-only``: the runs that finished before read, none trained, a line saying how many, the tables."""
    for run in every_run:
        if choose_action(run, retrain=False)[0] == "reuse":
            read_run(run)
    finished = sum(run.status == "finished" for run in every_run)
    print(f"{len(every_run)} runs: {finished} finished, {len(every_run) - finished} not (--tables-only: none "
          "trained)", flush=True)
    write_tables()


def choose_actions(every_run: list[Run], retrain: bool) -> None:
    """Every run's ``action`` (:func:`choose_action`), a stage trained afresh where the stage it starts from is
    trained or where its finished parent lacks the weights it starts from; the reused runs read, and a line for
    each run trained afresh that is not new, saying why."""
    reasons = {}
    for run in every_run:
        run.action, reasons[id(run)] = choose_action(run, retrain)
        if run.previous is not None and run.previous.action != "reuse" and run.action != "train":
            run.action, reasons[id(run)] = "train", "the stage it starts from is trained in this invocation"
    # A finished stage copied without its weights (from another machine, say) is trained again where the next
    # stage, to be trained, starts from them; last stage first, so that a chain of such stages is all retrained.
    for run in reversed(every_run):
        previous = run.previous
        if run.action == "train" and previous is not None and previous.action == "reuse" and not (
                previous.run_dir / BEST_WEIGHTS).is_file():
            previous.action, reasons[id(previous)] = "train", (
                f"finished, but its {BEST_WEIGHTS}, which its next stage starts from, is not there")
    for run in every_run:
        if run.action == "reuse":
            read_run(run)
        elif run.action == "train" and reasons[id(run)] != "new":
            print(f"{run_name(run)}: trained afresh: {reasons[id(run)]}", flush=True)


def train_in_order(every_run: list[Run], todo: list[Run], jobs: int, write_tables: Callable[[], object]) -> None:
    """The runs of ``todo``, ``jobs`` at a time, each once its earlier stages have ended (one whose earlier stage
    failed is not started), with a line as each starts and ends and ``write_tables()`` after each."""
    number = {id(run): count for count, run in enumerate(todo, start=1)}
    pending, running = list(todo), {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            for run in [run for run in pending if stages_before_ended(run)]:
                if len(running) == jobs:
                    break
                pending.remove(run)
                tag = f"[{number[id(run)]}/{len(todo)}] {run_name(run)}"
                if run.cause is not run:
                    run.status = run.cause.status
                    outcome = "ran out of memory" if run.cause.status == "out of memory" else run.cause.status
                    print(f"{tag}: not started, its stage {run.cause.stage} {outcome}", flush=True)
                    write_tables()
                    continue
                eta = eta_seconds(every_run, jobs)
                left = len(pending) + len(running) + 1
                remaining = f"; all {left} left: about {duration(eta)}" if eta is not None else ""
                verb = "resumed" if run.action == "resume" else "started"
                print(f"{tag}: {verb}{remaining}", flush=True)
                running[start(pool, run, jobs)] = run
            if not running:
                if pending and not any(stages_before_ended(run) for run in pending):
                    raise RuntimeError(f"{run_name(pending[0])}: an earlier stage neither runs nor is to run")
                continue
            ended, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in ended:
                run = running.pop(future)
                outcome = ended_outcome(run, future)
                took = f" in {duration(run.seconds)}" if run.seconds is not None else ""
                eta, left = eta_seconds(every_run, jobs), len(pending) + len(running)
                after = f"; {left} left: about {duration(eta)}" if left and eta is not None else ""
                print(f"[{number[id(run)]}/{len(todo)}] {run_name(run)}: {outcome}{took}{after}", flush=True)
                write_tables()


def ended_outcome(run: Run, future: Future) -> str:
    """What the line of an ended run says of it: its test accuracy, else its status and log; a run whose
    train.py could not be started (its log not writable, say) is marked failed here."""
    if future.exception() is not None:
        run.status = "failed"
        return f"failed: {future.exception()}"
    if run.status == "finished":
        return f"{100 * run.summary['test_acc']:.2f}%"
    return f"{run.status}, see {run.log}"


def start(pool: ThreadPoolExecutor, run: Run, jobs: int) -> Future:
    """``execute(run)`` in a thread of ``pool``, or with one job at a time in this thread, done when it returns: an
    interrupt (Ctrl-C) then ends train.py as ``subprocess.run`` ends its process; with several, the runs are
    processes of this one's process group, which a Ctrl-C in its terminal ends together."""
    if jobs > 1:
        return pool.submit(execute, run)
    future: Future = Future()
    try:
        execute(run)
    except Exception as error:  # noqa: BLE001 - reported as the run's failure, as a thread's would be
        future.set_exception(error)
    else:
        future.set_result(None)
    return future


def stages_before_ended(run: Run) -> bool:
    """Whether every earlier stage of ``run`` has finished or failed (or will not start): it can start."""
    return all(stage.status != "not run" for stage in run.earlier)


def eta_seconds(runs: list[Run], jobs: int = 1) -> float | None:
    """Time the runs still to train should take, ``jobs`` at a time: each at its row's mean time (of the same
    stage and variant of the data) in this invocation so far, or else the mean over all rows of its stage, or
    else over all runs, their sum divided by ``jobs`` or by the runs left where fewer (None before any run is
    timed; the runs under way count in full)."""
    timed = [run for run in runs if run.seconds is not None]
    if not timed:
        return None
    per_row: dict[tuple[str | None, Row, int | None], list[float]] = {}
    per_stage: dict[int | None, list[float]] = {}
    for run in timed:
        per_row.setdefault((run.variant, run.row, run.stage), []).append(run.seconds)
        per_stage.setdefault(run.stage, []).append(run.seconds)
    overall = [run.seconds for run in timed]
    pending = [
        run for run in runs
        if run.action != "reuse" and run.seconds is None and run.status == "not run"
        and run.cause is run  # else it will not start
    ]
    return sum(
        statistics.fmean(per_row.get((run.variant, run.row, run.stage)) or per_stage.get(run.stage) or overall)
        for run in pending
    ) / max(1, min(jobs, len(pending)))


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
