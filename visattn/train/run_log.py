"""Per-epoch metrics of a run: JSON lines, a PNG of the curves, and peak memory; speeds as printed."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from visattn.train.run_dir import RunDirError, os_error_reason, unlink_quietly, write_atomically

METRICS_FILE = "metrics.jsonl"
TRANSFER_METRICS_FILE = "transfer_metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits and no exponent (0.0312, 12.3, 4570); whole numbers at least,
    so a speed of thousands keeps its last digits (12345)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    rounded = float(f"{value:.{digits - 1}e}")  # first, so that 99.96 counts as 100 (3 digits: "100")
    decimals = digits - 1 - math.floor(math.log10(abs(rounded)))
    return f"{value:.{max(decimals, 0)}f}"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """(peak MiB, what was measured): CUDA memory allocated by tensors since the last reset, or the
    process's peak resident set size on CPU (which includes the interpreter and libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10), "cpu_peak_rss"


def write_metrics(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from the epoch records (a resumed run drops records it will redo)."""
    write_atomically(run_dir / METRICS_FILE, "".join(json.dumps(record) + "\n" for record in history))


def write_transfer_metrics(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``transfer_metrics.jsonl`` from the attention-transfer epoch records."""
    write_atomically(run_dir / TRANSFER_METRICS_FILE, "".join(json.dumps(record) + "\n" for record in history))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    write_atomically(run_dir / SUMMARY_FILE, json.dumps(summary, indent=1))


def plot_metrics(run_dir: Path, history: list[dict[str, Any]]) -> Path:
    """Loss, accuracy and learning-rate curves over epochs, as ``metrics.png``."""
    # Imported here to choose the file-only backend before pyplot loads (no display on a training node).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [record["epoch"] for record in history]
    split = "val" if "val_acc" in history[0] else "test"  # the split evaluated every epoch
    fig, (ax_loss, ax_acc, ax_lr) = plt.subplots(1, 3, figsize=(13, 3.6))
    ax_loss.plot(epochs, [r["train_loss"] for r in history], marker=".", label="train")
    ax_loss.plot(epochs, [r[f"{split}_loss"] for r in history], marker=".", label=split)
    ax_loss.set(title="loss", xlabel="epoch")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * r[f"{split}_acc"] for r in history], marker=".", color="tab:green")
    ax_acc.set(title=f"{split} accuracy (%)", xlabel="epoch")
    ax_lr.plot(epochs, [r["lr"] for r in history], marker=".", color="tab:red")
    ax_lr.set(title="learning rate (end of epoch)", xlabel="epoch")
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    tmp = path.with_name(f".tmp-{path.name}")  # whole or not at all, as the other files of a run
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    except OSError as error:
        unlink_quietly(tmp)
        raise RunDirError(f"cannot write {path}: {os_error_reason(error)}") from None
    finally:
        plt.close(fig)
    return path
