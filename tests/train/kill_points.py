"""Training runs of ``train.py`` that stop at a chosen point of their work, to be killed there with SIGKILL.

:class:`RunServer` starts a server process that imports ``train.py`` and its libraries once, then forks one
process per run; each run calls ``train.main(argv)`` as ``python train.py`` would, with one CPU thread
and its output in a log file. Forking saves the seconds of imports per run, and it is safe because the
server never computes anything (no OpenMP thread pool exists to be copied half-initialised).

A run given a :class:`KillPoint` wraps the one function that reaches that point, in its own process
only: once there it reports how many optimizer updates its model holds and waits, holding a pipe to the
server, until it is killed (or the server goes, which ends it too). The test then sends SIGKILL to its
process group. Nothing in ``visattn`` or ``train.py`` knows about this: a renamed function makes the
run end without reaching its point, and the test fails saying so.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.predict import LAST_WEIGHTS
from visattn.train import checkpoint as ckpt
from visattn.train import loop, prepare, run_log

# Where a run can be stopped, and the function whose wrapper stops it there.
POINTS = {
    "update": "mid-epoch: after the forward and backward of the next update, before its optimizer step "
              "(loop.nonfinite_update)",
    "save-files": "inside a checkpoint save: model.safetensors written into the temporary folder, optimizer.bin "
                  "not yet (torch.save)",
    "save-sealed": "inside a checkpoint save: every file and trainer_state.json written and synced, the folder "
                   "not yet verified or renamed into place (checkpoint.verify_checkpoint)",
    "save-prune": "inside a checkpoint save: the new checkpoint in place, an older one renamed to .trash- for "
                  "deletion and not yet deleted (shutil.rmtree)",
    "weights-written": "end of an epoch: model_best/model_last written, its checkpoint not yet (checkpoint.save_weights)",
    "epoch-start": "between epochs: the end-of-epoch checkpoint and metrics written, the next epoch not begun "
                   "(train.train_epoch)",
    "eval": "during the end-of-epoch evaluation, after its first batch (loop.evaluate)",
    "test": "during the final test of the best weights, after its first batch (loop.test_best_weights)",
    "plot": "end of the run: the test done, the plot of the metrics about to be written (run_log.plot_metrics)",
    "resume-verify": "during --resume, while the newest checkpoint is verified (checkpoint.verify_checkpoint)",
    "resume-rewrote": "during --resume: checkpoint loaded, run files and metrics.jsonl rewritten, no update yet "
                      "(run_log.write_metrics)",
}


@dataclass(frozen=True)
class KillPoint:
    """Stop at ``where`` (a key of :data:`POINTS`) once the run's model holds ``update`` optimizer updates;
    ``update=None``: the first time the point is reached."""

    where: str
    update: int | None = None

    def __post_init__(self) -> None:
        if self.where not in POINTS:
            raise ValueError(f"kill point {self.where!r}: expected one of {', '.join(POINTS)}")


# -- inside a run -----------------------------------------------------------------------------------
class _Stopper:
    """Wraps the functions of one kill point; stops the run the first time it is reached."""

    def __init__(self, point: KillPoint, conn: Connection) -> None:
        self.point, self.conn = point, conn
        self.run: loop.Training | None = None  # this process's training, once built
        self.in_test = False

    def updates(self) -> int | None:
        return None if self.run is None else self.run.state["update"]

    def due(self) -> bool:
        return self.point.update is None or self.updates() == self.point.update

    def stop(self, updates: int | None = None) -> None:
        """Tell the server how many updates the model holds, then wait to be killed."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.conn.send(dict(where=self.point.where, updates=self.updates() if updates is None else updates))
        try:
            self.conn.recv()  # nothing is ever sent: this returns only when the server has gone
        finally:
            os._exit(1)

    def install(self) -> None:
        original_training = prepare.Training

        def training(**kwargs: Any) -> loop.Training:
            self.run = original_training(**kwargs)
            return self.run

        prepare.Training = training
        getattr(self, "_" + self.point.where.replace("-", "_"))()

    def _update(self) -> None:
        original = loop.nonfinite_update

        def nonfinite_update(run: loop.Training, loss_is_finite: torch.Tensor) -> bool:
            if self.due():
                self.stop()
            return original(run, loss_is_finite)

        loop.nonfinite_update = nonfinite_update

    def _save_files(self) -> None:
        original = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(f, (str, os.PathLike)):
                path = Path(f)
                if path.name == "optimizer.bin" and path.parent.name.startswith(".tmp-") and self.due():
                    self.stop()
            original(obj, f, *args, **kwargs)

        torch.save = save

    def _save_sealed(self) -> None:
        original = ckpt.verify_checkpoint

        def verify_checkpoint(checkpoint: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if checkpoint.name.startswith(".tmp-") and self.due():
                self.stop()
            return original(checkpoint, *args, **kwargs)

        ckpt.verify_checkpoint = verify_checkpoint

    def _save_prune(self) -> None:
        original = shutil.rmtree

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).name.startswith(".trash-step_") and self.run is not None and self.due():
                self.stop()
            original(path, *args, **kwargs)

        shutil.rmtree = rmtree

    def _weights_written(self) -> None:
        original = ckpt.save_weights

        def save_weights(accelerator: Any, model: Any, path: Path) -> None:
            original(accelerator, model, path)
            if path.name == LAST_WEIGHTS and self.due():
                self.stop()

        ckpt.save_weights = save_weights

    def _epoch_start(self) -> None:
        original = train.train_epoch

        def train_epoch(run: loop.Training, epoch: int) -> tuple[float, int, float]:
            if self.due():
                self.stop()
            return original(run, epoch)

        train.train_epoch = train_epoch

    def _evaluation(self, in_test: bool) -> None:
        original = loop.evaluate

        def evaluate(accelerator: Any, model: Any, loader: Any) -> dict[str, float]:
            if self.in_test == in_test and self.due():
                loader = self._stopping_after_first_batch(loader)
            return original(accelerator, model, loader)

        loop.evaluate = evaluate

    def _stopping_after_first_batch(self, loader: Any) -> Any:
        for batch in loader:
            yield batch
            self.stop()  # evaluate asks for the second batch once the first went through the model

    def _eval(self) -> None:
        self._evaluation(in_test=False)

    def _test(self) -> None:
        original = loop.test_best_weights

        def test_best_weights(run: loop.Training) -> dict[str, float]:
            self.in_test = True
            return original(run)

        loop.test_best_weights = test_best_weights
        self._evaluation(in_test=True)

    def _plot(self) -> None:
        original = run_log.plot_metrics

        def plot_metrics(run_dir: Path, history: list[dict[str, Any]]) -> Path:
            if self.due():
                self.stop()
            return original(run_dir, history)

        run_log.plot_metrics = plot_metrics

    def _resume_verify(self) -> None:
        original = ckpt.verify_checkpoint

        def verify_checkpoint(checkpoint: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if self.run is None and ckpt.CHECKPOINT_NAME.match(checkpoint.name):
                update = ckpt.checkpoint_update(checkpoint)
                if self.point.update in (None, update):
                    self.stop(updates=update)  # nothing loaded yet: the model holds no more than this checkpoint
            return original(checkpoint, *args, **kwargs)

        ckpt.verify_checkpoint = verify_checkpoint

    def _resume_rewrote(self) -> None:
        original = run_log.write_metrics

        def write_metrics(run_dir: Path, history: list[dict[str, Any]]) -> None:
            original(run_dir, history)
            if self.run is not None and self.due():
                self.stop()

        run_log.write_metrics = write_metrics


def _run(argv: list[str], log: str, point: KillPoint | None, conn: Connection) -> int:
    """One training run in a forked process: ``train.main(argv)``, output to ``log``; its exit status."""
    os.setpgid(0, 0)  # its own process group, which the kill takes whole
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    torch.set_num_threads(1)  # as train.py without OMP_NUM_THREADS, and accelerate launch
    if point is not None:
        _Stopper(point, conn).install()
    try:
        code = train.main(argv)
    except SystemExit as exit_:  # argparse's
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # a traceback in the log, for the test to show
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


# -- the server -----------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    """Answers ("start", argv, log, point) -> pid; ("wait", pid, seconds) -> ("stopped", report),
    ("ended", exit code) or ("timeout", None); ("kill", pid) -> exit code. Ends when the test closes ``conn``."""
    runs: dict[int, Connection] = {}  # pid -> our end of the pipe to that run
    try:
        while True:
            try:
                kind, *args = conn.recv()
            except EOFError:
                return
            if kind == "start":
                ours, theirs = mp.Pipe()
                pid = os.fork()
                if pid == 0:
                    for other in (conn, ours, *runs.values()):
                        other.close()
                    code = 1
                    try:
                        code = _run(*args, theirs)
                    finally:
                        os._exit(code)
                theirs.close()
                runs[pid] = ours
                conn.send(pid)
            elif kind == "wait":
                pid, seconds = args
                if not runs[pid].poll(seconds):
                    conn.send(("timeout", None))
                    continue
                try:
                    conn.send(("stopped", runs[pid].recv()))
                except EOFError:  # the run ended and closed its end of the pipe
                    conn.send(("ended", _reap(pid, runs)))
            elif kind == "kill":
                (pid,) = args
                _kill(pid)
                conn.send(_reap(pid, runs))
    except BaseException:  # the test then sees the server gone, and the reason in its output
        traceback.print_exc()
    finally:
        for pid in list(runs):
            _kill(pid)
            _reap(pid, runs)
        os._exit(0)  # nothing to write back; skips the slow unloading of torch and the rest


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # killed before it made its own group
        os.kill(pid, signal.SIGKILL)


def _reap(pid: int, runs: dict[int, Connection]) -> int:
    runs.pop(pid).close()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class RunServer:
    """The test's side of the server: start runs, wait for them to stop or end, kill them.

    The server is a daemon process (it goes with the test process, however that ends), so its runs
    cannot start processes through multiprocessing: they need ``--num-workers 0``, the default.
    """

    def __init__(self) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: nothing of the test process is copied
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()

    def _ask(self, *request: Any, seconds: float = 60) -> Any:
        self.conn.send(request)
        if not self.conn.poll(seconds + 120):  # the server's imports come first
            raise AssertionError(f"the run server did not answer {request[0]!r} in time")
        return self.conn.recv()

    def start(self, argv: list[str], log: Path, point: KillPoint | None = None) -> int:
        return self._ask("start", argv, str(log), point)

    def wait(self, pid: int, seconds: float) -> tuple[str, Any]:
        """("stopped", {"where", "updates"}) once the run is at its kill point, ("ended", exit code), or
        ("timeout", None)."""
        return self._ask("wait", pid, seconds, seconds=seconds)

    def kill(self, pid: int) -> int:
        """SIGKILL to the run's process group; its exit status (-9)."""
        return self._ask("kill", pid)

    def close(self) -> None:
        self.conn.close()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def stop_and_kill(server: RunServer, argv: list[str], log: Path, point: KillPoint, seconds: float = 300) -> int:
    """Run ``argv`` until ``point``, kill it there; the number of optimizer updates its model held."""
    pid = server.start(argv, log, point)
    outcome, detail = server.wait(pid, seconds)
    if outcome != "stopped":
        if outcome == "timeout":
            server.kill(pid)
        raise AssertionError(f"the run did not reach {point} ({outcome}: {detail}):\n{log_tail(log)}")
    status = server.kill(pid)
    assert status == -signal.SIGKILL, f"the run at {point} ended with {status}, not SIGKILL:\n{log_tail(log)}"
    return detail["updates"]


def run_to_end(server: RunServer, argv: list[str], log: Path, seconds: float = 300) -> int:
    """Run ``argv`` to its end; its exit status."""
    pid = server.start(argv, log)
    outcome, detail = server.wait(pid, seconds)
    if outcome == "timeout":
        server.kill(pid)
    assert outcome == "ended", f"the run did not end ({outcome}: {detail}):\n{log_tail(log)}"
    return detail

