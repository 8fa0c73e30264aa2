"""The accuracy table's figure: test accuracy per row over the seeds, and accuracy per epoch per row."""
from __future__ import annotations

import statistics
from pathlib import Path

from visattn.experiments.plan import Run
from visattn.experiments.summarize import RowResult
from visattn.models import TIMM_ATTENTION


def plot(results: list[RowResult], runs: list[Run], path: Path) -> None:
    """Test accuracy per row (median, min-max range, each seed), and validation accuracy per epoch per row
    (median over seeds, min-max band)."""
    # Imported here to choose the file-only backend before pyplot loads (no display on a training node).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_acc, ax_curve) = plt.subplots(1, 2, figsize=(16, 0.45 * len(results) + 3))
    # tab20's dark shades, then its light ones, without its two greys (floor's): 18 colours before one
    # repeats, and neighbouring rows never in two shades of one hue
    tab20 = [color for index, color in enumerate(plt.get_cmap("tab20").colors) if index not in (14, 15)]
    colors = tab20[0::2] + tab20[1::2]
    palette = iter(colors * len(results))
    for index, result in enumerate(results):
        # the references as in visattn-bench's plots: timm black, floor grey and dashed
        color = {TIMM_ATTENTION: "black", "floor": "grey"}.get(result.row.attn) or next(palette)
        position = len(results) - 1 - index
        if result.accs:
            accs = [100 * acc for acc in result.accs]
            median = statistics.median(accs)
            ax_acc.errorbar(median, position, xerr=[[median - min(accs)], [max(accs) - median]], fmt="o",
                            color=color, capsize=4)
            ax_acc.scatter(accs, [position] * len(accs), color=color, alpha=0.4, s=14)
        curves = [run.history for run in runs if run.row == result.row and run.status == "finished"]
        if curves:
            split = "val" if "val_acc" in curves[0][0] else "test"
            epochs = sorted({record["epoch"] for history in curves for record in history})
            per_epoch = [[100 * r[f"{split}_acc"] for history in curves for r in history if r["epoch"] == e] for e in epochs]
            ax_curve.plot(epochs, [statistics.median(v) for v in per_epoch], marker=".", color=color,
                          label=result.row.label, linestyle="--" if result.row.attn == "floor" else "-")
            ax_curve.fill_between(epochs, [min(v) for v in per_epoch], [max(v) for v in per_epoch], color=color, alpha=0.15)
            ax_curve.set(ylabel=f"{split} accuracy (%)")
    ax_acc.set_yticks(range(len(results)), [result.row.label for result in reversed(results)])
    ax_acc.set(title="test accuracy (%)\nmedian, range over seeds, each seed", xlabel="test accuracy (%)")
    last = " (last stage)" if any(run.previous is not None for run in runs) else ""
    ax_curve.set(title=f"accuracy per epoch{last}\nmedian over seeds, range shaded", xlabel="epoch")
    ax_curve.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax_curve.lines:  # beside the curves, never over them
        ax_curve.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    for ax in (ax_acc, ax_curve):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
