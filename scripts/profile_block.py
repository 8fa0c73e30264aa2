"""Where one transformer block's time goes, per attention type: the block's median time beside floor's
and the operators that take the most of it (torch.profiler, self CPU time per step).

    python scripts/profile_block.py --attn linear axial --size 2048
    python scripts/profile_block.py --attn neighborhood --size 1024 --mode train --top 8
    python scripts/profile_block.py --attn linear --size 512 --batch-size 16

Complements ``visattn-bench``: the benchmark says how fast each type is, this says why.
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
from torch.profiler import ProfilerActivity, profile

import visattn


def build_block(
    attn: str, size: int, model: str, training: bool, batch_size: int
) -> tuple[torch.nn.Module, torch.Tensor]:
    """Block 0 of ``model`` at ``size`` px, told its grid, and an input for it: (B, P + H W, C)."""
    vit = timm.create_model(model, attn=attn, img_size=size, depth=1).train(training)
    grid = vit.patch_embed.grid_size
    prefix = vit.num_prefix_tokens
    block = vit.blocks[0]
    block.attn.set_grid(grid, prefix)
    x = torch.randn(batch_size, prefix + grid[0] * grid[1], vit.embed_dim, requires_grad=training)
    return block, x


def step_fn(block: torch.nn.Module, x: torch.Tensor, training: bool):
    def step() -> None:
        if training:
            block(x).sum().backward()
        else:
            with torch.inference_mode():
                block(x)

    return step


def median_ms(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", nargs="+", default=["linear", "axial", "neighborhood"], choices=visattn.list_attentions())
    parser.add_argument("--size", type=int, default=2048, help="image side in pixels")
    parser.add_argument("--model", default="visattn_vit_small_patch16")
    parser.add_argument("--batch-size", type=int, default=1, help="images per step")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer", help="train: forward + backward")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per type, and for floor's block just before it")
    parser.add_argument("--top", type=int, default=6, help="operators listed per type")
    args = parser.parse_args(argv)
    training = args.mode == "train"
    if args.batch_size < 1:
        parser.error(f"--batch-size: expected a positive int, got {args.batch_size}")

    floor = step_fn(*build_block("floor", args.size, args.model, training, args.batch_size), training)
    print(
        f"{args.model} block 0 at {args.size} px, batch {args.batch_size}, {args.mode}, {torch.get_num_threads()} threads"
    )
    for attn in args.attn:
        step = step_fn(*build_block(attn, args.size, args.model, training, args.batch_size), training)
        floor_ms, own_ms = median_ms(floor, args.repeats), median_ms(step, args.repeats)
        print(f"\n## {attn}: {own_ms:.1f} ms per block, floor {floor_ms:.1f} ms: {100 * floor_ms / own_ms:.0f}% of floor")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        for event in events[: args.top]:
            print(f"  {event.key:<48} {event.self_cpu_time_total / 1000:8.1f} ms  x{event.count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
