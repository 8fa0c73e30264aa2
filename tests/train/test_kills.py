"""Kill a training run anywhere with SIGKILL, resume it, and get the uninterrupted run's results bit for bit.

Each scenario runs the recipe below (every source of randomness on: RandAugment, mixup and cutmix, drop
path; gradient accumulation) in a run directory, kills it at one or more points of its work
(:mod:`tests.train.kill_points`: mid-update, inside a checkpoint save, after the weights of an epoch, between
epochs, during evaluation, the final test and the plot, during the resume itself), then resumes it with
``--resume`` to the end. The resumed run's final and best weights, its last checkpoint (weights,
optimizer state, random states, trainer state), metrics, summary and list of files must equal those of
one uninterrupted run of the same seed: ``torch.equal`` on every tensor, ``==`` on every number but
times and memory. Each kill loses the updates since the newest checkpoint, at most ``--save-every``.

Every run, the uninterrupted one included, is ``train.main`` in a process forked from one server that
imported train.py once (:class:`tests.train.kill_points.RunServer`), with one CPU thread.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file

from tests.train.kill_points import KillPoint, RunServer, log_tail, run_to_end, stop_and_kill
from tests.train.test_train import TINY
from visattn.train import checkpoint as ckpt

pytestmark = pytest.mark.slow

SAVE_EVERY = 4
# 96 training digits in batches of 8, two per update: 12 batches, 6 updates an epoch, 18 in all.
# Checkpoints: updates 4 (mid-epoch 1), 6 (end of 1), 8 (mid-epoch 2), 12 (end of 2), 16 (mid-epoch 3), 18.
RECIPE = [
    *TINY, "--max-eval-samples", "32", "--batch-size", "8", "--grad-accum-steps", "2", "--epochs", "3",
    "--auto-augment", "rand-m9-mstd0.5-inc1-mmax9", "--mixup", "0.8", "--cutmix", "1.0", "--drop-path-rate", "0.2",
    "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "2",
]
FINAL = "step_00000018"
# Values that measure time or the process, not the training.
VARYING = {"train_time_s", "eval_time_s", "images_per_s", "peak_mem_mib", "wall_time_s", "partial_train_time"}

# scenario -> the kills in a row, each with the update the next run must resume from (the newest
# checkpoint complete when it was killed).
SCENARIOS: dict[str, list[tuple[KillPoint, int]]] = {
    "mid-epoch": [(KillPoint("update", 11), 8)],
    "save-half-written": [(KillPoint("save-files", 8), 6)],
    "save-sealed-not-renamed": [(KillPoint("save-sealed", 16), 12)],
    "last-save-pruning": [(KillPoint("save-prune", 18), 18)],
    "weights-written-checkpoint-not": [(KillPoint("weights-written", 6), 4)],
    "between-epochs": [(KillPoint("epoch-start", 12), 12)],
    "evaluation": [(KillPoint("eval", 12), 8)],
    "final-test": [(KillPoint("test", 18), 18)],
    "end-of-run-plot": [(KillPoint("plot", 18), 18)],
    "two-kills-in-a-row": [(KillPoint("update", 5), 4), (KillPoint("save-sealed", 8), 6)],
    "kills-during-the-resume": [
        (KillPoint("eval", 6), 4), (KillPoint("resume-verify"), 4), (KillPoint("resume-rewrote", 4), 4),
    ],
}
KILLS: list[tuple[str, int]] = []  # (kill point, updates lost) of every kill in the module


@pytest.fixture(scope="module")
def server() -> Iterator[RunServer]:
    runs = RunServer()
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def reference(server: RunServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("kills") / "whole"
    log = run_dir.with_suffix(".log")
    assert run_to_end(server, [*RECIPE, "--run-dir", str(run_dir)], log) == 0, log_tail(log)
    assert [c.name for c in ckpt.list_checkpoints(run_dir)] == ["step_00000016", FINAL]
    return run_dir


@pytest.fixture(scope="module", autouse=True)
def _report_lost_updates(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and KILLS:
        lost = sorted(count for _, count in KILLS)
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(f"kills: {len(KILLS)} kills at {len({where for where, _ in KILLS})} points; updates lost "
                                f"per kill {lost}, at most {max(lost)} (--save-every {SAVE_EVERY})")


def without_varying(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: without_varying(item) for key, item in value.items() if key not in VARYING}
    if isinstance(value, list):
        return [without_varying(item) for item in value]
    return value


def assert_identical(actual: Any, expected: Any, where: str) -> None:
    """Equal structure and values; tensors and arrays bit for bit (same dtype, shape and every element)."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (a, b) in enumerate(zip(actual, expected)):
            assert_identical(a, b, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), (
            f"{where}: tensors differ (largest difference {(actual.double() - expected.double()).abs().max().item():.3g})"
        )
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and np.array_equal(actual, expected), f"{where}: arrays differ"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def json_lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def files_of(run_dir: Path) -> list[str]:
    return sorted(path.relative_to(run_dir).as_posix() for path in run_dir.rglob("*"))


def assert_same_run(run_dir: Path, reference: Path) -> None:
    assert files_of(run_dir) == files_of(reference)  # no leftover of an interrupted save or prune
    for name in ("model_last.safetensors", "model_best.safetensors"):
        assert_identical(load_file(str(run_dir / name)), load_file(str(reference / name)), name)
    assert [c.name for c in ckpt.list_checkpoints(run_dir)] == [c.name for c in ckpt.list_checkpoints(reference)]
    ours, theirs = run_dir / "checkpoints" / FINAL, reference / "checkpoints" / FINAL
    assert_identical(load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors")),
                     f"{FINAL}/model.safetensors")
    assert_identical(torch.load(ours / "optimizer.bin", weights_only=True),
                     torch.load(theirs / "optimizer.bin", weights_only=True), f"{FINAL}/optimizer.bin")
    assert_identical(accelerate_load(ours / "random_states_0.pkl"), accelerate_load(theirs / "random_states_0.pkl"),
                     f"{FINAL}/random_states_0.pkl")
    for name in (f"checkpoints/{FINAL}/trainer_state.json", "summary.json"):
        actual, expected = json.loads((run_dir / name).read_text()), json.loads((reference / name).read_text())
        for record in (actual, expected):
            record.pop("sha256", None)  # trainer_state.json's checksum of itself, times included
        assert_identical(without_varying(actual), without_varying(expected), name)  # its files' checksums too
    assert_identical(without_varying(json_lines(run_dir / "metrics.jsonl")),
                     without_varying(json_lines(reference / "metrics.jsonl")), "metrics.jsonl")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_killed_run_resumes_to_the_uninterrupted_runs_weights(scenario, server, reference, tmp_path):
    run_dir = tmp_path / "run"
    argv = [*RECIPE, "--run-dir", str(run_dir)]
    resumes_from = None
    for attempt, (point, newest) in enumerate(SCENARIOS[scenario]):
        log = tmp_path / f"attempt{attempt}.log"
        held = stop_and_kill(server, argv + (["--resume"] if attempt else []), log, point)
        if resumes_from is not None and point.where != "resume-verify":  # it got past loading its checkpoint
            assert f"resumed from {run_dir / 'checkpoints' / resumes_from}" in log.read_text(), log_tail(log)
        # what the kill left: every checkpoint complete and verified, the newest the one expected
        checkpoints = ckpt.list_checkpoints(run_dir)
        for checkpoint in checkpoints:
            ckpt.verify_checkpoint(checkpoint)
        assert ckpt.checkpoint_update(checkpoints[-1]) == newest, [c.name for c in checkpoints]
        lost = held - newest
        assert 0 <= lost <= SAVE_EVERY, f"killed at {point} holding {held} updates, newest checkpoint {newest}"
        KILLS.append((point.where, lost))
        resumes_from = checkpoints[-1].name

    log = tmp_path / "resumed.log"
    assert run_to_end(server, [*argv, "--resume"], log) == 0, log_tail(log)
    text = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / resumes_from}" in text, log_tail(log)
    assert "warning" not in text, log_tail(log)  # no checkpoint was skipped: none was damaged
    assert_same_run(run_dir, reference)


def test_a_run_killed_before_its_first_checkpoint_is_started_over(server, reference, tmp_path):
    """Killed while its first checkpoint is written (sealed, not yet in place): nothing to resume, and
    --resume says so in one line; started over with --overwrite it ends as the uninterrupted run."""
    run_dir = tmp_path / "run"
    argv = [*RECIPE, "--run-dir", str(run_dir)]
    held = stop_and_kill(server, argv, tmp_path / "killed.log", KillPoint("save-sealed", SAVE_EVERY))
    assert ckpt.list_checkpoints(run_dir) == []
    KILLS.append(("save-sealed", held))
    log = tmp_path / "refused.log"
    assert run_to_end(server, [*argv, "--resume"], log) == 2
    assert log.read_text().strip() == (
        f"error: nothing to resume: {run_dir} holds a run without a complete checkpoint. Start it without --resume "
        "(add --overwrite to replace it)."
    )
    log = tmp_path / "again.log"
    assert run_to_end(server, [*argv, "--overwrite"], log) == 0, log_tail(log)
    assert_same_run(run_dir, reference)
