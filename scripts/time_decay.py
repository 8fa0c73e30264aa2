"""Time linear attention with the spatial decay against plain linear attention: the ops alone, on q, k, v.

    python scripts/time_decay.py                                   # the README's table
    python scripts/time_decay.py --grids 32x32 --batch 1 --modes infer

Per grid, batch and mode, the two ops run one after the other, ``--rounds`` times after one untimed
round; the table gives the median wall time of each, in ms, their ratio, and the ratio of their forward
FLOPs from the layer's cost formula. ``infer`` is a forward
without autograd; ``train`` a forward and a backward into q, k, v (and the rates). The rates are RMT's
initialisation (``decay=True``); the time does not depend on them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from visattn import ops
from visattn.layers import get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.layers.decay import initial_decay_rates


def _grid(text: str) -> tuple[int, int]:
    """``N`` (N x N) or ``HxW``."""
    try:
        sides = [int(side) for side in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"a grid is N or HxW with positive integers, got {text!r}")
    return (sides[0], sides[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--grids", nargs="+", type=_grid, default=[(32, 32), (64, 64)], help="token grids, N or HxW")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="batch sizes")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each op")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's choice")
    return parser.parse_args(argv)


def _step(fn, inputs: list[torch.Tensor], train: bool) -> float:
    """Seconds of one call (and its backward when ``train``)."""
    start = time.perf_counter()
    if train:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(*inputs)
    return time.perf_counter() - start


def time_pair(grid: tuple[int, int], batch: int, heads: int, head_dim: int, train: bool, rounds: int) -> tuple[float, float]:
    """Median ms of plain linear attention and of the decayed op, interleaved."""
    gen = torch.Generator().manual_seed(0)
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).requires_grad_(train) for _ in range(3))
    gamma = initial_decay_rates(heads, True).float().requires_grad_(train)
    plain = (ops.linear_attn, [q, k, v])
    decayed = (lambda q, k, v, g: ops.decayed_linear_attn(q, k, v, g, grid), [q, k, v, gamma])
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(rounds + 1):
        for (fn, inputs), spent in zip((plain, decayed), times):
            seconds = _step(fn, inputs, train)
            if round_:  # the first round warms up
                spent.append(seconds)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load}; "
        f"{args.heads} heads of {args.head_dim}, fp32"
    )
    print("| grid (tokens) | batch | mode | linear ms | linear + decay ms | time ratio | FLOP ratio |")
    print("|---|---:|---|---:|---:|---:|---:|")
    linear = get_attention("linear")
    plain_options = linear.type_options() | {"dwconv_kernel": None}
    for grid in args.grids:
        for batch in args.batch:
            for mode in args.modes:
                plain, decayed = time_pair(grid, batch, args.heads, args.head_dim, mode == "train", args.rounds)
                layout = TokenLayout(grid, 0)
                flops = [
                    linear.mixing_flops(CostCase(layout, args.heads, args.head_dim, options))
                    for options in (plain_options, plain_options | {"decay": True})
                ]
                tokens = f"{grid[0]}×{grid[1]} ({grid[0] * grid[1]:,})"
                print(
                    f"| {tokens} | {batch} | {mode} | {plain:.1f} | {decayed:.1f} | {decayed / plain:.1f}× "
                    f"| {flops[1] / flops[0]:.1f}× |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
