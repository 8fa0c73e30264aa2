"""visattn-bench --backend OP=NAME: a path forced for the whole run, in the workers that time it, in the memory
estimates and in the report's title; a clear error naming the accepted ops and paths."""
from __future__ import annotations

import contextlib
import io

import pytest

from visattn.bench import sweep_cli, timing
from visattn.bench.sweep import Case, Result
from visattn.ops.backends import BACKENDS

OPS_SWEEP = ["--ops", "--attn", "axial", "--grids", "4x6", "--heads", "1", "--head-dim", "8", "--device", "cpu"]


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        sweep_cli.parse_args(argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_each_backend_is_an_op_and_one_of_its_paths(capsys):
    args = sweep_cli.parse_args(OPS_SWEEP + ["--backend", "axial=sdpa", "--backend", "local=flex"])
    assert args.backends == (("axial", "sdpa"), ("local", "flex"))
    assert sweep_cli.parse_args(OPS_SWEEP).backends == ()
    assert _error(OPS_SWEEP + ["--backend", "axial"], capsys) == (
        f"visattn-bench: error: argument --backend: expected OP=NAME with OP one of {', '.join(BACKENDS)}, got 'axial'"
    )
    assert _error(OPS_SWEEP + ["--backend", "axial=flex"], capsys) == (
        "visattn-bench: error: argument --backend: axial's paths are cpu_kernels, sdpa, sdpa_checkpoint, triton, "
        "got 'axial=flex'"
    )
    assert _error(OPS_SWEEP + ["--backend", "axial=sdpa", "--backend", "axial=triton"], capsys) == (
        "visattn-bench: error: --backend: one path per op, got axial=sdpa axial=triton"
    )


class _Progress:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def test_the_forced_path_runs_in_the_worker():
    """axial's CPU kernels refuse autocast: forced under bf16 they end the row with their error; chosen, the op
    takes SDPA and the row is timed."""

    def result(backends: tuple) -> Result:
        case = Case(kind="op", attn="axial", mode="infer", size=(4, 6), batch_size=1, device="cpu", dtype="bf16",
                    compile=False, num_heads=1, head_dim=8, backends=backends)
        return Result(case, 24, (4, 6), flops=0, estimate_bytes=0, param_count=0)

    forced, chosen = result((("axial", "cpu_kernels"),)), result(())
    timing.measure([forced, chosen], timing.Timing(0, 1, 0.0, 60.0), 2**40, 2**40, _Progress())
    assert forced.status == "error" and "backend 'cpu_kernels' needs a CPU tensor, dropout_p=0 and no autocast" in forced.message
    assert chosen.status == "ok" and len(chosen.times) == 1


def test_the_estimates_and_the_title_follow_the_forced_paths(tmp_path, monkeypatch):
    """On the CPU axial trains on its CPU kernels, which keep q, k and v; forced onto SDPA the estimate counts what
    autograd keeps through SDPA, and the report's title names the path."""
    planned = {}

    def keep_the_plan(plan, results, args):
        planned[args.backends] = {r.case.mode: r.estimate_bytes for r in results}

    monkeypatch.setattr(sweep_cli, "_measure", keep_the_plan)
    for backends in ([], ["--backend", "axial=sdpa"]):
        args = sweep_cli.parse_args(OPS_SWEEP + ["--modes", "infer", "train", "--out", str(tmp_path), *backends])
        with contextlib.redirect_stdout(io.StringIO()):
            sweep_cli.run(args)
    chosen, forced = planned[()], planned[(("axial", "sdpa"),)]
    assert forced["infer"] == chosen["infer"] and forced["train"] > chosen["train"]
    assert (tmp_path / "ops.md").read_text().splitlines()[0].endswith("cpu, fp32, axial on sdpa")
