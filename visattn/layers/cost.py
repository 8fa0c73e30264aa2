"""What the cost formulas of the layers take and return, and the formulas the tiled local layers share.

Each layer class states its own cost as classmethods (:meth:`GridAttention.mixing_flops`,
:meth:`GridAttention.mixing_memory` and, where the type projects q, k, v differently,
:meth:`GridAttention.qkv_flops`), each taking one :class:`CostCase`, so a new attention type is one layer
module plus one registry line and the benchmark needs nothing more. Whole-model totals are
:mod:`visattn.bench.flops`.

Counting rules: FLOPs are those of the matrix products (2 per multiply-add), the convention of fvcore
and of timm's ``infer_gmacs`` (GMACs = GFLOPs / 2); elementwise work (norms, softmax, feature maps,
masks) is not counted. The count is of the model's math, as for model-FLOPs utilisation: work an
implementation repeats to save memory (a backward pass that recomputes) is not counted. Memory is
bytes, from the implementation: what one block's token mixing keeps alive, on the paths its op takes on
the case's device (the choice of :mod:`visattn.ops.backends`, asked with that device and without dropout).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from visattn.ops.checks import check_positive_int
from visattn.ops.local import AxisTiling
from visattn.ops.local.engine import planned_local_backend
from visattn.ops.local.flex import flex_slots


@dataclass(frozen=True)
class TokenLayout:
    """P prefix tokens followed by an H x W grid of patch tokens."""

    grid: tuple[int, int]
    num_prefix_tokens: int

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches


@dataclass(frozen=True)
class CostCase:
    """One block's token mixing for one image, as every cost hook of a layer class takes it.

    Attributes:
        layout: the prefix tokens and the patch grid.
        num_heads, head_dim: h heads of width d; :attr:`dim` is C = h d.
        options: the type options the layer is built with, defaults included
            (:func:`visattn.layers.attention_options`); read-only.
        act_bytes: bytes of one activation element (2 for bf16 and fp16, 4 for fp32); memory only.
        device: the device whose op paths the memory is counted on (``"cpu"`` or a torch.device); memory only.
    """

    layout: TokenLayout
    num_heads: int
    head_dim: int
    options: Mapping[str, Any] = field(default_factory=dict)
    act_bytes: int = 4
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "act_bytes"):
            check_positive_int(getattr(self, name), name, "CostCase")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def dim(self) -> int:
        """C, the width of q, k, v and of the embedding: heads x head_dim."""
        return self.num_heads * self.head_dim


class MixingMemory(NamedTuple):
    """Bytes of one block's token mixing, per image unless said otherwise."""

    infer: int  # live during the forward, beyond q, k, v: outputs, copies, scores
    train: int  # saved for the backward (including q, k, v when the op keeps them)
    shared: int = 0  # per block and batch-independent: masks, resampled projections


def windowed_flops(case: CostCase, rows: AxisTiling, cols: AxisTiling) -> int:
    """4 C per (query, key) pair: each patch query with the keys of its window (``rows`` x ``cols``), each
    prefix query with all N tokens. The tiled engine also scores the rest of each tile's key region and
    masks it out; those products are not credited."""
    layout = case.layout
    return 4 * case.dim * (rows.keys_seen * cols.keys_seen + layout.num_prefix_tokens * layout.num_tokens)


def tiled_memory(case: CostCase, rows: AxisTiling, cols: AxisTiling, num_visible: int) -> MixingMemory:
    """The tiled local engine (:func:`visattn.ops.local.tiled_local_attn`). Inference runs the tiles
    in cache-sized chunks into the output. Training gathers the padded query tiles and each tile's key
    region (plus the ``num_visible`` prefix keys), which the fused SDPA keeps with its output and an fp32
    log-sum-exp per query. The additive mask (queries x keys of every tile) is cached per layout."""
    layout, num_heads, c, act_bytes = case.layout, case.num_heads, case.dim, case.act_bytes
    queries = rows.num_tiles * rows.tile * cols.num_tiles * cols.tile  # padded
    keys_per_tile = rows.region * cols.region + num_visible
    keys = rows.num_tiles * cols.num_tiles * keys_per_tile  # gathered, for k and again for v
    # The prefix rows attend to all tokens in an SDPA that keeps q, k, v: the whole qkv output.
    prefix = 3 * layout.num_tokens * c if layout.num_prefix_tokens or num_visible else 0
    train = (2 * queries + 2 * keys) * c * act_bytes + 4 * num_heads * queries + prefix * act_bytes
    return MixingMemory(
        infer=layout.num_tokens * c * act_bytes, train=train, shared=queries * keys_per_tile * act_bytes
    )


def flex_memory(case: CostCase, slots: int) -> MixingMemory:
    """The tiled local engine on FlexAttention (:func:`visattn.ops.local.flex.flex_local_attn`), over
    ``slots`` tokens in tile order: q, k and v copied into that order (or, where the model keeps its
    tokens in tile order, :mod:`visattn.models.tile_order`, views of the qkv projection: as many bytes), the
    kernel's output and its fp32 log-sum-exp per slot and head, all kept for the backward. No gathered tiles
    and no mask (the block mask's tables, a few kB per layout, are left out); the qkv projection is not kept,
    since the permutation's backward needs only its indices. Where the prefix rows run apart (tile-aligned
    windows) the count is the same: their queries are copied, and their SDPA keeps its output and
    log-sum-exp."""
    kept = 4 * slots * case.dim * case.act_bytes + 4 * case.num_heads * slots
    return MixingMemory(infer=kept, train=kept)


def triton_memory(case: CostCase, num_tokens: int) -> MixingMemory:
    """The tiled local engine on its fused Triton kernels (:func:`visattn.ops.local.triton.triton_local_attn`)
    over ``num_tokens`` tokens: the output and an fp32 log-sum-exp per token and head; for the backward
    also q, k and v, views of the qkv projection, which autograd keeps whole. Nothing per tile, no copy
    and no mask (the prefix rows' partial sums, a few values per key segment, are left out)."""
    out = num_tokens * case.dim * case.act_bytes + 4 * case.num_heads * num_tokens
    return MixingMemory(infer=out, train=out + 3 * num_tokens * case.dim * case.act_bytes)


def local_memory(
    case: CostCase, rows: AxisTiling, cols: AxisTiling, num_prefix_tokens: int, prefix_visible: bool
) -> MixingMemory:
    """The tiled local engine (:func:`visattn.ops.local.tiled_local_attn`, with its ``num_prefix_tokens``
    and ``prefix_visible``) on the path it takes on the case's device in each mode
    (:func:`visattn.ops.local.planned_local_backend`: a path forced by ``force_backend``, else the chosen
    one): :func:`triton_memory` on the Triton kernels, :func:`flex_memory` on FlexAttention, else
    :func:`tiled_memory`. The dense path of short sequences is counted as the tiles
    too, an approximation: it keeps an N x N additive mask instead of the gathered tiles and their mask."""
    def on_path(needs_grad: bool) -> MixingMemory:
        path = planned_local_backend(case.device, needs_grad, 0.0, rows, cols, num_prefix_tokens, prefix_visible)
        if path == "triton":
            return triton_memory(case, num_prefix_tokens + case.layout.num_patches)
        if path == "flex":
            return flex_memory(case, flex_slots(rows, cols, num_prefix_tokens, prefix_visible))
        num_visible = num_prefix_tokens if prefix_visible else 0
        return tiled_memory(case, rows, cols, num_visible)

    infer, train = on_path(False), on_path(True)
    # where the two modes' paths differ (the CPU's chunks and gathered tiles) both read the same mask
    return MixingMemory(infer=infer.infer, train=train.train, shared=train.shared)
