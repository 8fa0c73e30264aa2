"""The GPU check's results page (scripts/device_report.py) from a folder as scripts/device_check.sh leaves it."""
from __future__ import annotations

import json

from tests.helpers import load_script

report = load_script("device_report").report


def test_the_page_copies_the_machine_commands_tests_tables_and_run(tmp_path):
    (tmp_path / "environment.txt").write_text(
        "2026-11-27T06:50:13Z\nNVIDIA H200, 143771 MiB, 580.159.04\npython 3.12.3 torch 2.11.0+cu130 cuda 13.0\n"
    )
    (tmp_path / "commands.txt").write_text("== infer_2048 (06:51:31, limit 75s): python3 -m visattn.bench ...\n")
    (tmp_path / "cuda_tests.log").write_text(
        "tests/ops/test_cuda.py::test_a PASSED\nFAILED tests/ops/test_cuda.py::test_b - AssertionError: out\n"
        "== 1 failed, 11 passed, 2170 deselected in 70.01s ==\n"
    )
    (tmp_path / "profile_2048.log").write_text("block 0 at 2048 px\nUserWarning: something\nUSDT:2026-11-27 profiler_start\n## linear: 1.00 ms per block\n")
    (tmp_path / "infer_2048").mkdir()
    (tmp_path / "infer_2048" / "bench.md").write_text("# visattn-bench: title\n\n| attn | images/s |\n|---|---|\n| linear | 41.5 |\n")
    (tmp_path / "run_linear_4096").mkdir()
    row = {"epoch": 1, "images_per_s": 512.6, "peak_mem_mib": 18287.4, "mem_kind": "cuda_allocated", "val_acc": 0.1}
    (tmp_path / "run_linear_4096" / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "train_run.log").write_text("loader alone: 4463 img/s per process over 8 batches of 64 to cuda\n")

    page = report(tmp_path, "abc1234")
    assert page.startswith("# GPU check, 2026-11-27\n")
    assert "NVIDIA H200, 143771 MiB, 580.159.04; python 3.12.3 torch 2.11.0+cu130 cuda 13.0. Commit: `abc1234`." in page
    assert "python3 -m visattn.bench ..." in page
    assert "`== 1 failed, 11 passed, 2170 deselected in 70.01s ==`" in page
    assert "- `FAILED tests/ops/test_cuda.py::test_b - AssertionError: out`" in page
    assert "## profile_2048\n\n```\nblock 0 at 2048 px\n## linear: 1.00 ms per block\n```" in page
    assert "## infer_2048\n\n## visattn-bench: title" in page and "| linear | 41.5 |" in page
    assert "- loader alone: `loader alone: 4463 img/s per process over 8 batches of 64 to cuda`" in page
    assert "- epoch 1: 513 img/s, peak 18287 MiB (cuda_allocated), val acc 10.0%" in page
    assert "## infer_1024" not in page  # a stage that never ran has no section


def test_the_page_copies_the_max_tokens_table_and_its_trials(tmp_path):
    (tmp_path / "max_tokens").mkdir()
    (tmp_path / "max_tokens" / "max_tokens.md").write_text("# max tokens within 74.51 GiB: title\n\n| attn | training: max tokens |\n")
    (tmp_path / "max_tokens.log").write_text(
        "some warning\ntimm train 131,044 tokens (362x362): ok in 12.0 s, peak 30,112 MB\n"
        "timm train 262,144 tokens (512x512): time in 40.0 s\n"
    )
    page = report(tmp_path, "abc1234")
    assert "## max_tokens\n\n## max tokens within 74.51 GiB: title\n\n| attn | training: max tokens |" in page
    assert ("```\ntimm train 131,044 tokens (362x362): ok in 12.0 s, peak 30,112 MB\n"
            "timm train 262,144 tokens (512x512): time in 40.0 s\n```") in page
    assert "some warning" not in page


def test_the_page_opens_as_a_results_page_and_shows_the_kernels_and_the_previous_paths(tmp_path):
    """The page reads as a results page (title, Topic, Status, Machine, Files behind it), the kernels' table and
    launch configurations come before the benchmark stages, each stage on the previous paths right after its own."""
    (tmp_path / "environment.txt").write_text("2026-12-01T06:50:13Z\nNVIDIA H200, 143771 MiB, 580.159.04\npython 3.12.3\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kernels.md").write_text("# Triton kernels: title\n\n## 1024 px\n\n| op | path |\n")
    literal = "# visattn/ops/axial/triton.py\nTUNED_CONFIGS: dict[tuple[str, int, int, str], tuple[int, int, int]] = {}\n"
    (tmp_path / "kernels" / "tuned_configs.txt").write_text(literal)
    for stage in ("infer_2048_previous", "infer_2048", "train_1024"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "bench.md").write_text(f"# visattn-bench: {stage}\n")

    page = report(tmp_path, "abc1234")
    (tmp_path / "2026-12-01-h200-check.md").write_text(page)
    header = load_script("docs_hooks").read_results_page(tmp_path / "2026-12-01-h200-check.md")
    assert (header.title, header.topic, header.status) == ("GPU check, 2026-12-01", "The GPU check on an NVIDIA H200", "current")
    assert header.machine.startswith("NVIDIA H200, 143771 MiB") and "`kernels/`" in header.files
    assert "## kernels\n\n## Triton kernels: title\n\n### 1024 px\n\n| op | path |" in page
    assert f"```python\n{literal}```" in page
    order = [page.index(f"## {name}\n") for name in ("kernels", "infer_2048", "infer_2048_previous", "train_1024")]
    assert order == sorted(order)
    assert "Training run" not in page  # the training run did not run
