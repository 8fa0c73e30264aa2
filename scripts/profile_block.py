"""Where one transformer block's time goes, per attention type: the block's median time beside floor's
and the operators that take the most of it (torch.profiler: self CPU time per step, or on a GPU the self
time of each kernel), each beside floor's time in the same operator; ``--whole-model`` profiles the whole
model (patch embedding, every block, head).

    python scripts/profile_block.py --attn linear axial --size 2048
    python scripts/profile_block.py --attn neighborhood --size 1024 --mode train --top 8
    python scripts/profile_block.py --attn linear --size 512 --batch-size 16
    python scripts/profile_block.py --attn linear --size 1024 --whole-model
    python scripts/profile_block.py --attn linear neighborhood --size 2048 --batch-size 4 --device cuda --dtype bf16

Complements ``visattn-bench``: the benchmark says how fast each type is, this says why.
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import visattn
from visattn.bench.sweep import DTYPES


def build_block(
    attn: str, size: int, model: str, training: bool, batch_size: int, device: torch.device
) -> tuple[torch.nn.Module, torch.Tensor]:
    """Block 0 of ``model`` at ``size`` px, told its grid, and an input for it: (B, P + H W, C)."""
    vit = timm.create_model(model, attn=attn, img_size=size, depth=1).train(training)
    grid = vit.patch_embed.grid_size
    prefix = vit.num_prefix_tokens
    block = vit.blocks[0].to(device)
    block.attn.set_grid(grid, prefix)
    x = torch.randn(batch_size, prefix + grid[0] * grid[1], vit.embed_dim, device=device, requires_grad=training)
    return block, x


def build_model(
    attn: str, size: int, model: str, training: bool, batch_size: int, device: torch.device
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The whole ``model`` at ``size`` px and a batch of images for it: (B, 3, size, size)."""
    vit = timm.create_model(model, attn=attn, img_size=size).train(training).to(device)
    x = torch.randn(batch_size, 3, size, size, device=device)
    return vit, x


def operator_times(step, device: torch.device) -> dict[str, tuple[float, int]]:
    """Self time (ms) and call count of every operator in one profiled step: CPU time on the CPU; on a GPU
    the time of each kernel (the kernels alone: an operator's device time is its kernels' again)."""
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        return {e.key: (e.self_device_time_total / 1000, e.count) for e in kernels}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {event.key: (event.self_cpu_time_total / 1000, event.count) for event in prof.key_averages()}


def step_fn(block: torch.nn.Module, x: torch.Tensor, training: bool, dtype: torch.dtype):
    autocast = torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        if training:
            with autocast:
                out = block(x)
            out.float().sum().backward()
        else:
            with torch.inference_mode(), autocast:
                block(x)

    return step


def median_ms(step, repeats: int, device: torch.device) -> float:
    """Median wall time of ``repeats`` steps after one warm-up (which also compiles, where a path does);
    on a GPU the device is synchronised around each step."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    step()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", nargs="+", default=["linear", "axial", "neighborhood"], choices=visattn.list_attentions())
    parser.add_argument("--size", type=int, default=2048, help="image side in pixels")
    parser.add_argument("--model", default="visattn_vit_small_patch16")
    parser.add_argument("--batch-size", type=int, default=1, help="images per step")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer", help="train: forward + backward")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per type, and for floor's just before them")
    parser.add_argument("--top", type=int, default=6, help="operators listed per type")
    parser.add_argument("--whole-model", action="store_true", help="profile the whole model, not block 0")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16, fp16: under autocast")
    args = parser.parse_args(argv)
    training = args.mode == "train"
    if args.batch_size < 1:
        parser.error(f"--batch-size: expected a positive int, got {args.batch_size}")

    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device must be cpu or an available cuda device, got {args.device!r}")
    dtype = DTYPES[args.dtype]

    build, unit = (build_model, "model") if args.whole_model else (build_block, "block")
    floor = step_fn(*build("floor", args.size, args.model, training, args.batch_size, device), training, dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"{args.model} {'the whole model' if args.whole_model else 'block 0'} at {args.size} px, "
        f"batch {args.batch_size}, {args.mode}, {args.dtype}, {where}"
    )
    kind = "GPU kernel time" if device.type == "cuda" else "self CPU time"
    for attn in args.attn:
        step = step_fn(*build(attn, args.size, args.model, training, args.batch_size, device), training, dtype)
        floor_ms, own_ms = median_ms(floor, args.repeats, device), median_ms(step, args.repeats, device)
        print(f"\n## {attn}: {own_ms:.2f} ms per {unit}, floor {floor_ms:.2f} ms: {100 * floor_ms / own_ms:.0f}% of floor")
        floor_ops, own_ops = operator_times(floor, device), operator_times(step, device)
        print(f"  {'operator (' + kind + ' per step)':<52} {'self time':>11} {'calls':>6} {'floor':>11} {'calls':>6}")
        for key, (ms, count) in sorted(own_ops.items(), key=lambda item: item[1][0], reverse=True)[: args.top]:
            floor_op_ms, floor_count = floor_ops.get(key, (0.0, 0))
            print(f"  {key[:52]:<52} {ms:8.2f} ms {count:6d} {floor_op_ms:8.2f} ms {floor_count:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
