"""The lines a run prints before its first step: what it trains on, what it builds, where it writes."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from visattn.layers import attention_options, get_attention, list_attentions
from visattn.layers.cost import CostCase, TokenLayout
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


def attention_cost_lines(config: TrainConfig, model: nn.Module) -> list[str]:
    """The token mixing's forward FLOPs per image, summed over the blocks, from each type's cost model
    (:meth:`visattn.layers.GridAttention.mixing_flops`) beside full softmax attention's; and a warning when
    the grid has more tokens than a default patch size would make."""
    layout = TokenLayout(tuple(model.patch_embed.grid_size), model.num_prefix_tokens)
    heads = model.blocks[0].attn.num_heads
    head_dim = model.embed_dim // heads

    def block_flops(name: str, kwargs: dict) -> int:
        options = attention_options(name, kwargs, layout.grid)
        return get_attention(name).mixing_flops(CostCase(layout, heads, head_dim, options))

    total = 0
    for block in model.blocks:
        name = getattr(block.attn, "name", TIMM_COST_MODEL)
        # resolved options (visattn.train.attention): under each type's name for a list of types, else flat
        total += block_flops(name, config.attn_kwargs.get(name, {}) if isinstance(config.attn, list) else config.attn_kwargs)
    softmax = len(model.blocks) * block_flops(TIMM_COST_MODEL, {})
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


def run_overview(
    config: TrainConfig, splits: DataSplits, model: nn.Module, num_processes: int, batches_per_epoch: int,
    auto: bool, run_dir: Path, device: torch.device, image_check: ImageCheck,
) -> list[str]:
    """One line each: data (and its image files, and for a run that starts from weights, its normalisation and
    why), model, attention, schedule, run directory; and a warning when the warm-up does not end within the run."""
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
        f"run directory: {run_dir}",
    ] + warmup_notice(config)


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
