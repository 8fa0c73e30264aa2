"""Train every attention type with one recipe and write a markdown table of the results.

    python scripts/accuracy_table.py                                  # every type, configs/digits.yaml
    python scripts/accuracy_table.py --epochs 2 --attn axial,softmax  # a quicker, partial table
    python scripts/accuracy_table.py --epochs 1 -- --max-train-samples 256 --mixed-precision bf16

Each type is trained by its own ``train.py`` process, one after the other, into
``<run-root>/<attention>`` (replacing what an earlier table left there); arguments after ``--`` go to
every ``train.py`` run unchanged. The table reads each run's ``summary.json``: test accuracy of the
weights chosen on validation, training images per second, and peak memory (GPU memory allocated by tensors on CUDA; the
whole process's peak resident memory on CPU, which includes the Python runtime).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import visattn

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "digits.yaml"), help="the recipe every type trains with")
    parser.add_argument("--epochs", type=int, help="override the recipe's epochs (fewer for a quick table)")
    parser.add_argument("--attn", help="comma-separated attention types (default: every visattn.list_attentions())")
    parser.add_argument("--run-root", default="runs/accuracy_table", help="one run directory per type under this")
    parser.add_argument("--output", default="accuracy_table.md", help="where the markdown table is written")
    args = parser.parse_args(own)
    names = args.attn.split(",") if args.attn else visattn.list_attentions()
    unknown = [name for name in names if name not in visattn.list_attentions()]
    if unknown:
        parser.error(f"unknown attention {', '.join(unknown)}; valid: {', '.join(visattn.list_attentions())}")
    args.names = names
    return args, train_args


def train_one(name: str, args: argparse.Namespace, train_args: list[str]) -> dict | None:
    """Train ``name``; its summary.json, or None when the run failed (its log says why)."""
    run_dir = Path(args.run_root) / name
    command = [sys.executable, str(REPO / "train.py"), "--config", args.config, "--attn", name,
               "--run-dir", str(run_dir), "--overwrite", *train_args]
    if args.epochs is not None:
        command += ["--epochs", str(args.epochs)]
    log = Path(args.run_root) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        print(f"{name}: failed (exit {result.returncode}), see {log}", flush=True)
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"{name}: {100 * summary['test_acc']:.2f}% in {elapsed:.0f} s", flush=True)
    return {**summary, "process_time_s": elapsed}


def markdown(rows: list[tuple[str, dict | None]], args: argparse.Namespace, train_args: list[str]) -> str:
    mem_kinds = {summary["mem_kind"] for _, summary in rows if summary}
    mem_label = "peak GPU memory (MiB)" if mem_kinds == {"cuda_allocated"} else "peak memory (MiB)"
    recipe = f"`{Path(args.config).name}`"
    if args.epochs is not None:
        recipe += f", {args.epochs} epoch{'s' if args.epochs != 1 else ''}"
    if train_args:
        recipe += f", `{' '.join(train_args)}`"
    lines = [
        f"| attention | test accuracy | train images/s | {mem_label} | run time (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, summary in rows:
        if summary is None:
            lines.append(f"| {name} | failed (see {Path(args.run_root) / name}.log) | | | |")
        else:
            lines.append(
                f"| {name} | {100 * summary['test_acc']:.2f}% | {summary['images_per_s']:.0f} | "
                f"{summary['peak_mem_mib']:.0f} | {summary['process_time_s']:.0f} |"
            )
    note = (
        f"Recipe: {recipe}. Test accuracy after the last epoch; images/s over the training steps. "
        + ("Peak memory: GPU memory allocated by tensors." if mem_kinds == {"cuda_allocated"}
           else "Peak memory on CPU: the whole process's peak resident set, Python runtime included.")
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    rows = [(name, train_one(name, args, train_args)) for name in args.names]
    table = markdown(rows, args, train_args)
    Path(args.output).write_text(table)
    print(table)
    return 0 if all(summary is not None for _, summary in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
