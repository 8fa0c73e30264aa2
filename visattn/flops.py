"""Analytic cost model of a visattn ViT: FLOPs and activation memory per attention type.

Counting rules
--------------
FLOPs are those of the matrix products (2 per multiply-add), the convention of fvcore and of timm's
``infer_gmacs`` (GMACs = GFLOPs / 2). Elementwise work (norms, GELU, softmax, feature maps, masks) is
not counted. The whole model is counted, per image, forward:

* patch embedding: ``2 HW (c_in p_h p_w) C`` for an H x W patch grid and C = embed_dim;
* per block: ``qkv 6 N C^2`` + ``proj 2 N C^2`` + ``MLP 4 N C C_mlp`` + the token mixing of the type,
  with N = P + HW tokens (P prefix tokens: class + register);
* head: ``2 C num_classes`` (one pooled token).

A training step (forward + backward) costs ``3 x forward - patch embedding``: the backward of a product
is two products of the same size, except that no gradient flows into the image. Work an implementation
repeats to save memory (linear attention recomputes ``phi(Q) [S | z]`` in its backward) is not
counted: the count is of the model's math, as for model-FLOPs utilisation.

Token mixing per block (h heads of width d, C = h d, M = HW patch tokens):

============  ==================================================================================
softmax       ``4 N^2 C``  (QK^T and AV, each 2 N^2 d per head)
floor         0            (V passes through)
linear        ``2 N C (2d + 1)``  (phi(K)^T V is 2 N d^2, phi(Q) [KV | sum phi(K)] is 2 N d (d + 1))
              ``+ 2 M C k^2`` with the depthwise k x k convolution (``dwconv_kernel``)
axial         ``4 C (M (2P + H + W) + P N)``  (rows: M queries x (P + W) keys, columns: x (P + H),
              prefix queries: P x N)
neighborhood  ``4 C (S_H S_W + P N)``; ``S_L = L min(k, L)``: the k x k window of every patch
sparse        ``4 C (S_H S_W + P N)``; ``S_L = sum_i |block(i) + halo|``: each query's block plus
              halo, cut at the border
longformer    ``4 C (S_H S_W + M G + G (G + M))`` with its local window (neighborhood or sparse),
              G = P + extra global tokens; ``+ 6 E C^2`` to project E extra global tokens (once per
              forward, whatever the batch; counted per image as if the batch were 1)
linformer     ``4 C (k M + N (P + k))``  (K and V projected to k tokens, then N x (P + k) attention);
              with k < M the layer projects the input first, ``E X`` then ``W_k``, ``W_v``: its qkv
              projection costs ``2 N C^2 + 4 (P + k) C^2`` instead of ``6 N C^2`` (without a key norm)
============  ==================================================================================

The local types (neighborhood, sparse, longformer) count the keys each query is defined to see; the
tiled implementation also computes scores over the rest of each tile's key region and masks them, so
it executes more products than it is credited with. Where implementation and definition coincide, the
forward counts equal ``torch.utils.flop_counter.FlopCounterMode`` on the math path of
``scaled_dot_product_attention`` (the fused CPU kernel hides its products from the counter); the
tests check this for every registered type.

Memory
------
:func:`estimate_memory` is the memory a configuration allocates on top of the runtime itself (CUDA
context, interpreter and libraries are not included): parameters (x4 in training: weights,
gradients and the two AdamW moments), the activations saved for the backward (training) or the
largest live set of one block (inference), and each type's own buffers, from the implementation:
saved tensors, the gathered tiles and the cached mask of the tiled local engine, recomputation
instead of storage where an op checkpoints (axial, linear), the resampled Linformer projections. It is an estimate for deciding what to
skip, good to a small factor; ``visattn-bench`` measures the real peak.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.nn as nn

from visattn.layers import get_attention
from visattn.layers.base import GridAttention

# The naive twin of softmax attention (explicit N x N scores), timed by the ops benchmark beside the layers.
EXPLICIT_SOFTMAX = "softmax_explicit"


@dataclass(frozen=True)
class ViTShape:
    """What the cost model needs to know about a timm ``VisionTransformer``."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_hidden: int
    patch_size: tuple[int, int]
    in_chans: int
    num_prefix_tokens: int
    num_classes: int

    @classmethod
    def from_model(cls, model: nn.Module) -> ViTShape:
        """Read the shape off a timm ``VisionTransformer`` (also one built on the meta device)."""
        block = model.blocks[0]
        head = model.head
        return cls(
            embed_dim=model.embed_dim,
            depth=len(model.blocks),
            num_heads=block.attn.num_heads,
            mlp_hidden=block.mlp.fc1.out_features,
            patch_size=tuple(model.patch_embed.patch_size),
            in_chans=model.patch_embed.proj.in_channels,
            num_prefix_tokens=model.num_prefix_tokens,
            num_classes=head.out_features if isinstance(head, nn.Linear) else 0,
        )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def grid(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The patch grid (H, W) of an image of ``img_size`` (height, width) pixels."""
        return img_size[0] // self.patch_size[0], img_size[1] // self.patch_size[1]

    def layout(self, img_size: tuple[int, int]) -> TokenLayout:
        return TokenLayout(self.grid(img_size), self.num_prefix_tokens)


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


class MixingMemory(NamedTuple):
    """Bytes of one block's token mixing, per image unless said otherwise."""

    infer: int  # live during the forward, beyond q, k, v: outputs, copies, scores
    train: int  # saved for the backward (including q, k, v when the op keeps them)
    shared: int = 0  # per block and batch-independent: masks, resampled projections


class CostModel(NamedTuple):
    flops: Callable[[TokenLayout, int, int, Mapping[str, Any]], int]
    memory: Callable[[TokenLayout, int, int, Mapping[str, Any], int], MixingMemory]
    # FLOPs of the qkv projection (layout, C, options), where the type runs it on fewer tokens than N
    qkv_flops: Callable[[TokenLayout, int, Mapping[str, Any]], int] | None = None


# ---------------------------------------------------------------------------------------------------
# Per-type formulas. Arguments: layout, heads h, head width d, resolved options, bytes per activation.


def _softmax_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    return 4 * layout.num_tokens**2 * h * d


def _softmax_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    # Fused SDPA: the output and an fp32 log-sum-exp per row; the backward keeps q, k, v (the qkv output).
    n, c = layout.num_tokens, h * d
    return MixingMemory(infer=n * c * act, train=4 * n * c * act + 4 * h * n)


def _explicit_softmax_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    # scores and probabilities, h x N x N each; the backward keeps the probabilities, q, k, v.
    n, c = layout.num_tokens, h * d
    return MixingMemory(infer=(2 * h * n * n + n * c) * act, train=(h * n * n + 4 * n * c) * act)


def _floor_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    return 0


def _floor_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    return MixingMemory(infer=0, train=0)


def _linear_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    n, c = layout.num_tokens, h * d
    flops = 2 * n * c * (2 * d + 1)
    kernel = options.get("dwconv_kernel")
    if kernel:
        flops += 2 * layout.num_patches * c * kernel**2
    return flops


def _linear_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    # Token blocks of fp32 work stay small; the output is the only N x C tensor. The backward keeps q, k, v
    # (the qkv output) and the (d, d + 1) state, and recomputes the feature maps.
    n, c = layout.num_tokens, h * d
    infer, train = n * c * act, 3 * n * c * act
    if options.get("dwconv_kernel"):
        infer += 3 * layout.num_patches * c * act
        train += 2 * layout.num_patches * c * act
    return MixingMemory(infer=infer, train=train)


def _axial_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    (rows, cols), p, m = layout.grid, layout.num_prefix_tokens, layout.num_patches
    return 4 * h * d * (m * (2 * p + rows + cols) + p * layout.num_tokens)


def _axial_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    # Inference: the row-mixed values and the output (the hops run in cache-sized chunks). Training keeps
    # only q, k, v and recomputes the hops in the backward (checkpointing).
    n, c = layout.num_tokens, h * d
    return MixingMemory(infer=2 * n * c * act, train=3 * n * c * act)


def _neighborhood_axis(length: int, kernel_size: int, tile_size: int) -> tuple[int, int, int, int]:
    """(keys seen summed over the axis's queries, tiles, tile side, key-region side) of one axis."""
    k, tile = min(kernel_size, length), min(tile_size, length)
    return length * k, math.ceil(length / tile), tile, min(tile + k - 1, length)


def _blocked_axis(length: int, block_size: int, halo: int) -> tuple[int, int, int, int]:
    block = min(block_size, length)
    starts = range(0, length, block)
    seen = sum(
        (min(s + block, length) - s) * (min(s + block + halo, length) - max(s - halo, 0)) for s in starts
    )
    return seen, len(starts), block, min(block + 2 * halo, length)


def _local_axes(layout: TokenLayout, options: Mapping[str, Any], local: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rows, cols = layout.grid
    if local == "neighborhood":
        k, t = options["kernel_size"], options["tile_size"]
        return _neighborhood_axis(rows, k, t), _neighborhood_axis(cols, k, t)
    b, halo = options["block_size"], options["halo"]
    return _blocked_axis(rows, b, halo), _blocked_axis(cols, b, halo)


def _tiled_memory(
    layout: TokenLayout, h: int, d: int, local: str, options: Mapping[str, Any], num_visible: int, act: int
) -> MixingMemory:
    """The tiled local engine. Inference runs the tiles in cache-sized chunks into the output. Training
    gathers the padded query tiles and each tile's key region (plus the ``num_visible`` prefix keys),
    which the fused SDPA keeps with its output and an fp32 log-sum-exp per query. The additive mask
    (queries x keys of every tile) is cached per layout."""
    (_, tiles_h, tile_h, region_h), (_, tiles_w, tile_w, region_w) = _local_axes(layout, options, local)
    c = h * d
    queries = tiles_h * tile_h * tiles_w * tile_w  # padded
    keys_per_tile = region_h * region_w + num_visible
    keys = tiles_h * tiles_w * keys_per_tile  # gathered, for k and again for v
    # The prefix rows attend to all tokens in an SDPA that keeps q, k, v: the whole qkv output.
    prefix = 3 * layout.num_tokens * c if layout.num_prefix_tokens or num_visible else 0
    train = (2 * queries + 2 * keys) * c * act + 4 * h * queries + prefix * act
    return MixingMemory(infer=layout.num_tokens * c * act, train=train, shared=queries * keys_per_tile * act)


def _windowed_flops(layout: TokenLayout, h: int, d: int, local: str, options: Mapping[str, Any]) -> int:
    (seen_h, *_), (seen_w, *_) = _local_axes(layout, options, local)
    return 4 * h * d * (seen_h * seen_w + layout.num_prefix_tokens * layout.num_tokens)


def _neighborhood_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    return _windowed_flops(layout, h, d, "neighborhood", options)


def _neighborhood_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    return _tiled_memory(layout, h, d, "neighborhood", options, 0, act)


def _sparse_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    return _windowed_flops(layout, h, d, "sparse", options)


def _sparse_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    return _tiled_memory(layout, h, d, "sparse", options, 0, act)


def _longformer_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    (seen_h, *_), (seen_w, *_) = _local_axes(layout, options, options["local"])
    extra = options["num_extra_global_tokens"]
    g, m, c = layout.num_prefix_tokens + extra, layout.num_patches, h * d
    return 4 * c * (seen_h * seen_w + m * g + g * (g + m)) + 6 * extra * c * c


def _longformer_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    g = layout.num_prefix_tokens + options["num_extra_global_tokens"]  # every patch sees the global keys
    return _tiled_memory(layout, h, d, options["local"], options, g, act)


def _linformer_flops(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any]) -> int:
    k, p = options["k"], layout.num_prefix_tokens
    return 4 * h * d * (k * layout.num_patches + layout.num_tokens * (p + k))


def _linformer_qkv_flops(layout: TokenLayout, c: int, options: Mapping[str, Any]) -> int:
    # With k < H W the keys and values are projected from E X: on P + k tokens instead of N
    k, n = options["k"], layout.num_tokens
    if k >= layout.num_patches:
        return 6 * n * c * c
    return 2 * n * c * c + 4 * (layout.num_prefix_tokens + k) * c * c


def _linformer_memory(layout: TokenLayout, h: int, d: int, options: Mapping[str, Any], act: int) -> MixingMemory:
    # Projected keys/values (k x C each) and the output; the backward keeps q, k, v. Each block resamples
    # its two (k, H W) projections, shared by the batch; the backward keeps them.
    k, n, c = options["k"], layout.num_tokens, h * d
    return MixingMemory(
        infer=(n * c + 4 * k * c) * act,
        train=(4 * n * c + 4 * k * c) * act,
        shared=2 * k * layout.num_patches * 4,
    )


COST_MODELS: dict[str, CostModel] = {
    "softmax": CostModel(_softmax_flops, _softmax_memory),
    EXPLICIT_SOFTMAX: CostModel(_softmax_flops, _explicit_softmax_memory),
    "floor": CostModel(_floor_flops, _floor_memory),
    "linear": CostModel(_linear_flops, _linear_memory),
    "axial": CostModel(_axial_flops, _axial_memory),
    "neighborhood": CostModel(_neighborhood_flops, _neighborhood_memory),
    "sparse": CostModel(_sparse_flops, _sparse_memory),
    "longformer": CostModel(_longformer_flops, _longformer_memory),
    "linformer": CostModel(_linformer_flops, _linformer_memory, _linformer_qkv_flops),
}


def cost_model(attn: str) -> CostModel:
    try:
        return COST_MODELS[attn]
    except KeyError:
        raise ValueError(f"no cost model for attention {attn!r}; known: {', '.join(COST_MODELS)}") from None


def attention_options(attn: str, attn_kwargs: Mapping[str, Any], grid: tuple[int, int]) -> dict[str, Any]:
    """The type options a layer is built with: its constructor defaults, ``ref_grid`` set to the model's
    grid (as :func:`visattn.convert` does), then ``attn_kwargs``. Types outside the registry
    (``softmax_explicit``) have none."""
    if attn == EXPLICIT_SOFTMAX:
        return dict(attn_kwargs)
    contract = set(inspect.signature(GridAttention.__init__).parameters)
    params = inspect.signature(get_attention(attn).__init__).parameters.values()
    options = {p.name: p.default for p in params if p.name not in contract and p.default is not p.empty}
    if "ref_grid" in options:
        options["ref_grid"] = tuple(grid)
    return options | dict(attn_kwargs)


def mixing_flops(attn: str, layout: TokenLayout, num_heads: int, head_dim: int, options: Mapping[str, Any]) -> int:
    """Forward FLOPs of one block's token mixing for one image."""
    return cost_model(attn).flops(layout, num_heads, head_dim, options)


def patch_embed_flops(shape: ViTShape, img_size: tuple[int, int]) -> int:
    h, w = shape.grid(img_size)
    return 2 * h * w * shape.in_chans * shape.patch_size[0] * shape.patch_size[1] * shape.embed_dim


def vit_flops(shape: ViTShape, img_size: tuple[int, int], attn: str, options: Mapping[str, Any]) -> int:
    """Forward FLOPs of the whole model for one image of ``img_size`` (height, width)."""
    layout = shape.layout(img_size)
    n, c = layout.num_tokens, shape.embed_dim
    model = cost_model(attn)
    qkv = 6 * n * c * c if model.qkv_flops is None else model.qkv_flops(layout, c, options)
    block = qkv + 2 * n * c * c + 4 * n * c * shape.mlp_hidden
    mixing = mixing_flops(attn, layout, shape.num_heads, shape.head_dim, options)
    return patch_embed_flops(shape, img_size) + shape.depth * (block + mixing) + 2 * c * shape.num_classes


def train_flops(shape: ViTShape, img_size: tuple[int, int], attn: str, options: Mapping[str, Any]) -> int:
    """FLOPs of a training step (forward + backward) for one image."""
    return 3 * vit_flops(shape, img_size, attn, options) - patch_embed_flops(shape, img_size)


def estimate_memory(
    shape: ViTShape,
    img_size: tuple[int, int],
    attn: str,
    options: Mapping[str, Any],
    batch_size: int,
    training: bool,
    act_bytes: int,
    param_count: int,
    grad_checkpointing: bool = False,
) -> int:
    """Bytes a forward (``training=False``) or a training step with AdamW allocates at its peak.

    Per image and block, training keeps ``5 N C + 2 N C_mlp`` activations for the backward (the inputs of
    both norms, of qkv, proj, fc1, and of the GELU and fc2) plus the type's saved tensors, and needs
    one block's working set on top during the backward; inference holds at most one block's live set:
    the MLP stage (``2 N C + 2 N C_mlp``) or the attention stage (``6 N C`` plus the type's buffers).
    With gradient checkpointing, training keeps only each block's input (``N C``) and, during the
    backward, one recomputed block's saved activations.
    """
    layout = shape.layout(img_size)
    n, c, hidden = layout.num_tokens, shape.embed_dim, shape.mlp_hidden
    mix = cost_model(attn).memory(layout, shape.num_heads, shape.head_dim, options, act_bytes)
    image = 3 * img_size[0] * img_size[1] * 4 + 2 * n * c * act_bytes
    mlp_stage = (2 * n * c + 2 * n * hidden) * act_bytes
    attention_stage = 6 * n * c * act_bytes + mix.infer
    if training:
        block_saved = (5 * n * c + 2 * n * hidden) * act_bytes + mix.train
        saved = shape.depth * n * c * act_bytes + block_saved if grad_checkpointing else shape.depth * block_saved
        per_image = image + saved + max(mlp_stage, attention_stage)
        return 16 * param_count + shape.depth * mix.shared + batch_size * per_image
    return 4 * param_count + mix.shared + batch_size * (image + max(mlp_stage, attention_stage))
