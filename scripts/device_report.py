"""Write the dated results page of a GPU check from what ``scripts/device_check.sh`` left in its folder.

    python scripts/device_report.py OUT [--commit SHA] > docs/results/<date>-<gpu>.md

The page opens as every results page does (its title, then Topic and Status, Date, Machine, Command and Files
behind it lines: the docs site's results index reads them), then holds every command with its exit status and
time, the cuda tests' summary line, the Triton kernels' timings beside the paths they replace with the launch
configurations their autotuning chose (``scripts/time_kernels.py``), each benchmark table as the benchmark wrote
it (a stage on the paths before the kernels right after its own), the training run's loader and step speeds, peak
memory and accuracy, the kernel profiles, and the max-tokens table with each of its trials. It copies figures,
never edits them.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BENCH_STAGES = (
    "infer_2048", "infer_2048_previous", "infer_1024", "train_1024", "train_1024_previous", "infer_224", "train_2048",
    "aligned_2048", "aligned_1024", "aligned_train_1024", "compile_1024",
)
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


def _kernels_section(out: Path) -> list[str]:
    """time_kernels.py's table, its title demoted, and the TUNED_CONFIGS dicts to paste."""
    folder = out / "kernels"
    table = _read(folder / "kernels.md")
    lines = [re.sub(r"^(#+)", r"#\1", line) for line in table.splitlines()] or ["No table: the stage measured no row."]
    literals = _read(folder / "tuned_configs.txt")
    if literals:
        lines += ["", "### Launch configurations", "",
                  "What autotuning chose (`kernels/tuned_configs.json`), as each module's `TUNED_CONFIGS`:", "",
                  "```python", *literals.rstrip().splitlines(), "```"]
    return lines + [""]


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


def _header(environment: list[str], commit: str) -> list[str]:
    """The title and the opening lines every results page has (scripts/docs_hooks.py reads them)."""
    date = environment[0][:10] if environment else "date unknown"
    gpu = environment[1].split(",")[0].strip() if len(environment) > 1 else ""
    return [
        f"# GPU check, {date}",
        "",
        f"- **Topic:** The GPU check on {'an ' + gpu if gpu else 'a GPU'}",
        "- **Status:** current",
        f"- **Date:** {date}",
        f"- **Machine:** {'; '.join(environment[1:]) or 'unknown'}. Commit: `{commit}`.",
        "- **Command:** `scripts/device_check.sh` (`make device-check`), each stage's command below",
        "- **Files behind it:** the folder the check wrote: `commands.txt`, each stage's log, the benchmark's",
        "  `bench.md` and `bench.csv`, `kernels/` (`kernels.csv`, `tuned_configs.json`), the training run's files",
        "",
    ]


def report(out: Path, commit: str) -> str:
    environment = _read(out / "environment.txt").strip().splitlines()
    commands = _read(out / "commands.txt").strip()
    test_log = _read(out / "cuda_tests.log")
    tests = _tail_line(test_log, r"(passed|failed|error)")
    failures = [line.strip() for line in test_log.splitlines() if re.match(r"(FAILED|ERROR) ", line)]
    lines = [
        *_header(environment, commit),
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
    if (out / "kernels").is_dir() or (out / "kernels.log").is_file():
        lines += ["## kernels", "", *_kernels_section(out)]
    for stage in BENCH_STAGES:
        if (out / stage).is_dir() or (out / f"{stage}.log").is_file():
            lines += [f"## {stage}", "", *_bench_section(out / stage)]
    if (out / "train_run.log").is_file():
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
