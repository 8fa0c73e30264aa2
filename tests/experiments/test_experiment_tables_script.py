"""scripts/experiment_tables.sh: the runners' commands it runs, in what order, and the tables it writes at the end,
with a stand-in Python that records its arguments instead of training."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "experiment_tables.sh"
CONFIG = "configs/cluttered-digits-maxpool-1024tok.yaml"


def run_script(tmp_path: Path, seconds: int = 0, exit_status: int = 0, **env: str
               ) -> tuple[list[str], subprocess.CompletedProcess]:
    """The script's Python commands, one line each (a command's arguments joined by spaces), in the order run, and
    the script's process; each training command of the stand-in takes ``seconds`` and exits ``exit_status``."""
    log = tmp_path / "commands.log"
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  "- "*) cat > /dev/null; exit 0 ;;  # the generated sets: the script's own Python, on stdin
  *--tables-only*) exit 0 ;;
esac
sleep {seconds}
exit {exit_status}
""")
    python.chmod(0o755)
    environment = {**os.environ, "PYTHON": str(python), "TABLES": str(tmp_path / "tables"),
                   "RUNS": str(tmp_path / "runs"), **env}
    process = subprocess.run(["bash", str(SCRIPT), "--max-train-samples", "8"], cwd=tmp_path, env=environment,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True)
    return (log.read_text().splitlines() if log.is_file() else []), process


def test_every_table_trains_then_is_written_from_its_runs_in_the_order_each_needs(tmp_path):
    lines, process = run_script(tmp_path, JOBS="2", SEEDS="0 1")
    assert process.returncode == 0
    runs, tables = tmp_path / "runs", tmp_path / "tables"
    assert lines[0] == f"- {CONFIG} variants"  # the generated sets, the variants' too, drawn before any run starts
    training, written = lines[1:-4], lines[-4:]
    parents = next(line for line in training if "--attn softmax --output" in line)
    assert parents.startswith(f"-m visattn.experiments.accuracy --config {CONFIG} --stage --img-size 64 --epochs 8 "
                              f"--seeds 0 1 --run-root {runs}/maxpool-types --attn softmax ")
    assert parents.endswith("--jobs 2 -- --max-train-samples 8")
    transfers = [line for line in training if line.startswith("-m visattn.experiments.transfer")]
    assert len(transfers) == 2 and all(line.endswith("--jobs 2 -- --max-train-samples 8") or
                                       line.endswith("--jobs 2 -- --img-size 128 --max-train-samples 8")
                                       for line in transfers)
    # the transfer tables start from the parents: after them, in the same lane
    assert all(training.index(line) > training.index(parents) for line in transfers)
    assert any(f"--parent {runs}/maxpool-types/softmax/seed0 {runs}/maxpool-types/softmax/seed1 --seeds 0 1" in line
               for line in transfers)
    assert any(f"--parent {runs}/maxpool-types/softmax/seed0-stage1 {runs}/maxpool-types/softmax/seed1-stage1" in line
               for line in transfers)
    assert any("--stage --img-size 64 --epochs 16" in line and "--variants tuning held-out" in line for line in training)
    assert len(training) == 5
    # the tables, each by its runner's command with --tables-only, from every run that finished
    assert [line.split(" --output ")[1].split()[0] for line in written] == [
        f"{tables}/cluttered-digits-maxpool-types.md", f"{tables}/transfer-maxpool.md",
        f"{tables}/transfer-maxpool-64-to-128.md", f"{tables}/cluttered-digits-maxpool-axial16.md",
    ]
    assert all("--tables-only" in line and "--jobs" not in line for line in written)
    assert "--attn softmax linear linear:dwconv_kernel=null axial neighborhood sparse" in written[0]


@pytest.mark.parametrize("only, sets, first_words", [
    ("axial", f"- {CONFIG} variants", ["-m visattn.experiments.accuracy"]),
    ("transfer", f"- {CONFIG}", ["-m visattn.experiments.accuracy", "-m visattn.experiments.transfer"]),
])
def test_only_trains_the_tables_named_and_what_they_start_from(tmp_path, only, sets, first_words):
    """... and draws only the generated sets those read: the variants' for the axial table alone."""
    lines, process = run_script(tmp_path, ONLY=only)
    assert process.returncode == 0
    assert lines[0] == sets
    training, written = lines[1:-1], lines[-1:]
    assert [line[:len(first)] for line, first in zip(training, first_words)] == first_words
    assert len(training) == len(first_words)
    if only == "transfer":
        assert "--attn softmax --output" in training[0]  # its parents
    assert "--tables-only" in written[0] and only in written[0].split(" --output ")[1]


def test_at_the_limit_the_runners_stop_and_the_tables_are_still_written(tmp_path):
    started = time.monotonic()
    lines, process = run_script(tmp_path, seconds=60, LIMIT="2", SEEDS="0")
    assert time.monotonic() - started < 30  # not the 60 s each stand-in runner would take
    assert process.returncode == 0, process.stderr
    assert "types: stopped at the limit of 2 s; the same command resumes its runs" in process.stdout
    assert "transfer: not started, the limit of 2 s has passed" in process.stdout  # its parents were stopped
    assert sum("--tables-only" in line for line in lines) == 4


def test_a_runner_that_fails_fails_the_script_and_the_tables_are_still_written(tmp_path):
    lines, process = run_script(tmp_path, exit_status=3, ONLY="axial")
    assert process.returncode == 1
    assert "axial: exit 3" in process.stderr
    assert "--tables-only" in lines[-1]


@pytest.mark.parametrize("setting, message", [
    ({"ONLY": "axial typo"}, "ONLY: unknown table 'typo'; accepted: types transfer resolution axial"),
    ({"LIMIT": "10m"}, "LIMIT: whole seconds (0: no limit), got '10m'"),
    ({"JOBS": "0"}, "JOBS: runs at a time, at least 1, got '0'"),
])
def test_a_bad_setting_is_refused_in_one_line_before_anything_runs(tmp_path, setting, message):
    lines, process = run_script(tmp_path, **setting)
    assert (process.returncode, process.stderr.strip(), lines) == (2, message, [])
