"""The lines a run prints before its first step: what it trains on, what it builds, where it writes."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from visattn.layers import GridAttention, attention_options, get_attention, list_attentions
from visattn.layers.cost import CostCase, TokenLayout
from visattn.train.build import loader_workers
from visattn.train.config import MAX_DEFAULT_TOKENS, TrainConfig
from visattn.train.data import DataSplits, ImageCheck, choose_normalization, describe_unreadable
from visattn.train.run_log import significant

# timm's own Attention (attn=timm) is full softmax attention: the softmax layer's cost model is its cost.
TIMM_COST_MODEL = "softmax"


def attention_line(names: list[str], auto: bool) -> str:
    """'attention: axial in all 4 blocks' (and how auto chose), or one name per block."""
    if len(set(names)) == 1:
        text = f"attention: {names[0]} in all {len(names)} blocks"
    else:
        text = f"attention per block: {', '.join(names)}"
    return text + (" (the choice of attn=auto for this model and image size)" if auto else "")


def position_options_line(config: TrainConfig) -> str | None:
    """'position: linear with rope axial, decay on' for each type in use that takes rope or decay (from its
    defaults and the resolved attn_kwargs); None where no type in use takes either (floor, attn=timm)."""
    names = list(dict.fromkeys(config.attn if isinstance(config.attn, list) else [config.attn]))
    parts = []
    for name in names:
        if name not in list_attentions():
            continue  # timm's own Attention
        options = get_attention(name).type_options() | (
            config.attn_kwargs.get(name, {}) if isinstance(config.attn, list) else config.attn_kwargs
        )
        said = [f"rope {options['rope'] or 'off'}" if "rope" in options else "",
                f"decay {'off' if options['decay'] in (None, False) else 'on'}" if "decay" in options else ""]
        if any(said):
            parts.append(f"{name} with {', '.join(text for text in said if text)}")
    return f"position: {'; '.join(parts)}" if parts else None


def block_cases(config: TrainConfig, model: nn.Module, act_bytes: int = 4,
                device: torch.device = torch.device("cpu")) -> list[tuple[type[GridAttention], CostCase]]:
    """Each block's attention type (its cost model: timm's own Attention counts as softmax) and its CostCase for one
    image, with activations of ``act_bytes`` bytes on ``device``'s paths."""
    layout = TokenLayout(tuple(model.patch_embed.grid_size), model.num_prefix_tokens)
    heads = model.blocks[0].attn.num_heads
    cases = []
    for block in model.blocks:
        name = getattr(block.attn, "name", TIMM_COST_MODEL)
        # resolved options (visattn.train.attention): under each type's name for a list of types, else flat
        kwargs = config.attn_kwargs.get(name, {}) if isinstance(config.attn, list) else config.attn_kwargs
        options = attention_options(name, kwargs, layout.grid)
        cases.append((get_attention(name), CostCase(layout, heads, model.embed_dim // heads, options, act_bytes, device)))
    return cases


def attention_cost_lines(config: TrainConfig, model: nn.Module) -> list[str]:
    """The token mixing's forward FLOPs per image, summed over the blocks, from each type's cost model
    (:meth:`visattn.layers.GridAttention.mixing_flops`) beside full softmax attention's; and a warning when
    the grid has more tokens than a default patch size would make."""
    cases = block_cases(config, model)
    layout = cases[0][1].layout
    total = sum(layer.mixing_flops(case) for layer, case in cases)
    softmax_case = dataclasses.replace(cases[0][1], options=attention_options(TIMM_COST_MODEL, {}, layout.grid))
    softmax = len(cases) * get_attention(TIMM_COST_MODEL).mixing_flops(softmax_case)
    lines = [
        f"attention cost: {_flops(total)} per image per forward pass (token mixing of all {len(model.blocks)} blocks; "
        f"full softmax attention: {_flops(softmax)})"
    ]
    if layout.num_patches > MAX_DEFAULT_TOKENS:
        lines.append(
            f"warning: {layout.num_patches:,} tokens per image, more than the {MAX_DEFAULT_TOKENS:,} a default patch "
            "size makes: a larger --patch-size or a smaller --img-size cuts the cost"
        )
    return lines


def _flops(count: int) -> str:
    for unit, scale in (("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6)):
        if count >= scale:
            return f"{significant(count / scale)} {unit}"
    return f"{count:,} FLOPs"


def image_check_lines(check: ImageCheck) -> list[str]:
    """How many image files were checked and how fast, and which were left out (under skip_bad_images); none for
    a dataset without image files."""
    if not check.checked:
        return []
    unchanged = check.checked - check.decoded
    lines = [
        f"image files: {check.checked:,} checked in {check.seconds:.1f} s"
        + (f" ({unchanged:,} unchanged since an earlier check)" if unchanged else "")
    ]
    if check.unreadable:
        lines.append(f"notice: left out (--skip-bad-images): {describe_unreadable(check.unreadable)}")
    return lines


# A training step on a CPU estimated longer than this is a batch or an image size meant for a GPU.
CPU_STEP_WARNING_S = 10.0
# Batches a DataLoader holds per worker (torch's default prefetch_factor).
PREFETCH_FACTOR = 2
# Bytes of an activation under each mixed precision: autocast keeps the matmuls' outputs in 16 bits.
ACTIVATION_BYTES = {"no": 4, "fp16": 2, "bf16": 2, "fp8": 2}
MATMUL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StepCost:
    """What one training step of ``batch`` images costs, from the cost models (an estimate): its forward and
    backward FLOPs, and the bytes it allocates at its peak (weights, gradients and AdamW's two moments, the
    activations the blocks keep for the backward, one block's working set)."""

    batch: int
    flops: int
    memory_bytes: int


def step_cost(config: TrainConfig, model: nn.Module, device: torch.device) -> StepCost:
    """The cost of a step of ``config.batch_size`` images, by the rules of ``visattn.bench.flops`` (its
    ``train_flops`` and ``estimate_memory``, which a test holds this to for a model with a patch projection): per block
    the qkv projection, the proj (``2 N C^2``), the MLP (``4 N C C_mlp``) and the token mixing of the type's cost
    model, the patch projection over the grid and the head; a step is three forward passes but for the patch
    projection (no gradient flows into the image). Memory keeps ``5 N C + 2 N C_mlp`` activations per block and image
    plus what the type saves, and one block's live set on top. A conv stem is counted as the patch projection."""
    act_bytes = ACTIVATION_BYTES[config.mixed_precision]
    cases = block_cases(config, model, act_bytes, device)
    layout = cases[0][1].layout
    n, c = layout.num_tokens, model.embed_dim
    hidden = model.blocks[0].mlp.fc1.out_features
    patch_h, patch_w = model.patch_embed.patch_size
    patch_projection = 2 * layout.num_patches * 3 * patch_h * patch_w * c
    forward = patch_projection + 2 * c * model.num_classes + sum(
        layer.qkv_flops(case) + 2 * n * c * c + 4 * n * c * hidden + layer.mixing_flops(case) for layer, case in cases
    )
    mixing = [layer.mixing_memory(case) for layer, case in cases]
    saved = sum((5 * n * c + 2 * n * hidden) * act_bytes + memory.train for memory in mixing)
    working = max((2 * n * c + 2 * n * hidden) * act_bytes, 6 * n * c * act_bytes + max(m.infer for m in mixing))
    image = 3 * config.image_hw[0] * config.image_hw[1] * 4 + 2 * n * c * act_bytes
    params = sum(p.numel() for p in model.parameters())
    memory = 16 * params + sum(m.shared for m in mixing) + config.batch_size * (image + saved + working)
    return StepCost(batch=config.batch_size, flops=(3 * forward - patch_projection) * config.batch_size,
                    memory_bytes=memory)


@dataclass(frozen=True)
class LoaderMemory:
    """The batches a process's training loader holds at once, ``batches`` of ``batch_bytes``: two in flight per
    worker of ``workers`` and the one the step reads (one with no worker)."""

    workers: int
    batches: int
    batch_bytes: int

    @classmethod
    def of(cls, config: TrainConfig) -> LoaderMemory:
        workers = loader_workers(config.num_workers)
        batches = PREFETCH_FACTOR * workers + 1 if workers else 1
        return cls(workers, batches, config.batch_size * 3 * config.image_hw[0] * config.image_hw[1] * 4)

    @property
    def total_bytes(self) -> int:
        return self.batches * self.batch_bytes


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def matmul_flops_per_s(dtype: torch.dtype, dim: int, repeats: int = 5) -> float:
    """The FLOP/s this process's matmuls reach on the CPU in ``dtype``, at the shape of an MLP's first layer of width
    ``dim`` over 1,024 tokens: the fastest of ``repeats`` products after a warm-up one (on cores other processes
    share, the fastest is the least disturbed)."""
    a, b = torch.randn(1024, dim).to(dtype), torch.randn(dim, 4 * dim).to(dtype)
    torch.matmul(a, b)
    fastest = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        fastest = min(fastest, time.perf_counter() - started)
    return 2 * 1024 * dim * 4 * dim / fastest


def cost_lines(config: TrainConfig, splits: DataSplits, model: nn.Module, num_processes: int, batches_per_epoch: int,
               device: torch.device, cost: StepCost) -> list[str]:
    """What the run will cost: the images it trains on and evaluates, the tokens per image and per step, the
    FLOPs of a step, and the memory a step and the training loader take per process."""
    global_batch = config.batch_size * num_processes
    layout = TokenLayout(tuple(model.patch_embed.grid_size), model.num_prefix_tokens)
    selection = splits.val if splits.val is not None else splits.eval
    tests = len(splits.eval) * (config.epochs if config.test_every_epoch else 1)
    loader = LoaderMemory.of(config)
    height, width = config.image_hw
    in_flight = (f"{_count(loader.workers, 'worker')} x {PREFETCH_FACTOR} in flight and the step's" if loader.workers
                 else "read in the training process")
    return [
        f"cost: {config.epochs * batches_per_epoch * global_batch:,} images trained, "
        f"{config.epochs * len(selection):,} {'validation' if splits.val is not None else 'test'} and {tests:,} test "
        f"images evaluated; {layout.num_tokens:,} tokens per image, {layout.num_tokens * global_batch:,} per step; "
        f"{_flops(cost.flops)} per step (forward and backward, an estimate from the cost models)",
        f"memory per process: a step about {_bytes(cost.memory_bytes)} on {device.type} (an estimate: weights, "
        f"gradients, AdamW's moments, the activations kept for the backward); the training loader up to "
        f"{_bytes(loader.total_bytes)} ({_count(loader.batches, 'batch', 'batches')} of {config.batch_size} images of "
        f"3x{height}x{width} in fp32: {in_flight})",
    ]


def loader_warning(config: TrainConfig) -> list[str]:
    """One line when the training loader's batches may take more than half the machine's memory, else none."""
    loader, memory = LoaderMemory.of(config), machine_memory_bytes()
    if 2 * loader.total_bytes <= memory:
        return []
    return [
        f"warning: the training loader may hold {_bytes(loader.total_bytes)} of batches per process, more than half "
        f"this machine's {_bytes(memory)} of memory: lower --num-workers or --batch-size"
    ]


def cpu_warning(config: TrainConfig, model: nn.Module, batches_per_epoch: int, cost: StepCost) -> list[str]:
    """On a CPU, one line when the run has a GPU recipe's settings: mixed precision, a step estimated longer than
    ``CPU_STEP_WARNING_S``, or one whose memory estimate exceeds the machine's; with the time a step takes here,
    estimated from its FLOPs and a matmul rate measured now. None otherwise."""
    dtype = MATMUL_DTYPES.get(config.mixed_precision, torch.float32)
    rate = matmul_flops_per_s(dtype, model.embed_dim)
    seconds = cost.flops / rate
    memory = machine_memory_bytes()
    reasons = [f"{config.mixed_precision} mixed precision"] if config.mixed_precision in MATMUL_DTYPES else []
    if seconds > CPU_STEP_WARNING_S:
        reasons.append(f"a step of {config.batch_size} images at {config.image_hw[0]}x{config.image_hw[1]}")
    if cost.memory_bytes > memory:
        reasons.append(f"a step needing {_bytes(cost.memory_bytes)}, more than this machine's {_bytes(memory)}")
    if not reasons:
        return []
    epoch_hours = seconds * batches_per_epoch / 3600
    return [
        f"warning: a recipe for a GPU on the CPU ({'; '.join(reasons)}): a step takes about {significant(seconds)} s "
        f"here, {significant(epoch_hours)} h per epoch (an estimate: {_flops(cost.flops)} at the "
        f"{significant(rate / 1e9)} GFLOP/s this process's {str(dtype).removeprefix('torch.')} matmuls reach, "
        f"measured now; the rest of the step comes on top); on a CPU train "
        f"{'in fp32 (--mixed-precision no) ' if config.mixed_precision in MATMUL_DTYPES else ''}at a smaller "
        "--img-size or --batch-size"
    ]


def _bytes(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{significant(count / scale)} {unit}"
    return f"{count:,} bytes"


def run_overview(
    config: TrainConfig, splits: DataSplits, model: nn.Module, num_processes: int, batches_per_epoch: int,
    auto: bool, run_dir: Path, device: torch.device, image_check: ImageCheck,
) -> list[str]:
    """One line each: data (and its image files, and for a run that starts from weights, its normalisation and
    why), model, attention, schedule, cost (images, tokens, FLOPs), memory, run directory; and warnings when the
    warm-up does not end within the run, when the loader's batches may take more than half the machine's memory,
    and when a GPU recipe runs on the CPU (:func:`cpu_warning`)."""
    height, width = config.image_hw
    rows, cols = model.patch_embed.grid_size
    patch_h, patch_w = model.patch_embed.patch_size
    prefix = model.num_prefix_tokens
    params = sum(p.numel() for p in model.parameters())
    names = [getattr(block.attn, "name", f"timm's {type(block.attn).__name__}") for block in model.blocks]  # attn=timm
    global_batch = config.batch_size * num_processes
    updates = -(-batches_per_epoch // config.grad_accum_steps)
    threads = f" ({_count(torch.get_num_threads(), 'CPU thread')} each)" if device.type == "cpu" else ""
    update_text = f", {global_batch * config.grad_accum_steps} per update" if config.grad_accum_steps > 1 else ""
    cost = step_cost(config, model, device)
    return [
        f"data: {config.dataset}, {len(splits.train)} train / "
        f"{'no' if splits.val is None else len(splits.val)} validation / {len(splits.eval)} test images, "
        f"{splits.num_classes} classes, resized to {height}x{width}",
        *image_check_lines(image_check),
        *([choose_normalization(config, splits).line()] if config.pretrained or config.initial_checkpoint else []),
        f"model: {config.model}, {params:,} parameters, {rows}x{cols} grid of {patch_h}x{patch_w} patches"
        f"{' through a conv stem' if config.stem == 'conv' else ''} = {rows * cols:,} tokens"
        + (f" + {prefix} prefix" if prefix else ""),
        attention_line(names, auto),
        *filter(None, [position_options_line(config)]),
        *attention_cost_lines(config, model),
        f"training: {_count(num_processes, 'process', 'processes')}{threads} x batch {config.batch_size} = "
        f"{global_batch} images per step{update_text}; {_count(config.epochs, 'epoch')} of {_count(batches_per_epoch, 'step')} "
        f"({_count(updates, 'update')} each)",
        *cost_lines(config, splits, model, num_processes, batches_per_epoch, device, cost),
        f"run directory: {run_dir}",
    ] + warmup_notice(config) + loader_warning(config) + (
        cpu_warning(config, model, batches_per_epoch, cost) if device.type == "cpu" else []
    )


def warmup_notice(config: TrainConfig) -> list[str]:
    """A line when the learning rate is still warming up at the end of the run, else none."""
    if config.warmup_epochs < config.epochs:
        return []
    return [
        f"warning: the warm-up ({_count(config.warmup_epochs, 'epoch')}) does not end before the run "
        f"({_count(config.epochs, 'epoch')}): the learning rate never reaches lr={config.lr:g}; lower --warmup-epochs"
    ]


def _count(number: int, one: str, many: str | None = None) -> str:
    return f"{number} {one if number == 1 else many or one + 's'}"
