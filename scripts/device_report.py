"""Write the dated results page of a GPU check from what ``scripts/device_check.sh`` left in its folder.

    python scripts/device_report.py OUT [--commit SHA] > docs/results/<date>-<gpu>.md

The page holds the machine (GPU, driver, Python, torch, CUDA, timm, accelerate), every command with its exit
status and time, the cuda tests' summary line, each benchmark table as the benchmark wrote it, and the
training run's loader and step speeds, peak memory and accuracy, the kernel profiles, and the max-tokens table with
each of its trials. It copies figures, never edits them.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BENCH_STAGES = ("infer_2048", "infer_1024", "train_1024", "infer_224", "train_2048", "compile_1024")
PROFILE_STAGES = ("profile_train_1024", "profile_2048", "profile_224")


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _tail_line(log: str, pattern: str) -> str:
    lines = [line for line in log.splitlines() if re.search(pattern, line)]
    return lines[-1].strip() if lines else "(none: see the stage's exit status)"


def _bench_section(stage_dir: Path) -> list[str]:
    """The benchmark's own markdown, its title demoted under the stage's heading."""
    text = _read(stage_dir / "bench.md")
    if not text:
        return ["No table: the stage did not finish (see its exit status above).", ""]
    return [re.sub(r"^(#+)", r"#\1", line) for line in text.splitlines()] + [""]


def _run_section(out: Path) -> list[str]:
    log = _read(out / "train_run.log")
    lines = [
        f"- start-up: `{_tail_line(log, r'mixed precision')}`",
        f"- loader alone: `{_tail_line(log, r'loader alone')}`",
    ]
    for metrics in sorted(out.glob("run_*/metrics.jsonl")):
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "epoch" in row and "images_per_s" in row:
                lines.append(
                    f"- epoch {row['epoch']}: {row['images_per_s']:.0f} img/s, peak {row.get('peak_mem_mib', 0):.0f} MiB "
                    f"({row.get('mem_kind', '')}), val acc {100 * row.get('val_acc', 0):.1f}%"
                )
    return lines + [""]


def report(out: Path, commit: str) -> str:
    environment = _read(out / "environment.txt").strip().splitlines()
    commands = _read(out / "commands.txt").strip()
    test_log = _read(out / "cuda_tests.log")
    tests = _tail_line(test_log, r"(passed|failed|error)")
    failures = [line.strip() for line in test_log.splitlines() if re.match(r"(FAILED|ERROR) ", line)]
    lines = [
        f"# GPU check, {environment[0][:10] if environment else 'date unknown'}",
        "",
        f"Machine: {'; '.join(environment[1:]) or 'unknown'}. Commit: `{commit}`.",
        "Produced by `make device-check` (`scripts/device_check.sh`), page written by `scripts/device_report.py`.",
        "",
        "## Commands, exit status and time",
        "",
        "```",
        commands,
        "```",
        "",
        "## cuda tests",
        "",
        f"`{tests}`",
        "",
        *[f"- `{line}`" for line in failures],
        *([""] if failures else []),
    ]
    for stage in BENCH_STAGES:
        if (out / stage).is_dir() or (out / f"{stage}.log").is_file():
            lines += [f"## {stage}", "", *_bench_section(out / stage)]
    lines += ["## Training run at 4,096 tokens", "", *_run_section(out)]
    table = _read(out / "max_tokens" / "max_tokens.md")
    trials = [line.strip() for line in _read(out / "max_tokens.log").splitlines() if re.search(r" tokens \(\d+x\d+\): ", line)]
    if table or trials:
        demoted = [re.sub(r"^(#+)", r"#\1", line) for line in table.splitlines()]
        lines += ["## max_tokens", "", *(demoted or ["No table: the stage did not finish a row."]), "",
                  "Trials, in the order run:", "", "```", *trials, "```", ""]
    for stage in PROFILE_STAGES:
        log = _read(out / f"{stage}.log")
        if log:
            kept = [line for line in log.splitlines() if not re.search(r"warn|Warning|^USDT:", line)]
            lines += [f"## {stage}", "", "```", *kept, "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder scripts/device_check.sh wrote")
    parser.add_argument("--commit", default="unknown", help="the commit the check ran (the GPU machine has no .git)")
    args = parser.parse_args()
    if not args.out.is_dir():
        parser.error(f"{args.out} is not a folder")
    print(report(args.out, args.commit))


if __name__ == "__main__":
    main()
