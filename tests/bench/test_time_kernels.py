"""scripts/time_kernels.py on the CPU: every op on both its paths, its accounting against sums done by hand, and the
launch configurations written as the Python each module's TUNED_CONFIGS takes."""
from __future__ import annotations

import csv
import json

import pytest
import triton

from tests.helpers import load_script

time_kernels = load_script("time_kernels")

# The CPU shape: batch 1, a 9 x 6 grid after 1 prefix token (N = 55, M = 54 patches), 1 head of d = 16 (C = 16),
# bf16 (2 bytes). Bytes: 4 N C e forward, 11 N C e forward + backward.
FORWARD_BYTES, BOTH_BYTES = 4 * 55 * 16 * 2, 11 * 55 * 16 * 2
# Forward FLOPs, 4 C per (query, key) pair or per state entry:
# linear: state and output 4 N C (d + 1), the 3 x 3 convolution 2 M C 9;
# axial: rows M (P + W), columns M (P + H), the prefix query N keys;
# neighborhood 7 x 7: rows 9 queries x 7 keys, columns 6 x 6 (the window clamped to the 6 columns), the prefix N;
# sparse, blocks of 8 with a halo of 3: rows 8 x 9 + 1 x 4 (the last block's keys 5..8), columns 6 x 6;
# longformer: neighborhood's windows, each patch also the global token, the global token all N.
FORWARD_FLOPS = {
    "linear": 4 * 55 * 16 * 17 + 2 * 54 * 16 * 9,
    "axial": 4 * 16 * (54 * (1 + 6) + 54 * (1 + 9) + 55),
    "neighborhood": 4 * 16 * (9 * 7 * 6 * 6 + 55),
    "sparse": 4 * 16 * ((8 * 9 + 4) * 6 * 6 + 55),
    "longformer": 4 * 16 * (9 * 7 * 6 * 6 + 54 + 55),
}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    time_kernels.main(["--device", "cpu", "--cpu-reps", "1", "--out", str(out)])
    with open(out / "kernels.csv") as f:
        return out, list(csv.DictReader(f))


def test_every_op_on_both_paths_in_both_modes_with_its_bytes_and_flops(cpu_run):
    out, rows = cpu_run
    assert list(rows[0]) == list(time_kernels.CSV_COLUMNS)
    paths = {"linear": ("triton", "split+plain"), "axial": ("triton", "sdpa")}
    expected = {
        (op, path, mode) for op in FORWARD_FLOPS for path in paths.get(op, ("triton", "flex"))
        for mode in ("forward", "forward+backward")
    }
    assert {(r["op"], r["path"], r["mode"]) for r in rows} == expected and len(rows) == len(expected)
    for row in rows:
        forward = row["mode"] == "forward"
        assert int(row["min_bytes"]) == (FORWARD_BYTES if forward else BOTH_BYTES), row
        assert int(row["flops"]) == FORWARD_FLOPS[row["op"]] * (1 if forward else 3), row
        assert (row["tokens"], row["grid"], row["dtype"]) == ("55", "9x6", "bf16")
        assert bool(row["median_ms"]) != bool(row["error"]), row  # timed, or the error that ended it
        if row["median_ms"]:
            ms = float(row["median_ms"])
            assert float(row["gb_per_s"]) == pytest.approx(int(row["min_bytes"]) / ms / 1e6, abs=0.06)
            assert float(row["tflop_per_s"]) == pytest.approx(int(row["flops"]) / ms / 1e9, abs=6e-4)
            assert row["hbm_fraction"] == row["tensor_fraction"] == ""  # no limits for a CPU
    assert all(r["median_ms"] for r in rows if r["path"] == "triton")
    page = (out / "kernels.md").read_text()
    assert all(f"| {op} | triton |" in page for op in FORWARD_FLOPS)


def test_the_triton_paths_agree_with_the_previous_ones_where_both_run(cpu_run):
    """bf16 inputs under autocast: the interpreted kernels and the paths they replace each round their
    results to bf16 (8 significant bits, an RMS error near 2^-9 of each value) after sums in other orders, a few
    such roundings apart: about 2^-8 (0.004 to 0.007 here). 8 x 2^-8, 3%, leaves room for them to add up and
    still fails a wrong result, whose error is of order 1. FlexAttention has no backward on the CPU, which the
    local types' gradient row says."""
    _, rows = cpu_run
    for row in rows:
        value = row["rel_rms_vs_previous"]
        if row["path"] != "triton":
            assert value == "", row
        elif row["op"] in ("neighborhood", "sparse", "longformer") and row["mode"] == "forward+backward":
            assert value.startswith("NotImplementedError: FlexAttention does not support backward on CPU"), row
        else:
            assert float(value) < 8 * 2**-8, row


def test_an_interpreted_run_tunes_nothing_and_says_so(cpu_run):
    out, _ = cpu_run
    document = json.loads((out / "tuned_configs.json").read_text())
    assert set(document["tables"]) == {m.__name__ for m in time_kernels.TABLE_MODULES.values()}
    assert all(table["entries"] == [] for table in document["tables"].values())
    assert "TUNED_CONFIGS: dict[tuple[str, int, str, str, bool, int], LaunchConfig] = {}" in (out / "tuned_configs.txt").read_text()
    assert not (out / "autotuning.csv").exists()


def test_the_literals_are_each_modules_table(monkeypatch):
    """Entries of each module's kind (a dataclass, a tuple, a NamedTuple) come back from the JSON document as the
    Python that builds the same table."""
    linear, axial, local = (time_kernels.TABLE_MODULES[name] for name in ("linear", "axial", "local"))
    tables = {
        linear: {("state_kernel", 64, "bfloat16", "elu", False, 0): linear.LaunchConfig(64, 8, 2),
                 ("output_kernel", 64, "bfloat16", "elu", False, 3): linear.LaunchConfig(32, 8, 3)},
        axial: {("rows_forward", 64, 64, "bfloat16"): (64, 8, 2)},
        local: {("window_dq_kernel", 64, "float16"): local.TileConfig(8, 8, 8, 8, 8, 2)},
    }
    for module, table in tables.items():
        monkeypatch.setattr(module, "TUNED_CONFIGS", table)
    document = json.loads(json.dumps(time_kernels.tuned_configs("NVIDIA H200")))
    assert document["device"] == "NVIDIA H200"
    text = time_kernels.table_literals(document)
    assert "    ('output_kernel', 64, 'bfloat16', 'elu', False, 3): LaunchConfig(block_n=32, num_warps=8, num_stages=3),\n" in text
    assert "    ('rows_forward', 64, 64, 'bfloat16'): (64, 8, 2),\n" in text
    for module, table in tables.items():
        block = text.split(f"# {module.__name__.replace('.', '/')}.py\n")[1].split("\n\n")[0]
        namespace = dict(vars(module))
        exec(block, namespace)
        assert namespace["TUNED_CONFIGS"] == table, module.__name__
        assert all(e["source"] == "table" for e in document["tables"][module.__name__]["entries"])


def test_the_autotuning_log_keeps_every_candidate_and_marks_the_chosen_one():
    slow, fast = triton.Config({"BLOCK_N": 32}, num_warps=4), triton.Config({"BLOCK_N": 64}, num_warps=8)

    def state_kernel():
        pass

    log = time_kernels.AutotuneLog()
    log(fn=state_kernel, key=(64, 0, False, "torch.bfloat16"), best_config=fast,
        configs_timings={slow: [2.0, 1.8, 2.2], fast: [1.0, 0.9, 1.1]}, duration=0.5, cache_hit=False)
    assert [(r["kernel"], r["key"], r["median_ms"], r["chosen"]) for r in log.rows] == [
        ("state_kernel", "64 0 False torch.bfloat16", 2.0, False), ("state_kernel", "64 0 False torch.bfloat16", 1.0, True),
    ]


def test_the_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(time_kernels, "INTERPRETED", False)
    with pytest.raises(SystemExit):
        time_kernels.parse_args(["--device", "cpu"])
    assert "set TRITON_INTERPRET=1 before starting the script" in capsys.readouterr().err
