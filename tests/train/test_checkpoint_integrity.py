"""Checkpoints that were damaged, swapped for hostile pickles, or written by two runs at once.

One short run (module fixture) gives checkpoints at updates 4, 6, 8 and 12; each test damages a copy.
Most cases call :func:`verify_checkpoint` directly; a few resume end to end and compare the final
weights with the undamaged run's.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_train import ENV, REPO, TINY, TRAIN, run_train
import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.predict import load_trained_model
from visattn.train import checkpoint as ckpt
from visattn.train.checkpoint import CheckpointError, RunDirError, RunLock, verify_checkpoint
from visattn.train.build import build_optimizer
from visattn.train.config import ConfigError, make_config, read_yaml


# What accelerate's save_state writes for this run (one process, fp32: no scaler.pt; timm's scheduler
# and the plain DataLoader sampler are not registered, so no scheduler.bin or sampler.bin), and ours.
CHECKPOINT_FILES = ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "trainer_state.json")
DAMAGES = ("truncated", "zero-bytes", "flipped-header", "flipped-data", "deleted")
RECIPE = [*TINY, "--save-every", "4", "--keep-checkpoints", "4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with checkpoints step_4 (mid-epoch 1), step_6, step_8 (mid-epoch 2) and step_12."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    result = run_train(*RECIPE, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [c.name for c in ckpt.list_checkpoints(run_dir)] == [
        "step_00000004", "step_00000006", "step_00000008", "step_00000012"
    ]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000012").iterdir()) == sorted(CHECKPOINT_FILES)
    return run_dir


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def step(run_dir: Path, update: int) -> Path:
    return run_dir / "checkpoints" / f"step_{update:08d}"


def damage(path: Path, how: str) -> None:
    """Damage one file the way a disk, a copy or a killed writer does."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zero-bytes":
        path.write_bytes(b"")
    elif how in ("flipped-header", "flipped-data"):
        # the header: the first 64 bytes (safetensors' length and JSON, the zip's first entry, the JSON's
        # start); the data: 64 bytes in the middle of the file, past every header
        start = 0 if how == "flipped-header" else len(data) // 2
        for i in range(start, start + 64):
            data[i] ^= 0xFF
        path.write_bytes(data)
    else:
        path.unlink()


def reseal(checkpoint: Path) -> None:
    """Rewrite trainer_state.json with the sizes and checksums of the files as they are now: what an
    attacker who swaps a file and knows the format would do. The checksums no longer protect; the
    loaders must."""
    path = checkpoint / "trainer_state.json"
    record = json.loads(path.read_text())
    record.pop("sha256")
    record["files"] = {
        name: dict(bytes=(checkpoint / name).stat().st_size,
                   sha256=hashlib.sha256((checkpoint / name).read_bytes()).hexdigest())
        for name in record["files"] if (checkpoint / name).exists()
    }
    record["sha256"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(record))


class RunsCode:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_hostile(path: Path, marker: Path) -> None:
    torch.save({"state": RunsCode(marker)}, path)


def one_line_error(text: str) -> str:
    """The single ``error:`` line a refused run prints (beside its progress bar); fails on a traceback
    or several lines."""
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip() and not re.match(r"epoch \d+/\d+: .*\|", line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (the run lock aside) with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ckpt.LOCK_FILE}


# -- item: damaged and missing files, verified directly ----------------------------------------
EXPECTED_PROBLEM = {
    "truncated": "truncated", "zero-bytes": "zero bytes", "flipped-header": "checksum mismatch",
    "flipped-data": "checksum mismatch", "deleted": "missing",
}


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_every_damage_to_every_file_is_named_in_one_line(name, how, trained, tmp_path):
    checkpoint = tmp_path / "step_00000012"
    shutil.copytree(step(trained, 12), checkpoint)
    assert verify_checkpoint(checkpoint)["update"] == 12
    damage(checkpoint / name, how)
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(checkpoint)
    error = caught.value
    assert error.file == checkpoint / name and "\n" not in str(error)
    expected = EXPECTED_PROBLEM[how]
    if name == "trainer_state.json" and how.startswith("flipped"):
        expected = "damaged (not valid JSON"  # flipped bytes are no longer UTF-8 JSON; see the next test
    assert error.problem.startswith(expected), error.problem


def test_a_changed_value_in_trainer_state_that_still_parses_is_a_checksum_mismatch(trained, tmp_path):
    checkpoint = tmp_path / "step_00000012"
    shutil.copytree(step(trained, 12), checkpoint)
    path = checkpoint / "trainer_state.json"
    path.write_text(path.read_text().replace('"update": 12', '"update": 13'))
    with pytest.raises(CheckpointError, match="trainer_state.json: checksum mismatch"):
        verify_checkpoint(checkpoint)


def test_a_file_the_save_did_not_write_is_refused(trained, tmp_path):
    # accelerate reads pytorch_model.bin (a full pickle) when model.safetensors is absent
    checkpoint = tmp_path / "step_00000012"
    shutil.copytree(step(trained, 12), checkpoint)
    (checkpoint / "pytorch_model.bin").write_bytes(b"extra")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: not written by this checkpoint's save"):
        verify_checkpoint(checkpoint)


# -- damaged files, resumed end to end ---------------------------------------------------------
def test_resume_skips_a_checkpoint_with_flipped_optimizer_data_and_ends_with_the_same_weights(run_copy, trained):
    damage(step(run_copy, 12) / "optimizer.bin", "flipped-data")
    result = run_train(*RECIPE, "--run-dir", str(run_copy), "--resume", "--keep-checkpoints", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: skipping checkpoint {step(run_copy, 12)}: optimizer.bin checksum mismatch "
                        "(its bytes changed after they were written)"]
    assert f"resumed from {step(run_copy, 8)} " in result.stdout
    final, expected = load_file(str(run_copy / "model_last.safetensors")), load_file(str(trained / "model_last.safetensors"))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    # keep 2: step_12 was rewritten and verified before anything older went; both kept ones verify
    kept = ckpt.list_checkpoints(run_copy)
    assert [c.name for c in kept] == ["step_00000008", "step_00000012"]
    assert [verify_checkpoint(c)["update"] for c in kept] == [8, 12]


def test_resume_falls_back_past_a_deleted_model_and_missing_random_states(run_copy, trained):
    damage(step(run_copy, 12) / "model.safetensors", "deleted")
    damage(step(run_copy, 8) / "random_states_0.pkl", "deleted")
    result = run_train(*RECIPE, "--run-dir", str(run_copy), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping checkpoint {step(run_copy, 12)}: model.safetensors missing\n" in result.stdout
    assert f"skipping checkpoint {step(run_copy, 8)}: random_states_0.pkl missing\n" in result.stdout
    assert "pytorch_model.bin" not in result.stdout + result.stderr
    assert f"resumed from {step(run_copy, 6)} " in result.stdout
    final, expected = load_file(str(run_copy / "model_last.safetensors")), load_file(str(trained / "model_last.safetensors"))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_resume_stops_with_one_line_when_no_checkpoint_verifies(run_copy, capsys):
    for update, name, how in ((4, "trainer_state.json", "truncated"), (6, "optimizer.bin", "zero-bytes"),
                              (8, "random_states_0.pkl", "flipped-header"), (12, "model.safetensors", "truncated")):
        damage(step(run_copy, update) / name, how)
    before = snapshot(run_copy)
    assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume"]) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(f"error: no checkpoint in {run_copy / 'checkpoints'} can be resumed (step_00000012: "
                           "model.safetensors truncated (12660 of 25320 bytes); ")
    assert "step_00000004: trainer_state.json truncated" in line
    assert snapshot(run_copy) == before  # nothing deleted, nothing started from scratch


def test_resume_from_picks_a_checkpoint_by_hand_and_verifies_it(run_copy, capsys):
    damage(step(run_copy, 6) / "optimizer.bin", "flipped-data")
    assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume-from", "step_00000006"]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"error: cannot resume from {step(run_copy, 6)}: optimizer.bin checksum mismatch "
        "(its bytes changed after they were written)"
    )
    assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume-from", "/elsewhere/step_00000001"]) == 2
    assert "not a checkpoint of" in one_line_error(capsys.readouterr().err)
    # the newest is fine, but the one asked for is used
    assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume-from", str(step(run_copy, 4))]) == 0
    assert f"resumed from {step(run_copy, 4)} (epoch 1, batch 4, update 4)" in capsys.readouterr().out


# -- hostile files -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_a_hostile_pickle_in_place_of_any_file_is_refused_even_with_matching_checksums(name, trained, tmp_path):
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "step_00000012"
    shutil.copytree(step(trained, 12), checkpoint)
    write_hostile(checkpoint / name, marker)
    if name != "trainer_state.json":
        with pytest.raises(CheckpointError, match=r"truncated|size changed|checksum mismatch"):
            verify_checkpoint(checkpoint)  # the swap alone is caught before anything reads the file
        reseal(checkpoint)
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(checkpoint)
    error = caught.value
    assert error.file == checkpoint / name and "\n" not in str(error) and "weights_only" not in str(error)
    expected = {
        "model.safetensors": "not a readable safetensors file",
        "optimizer.bin": "refused: unpickling it would call posix.system",
        "random_states_0.pkl": "refused: unpickling it would call posix.system",
        "trainer_state.json": "damaged (not valid JSON",
    }[name]
    assert error.problem.startswith(expected), error.problem
    assert not marker.exists()


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl"])
def test_resume_refuses_hostile_resealed_checkpoints_in_one_line(name, run_copy, tmp_path, capsys):
    marker = tmp_path / "pwned"
    for checkpoint in ckpt.list_checkpoints(run_copy):
        write_hostile(checkpoint / name, marker)
        reseal(checkpoint)
    assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume"]) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert f"step_00000012: {name} refused: unpickling it would call posix.system" in line
    assert captured.out.count("warning: skipping checkpoint") == 4
    assert not marker.exists()


def test_accelerate_restores_the_random_states_it_is_given_or_resume_says_so(trained, tmp_path):
    # accelerate's load_state ignores a random-state file it cannot apply; load_checkpoint checks
    from accelerate import Accelerator

    checkpoint = tmp_path / "step_00000012"
    shutil.copytree(step(trained, 12), checkpoint)
    accelerator = Accelerator(cpu=True)
    model = load_trained_model(trained, "last").train()
    optimizer = build_optimizer(make_config(read_yaml(trained / "config.yaml")), model)  # its two parameter groups
    model, optimizer = accelerator.prepare(model, optimizer)
    state = verify_checkpoint(checkpoint)
    assert ckpt.load_checkpoint(accelerator, checkpoint, state)["update"] == 12
    states = torch.load(checkpoint / "random_states_0.pkl", weights_only=False)
    assert torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
    torch.save({**states, "torch_manual_seed": states["torch_manual_seed"][:10]}, checkpoint / "random_states_0.pkl")
    with pytest.raises(RunDirError, match="random_states_0.pkl: accelerate did not restore the random states"):
        ckpt.load_checkpoint(accelerator, checkpoint, state)


def test_load_trained_model_and_config_reading_refuse_hostile_files(trained, tmp_path):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    write_hostile(run_dir / "model_best.safetensors", marker)
    with pytest.raises(ValueError, match="model_best.safetensors: not a readable safetensors file") as caught:
        load_trained_model(run_dir, "best")
    assert "\n" not in str(caught.value)
    write_hostile(run_dir / "model.json", marker)
    with pytest.raises(ValueError, match="model.json is not valid JSON") as caught:
        load_trained_model(run_dir, "last")
    assert "\n" not in str(caught.value)

    (run_dir / "config.yaml").write_text(f'lr: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match=r"config.yaml: not valid YAML at line 1, column 5: could not determine "
                                          r"a constructor for the tag") as caught:
        read_yaml(run_dir / "config.yaml")
    assert "\n" not in str(caught.value)
    write_hostile(run_dir / "config.yaml", marker)
    with pytest.raises(ConfigError, match="config.yaml: not a YAML text file"):
        read_yaml(run_dir / "config.yaml")
    assert not marker.exists()


# -- concurrent and interrupted writers ----------------------------------------------------------
def test_a_second_lock_on_a_run_directory_is_refused_naming_the_owner(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunDirError) as caught:
            RunLock(tmp_path / "run")
        assert f"is in use by a run still going (PID {os.getpid()} on " in str(caught.value)
    with RunLock(tmp_path / "run"):  # released: free again, without a notice
        pass
    assert (tmp_path / "run" / ckpt.LOCK_FILE).read_text() == ""


def test_a_stale_lock_of_a_killed_process_is_taken_over_with_a_notice(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from visattn.train.checkpoint import RunLock;"
         f"lock = RunLock(Path({str(run_dir)!r})); print('locked', flush=True); time.sleep(60)"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirError, match=f"PID {holder.pid} on"):
        RunLock(run_dir)
    holder.kill()
    holder.wait()
    notices = []
    with RunLock(run_dir, notice=notices.append):
        assert notices == [f"notice: taking over {run_dir / ckpt.LOCK_FILE} from PID {holder.pid} on "
                           f"{os.uname().nodename}, which no longer runs (a killed run)"]


def _wait_for(condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _lock_owner(run_dir: Path) -> int | None:
    try:
        text = (run_dir / ckpt.LOCK_FILE).read_text()
    except FileNotFoundError:
        return None
    return json.loads(text)["pid"] if text else None


def test_resume_or_overwrite_into_a_running_run_is_refused_and_the_run_finishes_intact(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = [*TINY, "--epochs", "10", "--save-every", "2"]
    running = subprocess.Popen([sys.executable, str(TRAIN), *recipe, "--run-dir", str(run_dir)], cwd=REPO, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: ckpt.list_checkpoints(run_dir) or running.poll() is not None, "a first checkpoint")
        assert running.poll() is None, running.communicate()[0][-3000:]
        for flag in ("--resume", "--overwrite"):
            assert train.main([*recipe, "--run-dir", str(run_dir), flag]) == 2
            line = one_line_error(capsys.readouterr().err)
            assert line.startswith(f"error: {run_dir} is in use by a run still going (PID {running.pid} on "), line
        assert running.poll() is None, "the refused runs must not stop the one that is going"
    finally:
        output = running.communicate(timeout=300)[0]
    assert running.returncode == 0, output[-3000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == list(range(1, 11))
    assert all(verify_checkpoint(c) for c in ckpt.list_checkpoints(run_dir))


def test_two_runs_started_into_one_directory_one_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    runs = [subprocess.Popen([sys.executable, str(TRAIN), *TINY, "--epochs", "1", "--max-train-samples", "32", "--run-dir", str(run_dir)],
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(*run.communicate(timeout=300),) for run in runs]
    results = [(run.returncode, out, err) for run, (out, err) in zip(runs, results)]
    # one trains; the other is refused, or, when it starts after the first has finished, finds that run finished
    # with these very settings and says so (exit 0, the line a repeated command prints): never two trainings
    found_finished = [r for r in results if r[0] == 0 and "holds this run, finished" in r[1]]
    if found_finished:
        (trained,) = [r for r in results if r is not found_finished[0]]
        assert trained[0] == 0 and "holds this run, finished" not in trained[1], trained[2][-2000:]
        assert len(json.loads((run_dir / "summary.json").read_text())) > 0
        return
    assert sorted(code for code, _, _ in results) == [0, 2], [err[-2000:] for _, _, err in results]
    _, _, refused_err = next(r for r in results if r[0] == 2)
    refused = [line for line in refused_err.splitlines() if line.startswith("error: ")]
    assert len(refused) == 1 and "Traceback" not in refused_err
    # the loser either met the lock or, when it came after the winner's first file, the run it left
    assert "is in use by a run still going" in refused[0] or "holds a previous run" in refused[0]
    assert len(json.loads((run_dir / "summary.json").read_text())) > 0


def _is_gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # a zombie (its other threads may still be closing its files)


def _lock_is_free(run_dir: Path) -> bool:
    fd = os.open(run_dir / ckpt.LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_killing_accelerate_launch_leaves_an_orphan_whose_lock_stops_a_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = [*TINY, "--epochs", "30", "--save-every", "2"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(TRAIN), *recipe, "--run-dir", str(run_dir)],
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    orphan = None
    try:
        _wait_for(lambda: len(ckpt.list_checkpoints(run_dir)) >= 1 or launcher.poll() is not None, "a checkpoint")
        orphan = _lock_owner(run_dir)
        assert orphan is not None and orphan != launcher.pid, "the training child holds the lock, not the launcher"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert not _is_gone(orphan), "the training child outlives its killed launcher"
        assert train.main([*recipe, "--run-dir", str(run_dir), "--resume"]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert f"is in use by a run still going (PID {orphan} on " in line
    finally:
        if orphan is not None and not _is_gone(orphan):
            os.kill(orphan, signal.SIGKILL)
    _wait_for(lambda: _is_gone(orphan) and _lock_is_free(run_dir), "the orphan to end", timeout=30)
    assert train.main([*recipe, "--run-dir", str(run_dir), "--resume", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert f"notice: taking over {run_dir / ckpt.LOCK_FILE} from PID {orphan} on " in out
    assert "resumed from" in out


# -- full or read-only disk during a save --------------------------------------------------------
def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    saves = []
    real_save = ckpt.Accelerator.save_state

    def fill_disk_at_the_second_checkpoint(self, output_dir=None, **kwargs):
        saves.append(output_dir)
        if len(saves) == 2:
            monkeypatch.setattr(torch, "save", _disk_full)  # model.safetensors is written, optimizer.bin is not
        return real_save(self, output_dir, **kwargs)

    monkeypatch.setattr(ckpt.Accelerator, "save_state", fill_disk_at_the_second_checkpoint)
    assert train.main([*RECIPE, "--run-dir", str(run_dir)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line == (f"error: cannot write checkpoint {step(run_dir, 6)}: no space left on the device; "
                    "the newest checkpoint is still step_00000004")
    assert [c.name for c in ckpt.list_checkpoints(run_dir)] == ["step_00000004"]
    assert verify_checkpoint(step(run_dir, 4))["update"] == 4
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert train.main([*RECIPE, "--run-dir", str(run_dir), "--resume"]) == 0
    assert f"resumed from {step(run_dir, 4)}" in capsys.readouterr().out


def test_weights_that_cannot_be_written_are_one_line(tmp_path, monkeypatch):
    from accelerate import Accelerator

    monkeypatch.setattr(ckpt, "save_file", _disk_full)
    with pytest.raises(RunDirError, match="model_last.safetensors: no space left on the device$"):
        ckpt.save_weights(Accelerator(cpu=True), torch.nn.Linear(2, 2), tmp_path / "model_last.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_directory_is_one_line(run_copy, capsys):
    root = run_copy / "checkpoints"
    shutil.rmtree(step(run_copy, 12))
    shutil.rmtree(step(run_copy, 8))
    before = snapshot(root)
    os.chmod(root, 0o555)
    try:
        assert train.main([*RECIPE, "--run-dir", str(run_copy), "--resume"]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "not writable" in line and "the newest checkpoint is still step_00000006" in line
    finally:
        os.chmod(root, 0o755)
    assert snapshot(root) == before
