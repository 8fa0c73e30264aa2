"""What a sweep measures: the points of a sweep (:class:`Point`, an image size at a batch size), one
:class:`Case` per configuration of a point, one :class:`Result` to fill for each, planned with its FLOPs
and memory estimate before any worker starts."""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any

import timm
import torch

import visattn.models  # noqa: F401  (registers the visattn_vit_* models with timm)
from visattn.bench.flops import ViTShape, estimate_memory, train_flops, vit_flops
from visattn.layers import GridAttention, attention_options, get_attention
from visattn.layers.cost import CostCase, MixingMemory, TokenLayout
from visattn.tiled import TiledViT, tile_layout

MODES = ("infer", "train")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIMM = visattn.models.TIMM_ATTENTION  # the stock timm ViT, the reference: one name with attn="timm"
FLOOR = "floor"
# timm's stock model at its own resolution, run on tiles of the image (visattn.tiled).
TILED = "tiled"
# The naive twin of softmax attention (explicit N x N scores), timed by the ops benchmark beside the layers.
EXPLICIT_SOFTMAX = "softmax_explicit"
DEFAULT_MODEL = "visattn_vit_small_patch16"


@dataclass(frozen=True)
class Case:
    """One configuration, measured by one worker process."""

    kind: str  # "model" or "op"
    attn: str  # a registry name, "timm" or "softmax_explicit"
    mode: str  # "infer" or "train"
    size: tuple[int, int]  # image (H, W) pixels for a model, token grid (H, W) for an op
    batch_size: int
    device: str
    dtype: str
    compile: bool
    attn_kwargs: dict[str, Any] = field(default_factory=dict)
    model_name: str = DEFAULT_MODEL
    timm_name: str = ""
    num_classes: int = 1000
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    num_heads: int = 6
    head_dim: int = 64
    grad_checkpointing: bool = False  # train mode: timm's set_grad_checkpointing (recompute each block)
    tile: tuple[int, int] = (224, 224)  # the tiled row: tile size (pixels), the size its timm model is built for
    tile_overlap: int = 0  # the tiled row: least overlap of neighbouring tiles (pixels)
    backends: tuple[tuple[str, str], ...] = ()  # (op, path) forced in the worker (visattn-bench --backend OP=NAME)

    @property
    def size_label(self) -> str:
        h, w = self.size
        return str(h) if h == w and self.kind == "model" else f"{h}x{w}"

    @property
    def act_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize


@dataclass
class Result:
    """What was measured (or why not) for one case."""

    case: Case
    tokens: int
    grid: tuple[int, int]
    flops: int  # per image (per batch element for an op), this case's mode
    estimate_bytes: int
    param_count: int
    status: str = "ok"  # ok | skipped | oom | error | stopped
    message: str = ""
    times: list[float] = field(default_factory=list)  # seconds of each timed step
    rounds: list[int] = field(default_factory=list)  # the interleaved round of each timed step (its serial)
    build_bytes: int | None = None
    peak_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times)

    @property
    def step_time(self) -> float | None:
        """Median seconds per step."""
        return statistics.median(self.times) if self.ok else None

    @property
    def samples_per_sec(self) -> float | None:
        return self.case.batch_size / self.step_time if self.ok else None

    @property
    def tokens_per_sec(self) -> float | None:
        """Patch tokens (grid tokens in an op case) per second."""
        return self.tokens * self.samples_per_sec if self.ok else None

    @property
    def round_times(self) -> dict[int, float]:
        """{round serial: seconds} of the timed steps."""
        return dict(zip(self.rounds, self.times))

    @property
    def activation_bytes(self) -> int | None:
        """Peak above the footprint after building: activations, gradients, optimizer state."""
        if self.peak_bytes is None or self.build_bytes is None:
            return None
        return self.peak_bytes - self.build_bytes


def build_model(case: Case, device: str | torch.device | None = None) -> torch.nn.Module:
    """The model of a model case: the visattn ViT with ``case.attn``, timm's stock ViT for ``timm``, or for
    ``tiled`` timm's stock ViT built at the tile size and wrapped in :class:`~visattn.tiled.TiledViT`."""
    common = dict(img_size=case.size, num_classes=case.num_classes, **case.model_kwargs)
    with torch.device(device or case.device):
        if case.attn == TIMM:
            return timm.create_model(case.timm_name, **common)
        if case.attn == TILED:
            return TiledViT(timm.create_model(case.timm_name, **(common | dict(img_size=case.tile))), overlap=case.tile_overlap)
        return timm.create_model(case.model_name, attn=case.attn, attn_kwargs=case.attn_kwargs, **common)


def build_layer(case: Case, device: str | torch.device | None = None) -> GridAttention:
    """The layer of an op case (not the explicit-softmax twin), built as in a model whose grid is the case's."""
    options = attention_options(case.attn, case.attn_kwargs, case.size)
    dim = case.num_heads * case.head_dim
    return get_attention(case.attn)(dim, num_heads=case.num_heads, device=device or case.device, **options)


def timm_reference_name(model_name: str) -> str:
    """timm's stock model of the same shape: ``visattn_vit_small_patch16`` -> ``vit_small_patch16_224``."""
    candidate = model_name.removeprefix("visattn_") + "_224"
    if not model_name.startswith("visattn_") or not timm.is_model(candidate):
        raise ValueError(f"no timm reference model found for {model_name!r}; name one with --timm-model")
    return candidate


def default_tile(timm_name: str) -> tuple[int, int]:
    """The input size (h, w) of timm's pretrained configuration of ``timm_name``: the tiled row's tile."""
    _, height, width = timm.models.get_pretrained_cfg_value(timm_name, "input_size")
    return height, width


def check_tiled_sizes(
    timm_name: str, model_kwargs: dict[str, Any], tile: tuple[int, int], overlap: int, sizes: list[tuple[int, int]]
) -> None:
    """ValueError naming the first image size the tiled row cannot cut into tiles of its model."""
    with torch.device("meta"):
        patch_size = tuple(timm.create_model(timm_name, **(model_kwargs | dict(img_size=tile))).patch_embed.patch_size)
    for size in sizes:
        try:
            tile_layout(size, tile, overlap, patch_size)
        except ValueError as err:
            raise ValueError(f"image size {size[0]}x{size[1]}: {err}") from None


def tiled_cost(shape: ViTShape, case: Case, options: dict[str, Any], param_count: int) -> tuple[int, int]:
    """FLOPs per image and the memory estimate of a tiled case: the model's cost at the tile size, once per
    tile (its head once per image), with every tile of the batch in one forward."""
    tiles = tile_layout(case.size, case.tile, case.tile_overlap, shape.patch_size).num_tiles
    training = case.mode == "train"
    head = 2 * shape.embed_dim * shape.num_classes * (3 if training else 1)
    flops = tiles * ((train_flops if training else vit_flops)(shape, case.tile, "softmax", options) - head) + head
    estimate = estimate_memory(
        shape, case.tile, "softmax", options, case.batch_size * tiles, training, case.act_bytes, param_count,
        grad_checkpointing=case.grad_checkpointing, device=case.device,
    )
    return flops, estimate


@dataclass(frozen=True)
class Point:
    """One group of a sweep: an image size (a token grid in ``--ops``) at one batch size, in the given modes.
    The rows of a point (every type and reference, in every mode) are timed together, in interleaved rounds."""

    size: tuple[int, int]
    batch_size: int
    modes: tuple[str, ...]


def sweep_points(args: argparse.Namespace) -> list[Point]:
    """Every batch size (``--batch-size``) at every size (``--sizes``, or ``--grids`` in ``--ops``), batch
    sizes outermost; the train mode only at ``--train-sizes`` where given. Points without a mode are left out."""
    points = []
    for batch_size in args.batch_sizes:
        for size in args.grids if args.ops else args.sizes:
            skip_train = not args.ops and args.train_sizes is not None and size not in args.train_sizes
            modes = tuple(m for m in args.modes if not (m == "train" and skip_train))
            if modes:
                points.append(Point(size, batch_size, modes))
    return points


def plan_model_sweep(args: argparse.Namespace) -> list[list[Result]]:
    """The results to fill, one list per point of :func:`sweep_points`."""
    return [plan_model_point(args, point) for point in sweep_points(args)]


def plan_model_point(args: argparse.Namespace, point: Point) -> list[Result]:
    """The results of one point: rows timm, floor, tiled, the types; each in every mode of the point."""
    references = [r for r in (TIMM, FLOOR, TILED) if r in args.references]
    rows = references + [a for a in args.attn if a not in references]
    group = []
    for mode in point.modes:
        for attn in rows:
            case = Case(
                kind="model", attn=attn, mode=mode, size=point.size, batch_size=point.batch_size, device=args.device,
                dtype=args.dtype, compile=args.compile, attn_kwargs=args.attn_kwargs.get(attn, {}),
                model_name=args.model, timm_name=args.timm_model, num_classes=args.num_classes,
                model_kwargs=args.model_kwargs, grad_checkpointing=args.grad_checkpointing,
                tile=args.tile, tile_overlap=args.tile_overlap, backends=args.backends,
            )
            meta = build_model(case, device="meta")  # also checks the options, before any worker starts
            shape = ViTShape.from_model(meta.model if attn == TILED else meta)
            grid = shape.grid(point.size)
            cost_attn = "softmax" if attn in (TIMM, TILED) else attn
            options = attention_options(cost_attn, case.attn_kwargs, grid)
            param_count = sum(p.numel() for p in meta.parameters())
            training = mode == "train"
            if attn == TILED:
                flops, estimate = tiled_cost(shape, case, options, param_count)
            else:
                flops = (train_flops if training else vit_flops)(shape, point.size, cost_attn, options)
                estimate = estimate_memory(
                    shape, point.size, cost_attn, options, point.batch_size, training, case.act_bytes, param_count,
                    grad_checkpointing=args.grad_checkpointing, device=case.device,
                )
            group.append(Result(case, grid[0] * grid[1], grid, flops, estimate, param_count))
    return group


def explicit_softmax_memory(layout: TokenLayout, num_heads: int, head_dim: int, act_bytes: int) -> MixingMemory:
    """The explicit-softmax twin: scores and probabilities, h x N x N each; the backward keeps the
    probabilities, q, k, v."""
    n, c = layout.num_tokens, num_heads * head_dim
    return MixingMemory(
        infer=(2 * num_heads * n * n + n * c) * act_bytes, train=(num_heads * n * n + 4 * n * c) * act_bytes
    )


def estimate_op_memory(case: Case, layout: TokenLayout, mix: MixingMemory) -> int:
    """q, k, v (and their gradients in training) plus the op's own buffers ``mix``, for the batch."""
    qkv = 3 * layout.num_tokens * case.num_heads * case.head_dim * case.act_bytes
    if case.mode == "train":
        return mix.shared + case.batch_size * (2 * qkv + mix.train + mix.infer)
    return mix.shared + case.batch_size * (qkv + mix.infer)


def plan_ops_sweep(args: argparse.Namespace) -> list[list[Result]]:
    """The results to fill, one list per point of :func:`sweep_points` (a grid at a batch size)."""
    return [plan_ops_point(args, point) for point in sweep_points(args)]


def plan_ops_point(args: argparse.Namespace, point: Point) -> list[Result]:
    """The results of one point: fused softmax, its explicit twin, then the types; in every mode of the point."""
    rows = ["softmax", EXPLICIT_SOFTMAX] + [a for a in args.attn if a not in ("softmax", FLOOR)]
    grid = point.size
    group = []
    for mode in point.modes:
        for attn in rows:
            case = Case(
                kind="op", attn=attn, mode=mode, size=grid, batch_size=point.batch_size, device=args.device,
                dtype=args.dtype, compile=args.compile, attn_kwargs=args.attn_kwargs.get(attn, {}),
                num_heads=args.heads, head_dim=args.head_dim, backends=args.backends,
            )
            layout = TokenLayout(grid, 0)
            if attn == EXPLICIT_SOFTMAX:  # the same products as the fused op
                flops = get_attention("softmax").mixing_flops(CostCase(layout, args.heads, args.head_dim))
                mix = explicit_softmax_memory(layout, args.heads, args.head_dim, case.act_bytes)
            else:
                build_layer(case, device="meta")  # checks the options, before any worker starts
                layer, options = get_attention(attn), attention_options(attn, case.attn_kwargs, grid)
                cost_case = CostCase(layout, args.heads, args.head_dim, options, case.act_bytes, case.device)
                flops, mix = layer.mixing_flops(cost_case), layer.mixing_memory(cost_case)
            flops *= 3 if mode == "train" else 1  # each product has two products in its backward
            group.append(Result(case, layout.num_tokens, grid, flops, estimate_op_memory(case, layout, mix), 0))
    return group
