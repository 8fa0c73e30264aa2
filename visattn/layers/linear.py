"""Linear attention layer (Katharopoulos et al. 2020), with an optional 2D locality term and an optional
spatial decay."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory
from visattn.layers.decay import SpatialDecay, check_decay_option
from visattn.layers.feature_map import (
    LEARNED_BASE_MAP, LEARNED_FEATURE_MAP, LearnedFeatureMap, check_feature_map_option,
)
from visattn.ops.backends import choose_projected_linear_backend, planned_backend
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.linear import decayed_linear_attn, linear_attn, projected_linear_attn
from visattn.ops.linear.decay import TILE_SIZE
from visattn.ops.linear.locality import add_locality
from visattn.ops.linear.triton import CUDA_SEGMENT, triton_refusal


class LinearAttention(GridAttention):
    """``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)`` over all tokens; O(N d^2) per head.

    Type options:
        feature_map: ``"elu"`` (elu + 1, default), ``"relu"``, or ``"learned"``: elu + 1 after a learnable
            d x d matrix per head for q and one for k, initialised to the identity (so untrained it computes
            exactly ``"elu"``), which attention transfer (:func:`visattn.models.transfer`) trains to mimic
            softmax's spiky weights (Hedgehog, LoLCATs; :class:`visattn.layers.feature_map.LearnedFeatureMap`).
            The layer applies the matrices to the split heads, so it always runs the ``"split"`` projection path.
        chunk_size: chunk length of the causal form (``is_causal=True``, raster order).
        dwconv_kernel: odd k: add a depthwise k x k convolution of V over the patch grid to the output
            (the locality term of FLatten Transformer and MLLA); None: pure linear attention, which then
            needs no grid and supports ``is_causal``. The default is 3 because linear attention alone
            spreads its weight thinly over all tokens and has no notion of neighbourhood, which image
            tasks depend on; the smallest window that has neighbours restores it for little compute.
        decay: None (off), True, or [first, last]: weight each patch key by ``gamma_h ** (|row_i - row_j|
            + |col_i - col_j|)`` for the patch query i (RMT's Manhattan decay;
            :func:`visattn.ops.decayed_linear_attn`), one learnable rate per head in (0, 1). True starts the
            heads at RMT's rates ``1 - 2 ** -(2 + 4 h / H)``; [first, last] from ``first`` to ``last`` with
            ``log(1 - gamma)`` evenly spaced (:class:`visattn.layers.decay.SpatialDecay`). Needs the grid;
            not causal.
        rope: see :class:`visattn.layers.base.GridAttention`. Linear attention has no score matrix to rotate:
            the op turns the features phi(q), phi(k) in the numerator only, and the normalizer keeps the
            unrotated ones, so it stays positive (RoFormer's linear attention; :func:`visattn.ops.linear_attn`).
    """

    name = "linear"
    supports_causal = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        feature_map: str = "elu",
        chunk_size: int = 64,
        dwconv_kernel: int | None = 3,
        decay: bool | Sequence[float] | None = None,
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_feature_map_option(feature_map, self.name)
        decay_init = check_decay_option(decay, self.name)
        if dwconv_kernel is not None and (not isinstance(dwconv_kernel, int) or dwconv_kernel < 1 or dwconv_kernel % 2 == 0):
            raise ValueError(f"linear: dwconv_kernel must be None or an odd integer >= 1, got {dwconv_kernel!r}")
        self.feature_map = feature_map
        self.chunk_size = chunk_size
        dd = self.factory_kwargs
        self.dwconv = (
            nn.Conv2d(dim, dim, dwconv_kernel, padding=dwconv_kernel // 2, groups=dim, **dd) if dwconv_kernel else None
        )
        self.spatial_decay = None if decay_init is None else SpatialDecay(num_heads, decay_init, **dd)
        learned = feature_map == LEARNED_FEATURE_MAP
        self.learned_map = LearnedFeatureMap(num_heads, self.head_dim, **dd) if learned else None
        # the parameter-free map the op applies (after the learned projection, if any)
        self.op_feature_map = LEARNED_BASE_MAP if learned else feature_map

    @property
    def needs_grid(self) -> bool:  # type: ignore[override]
        return self.dwconv is not None or self.spatial_decay is not None

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """The qkv projection, the mixing and the locality term in one op,
        :func:`visattn.ops.linear.projected_linear_attn`, on the path it picks (force one with
        ``force_backend("projected_linear", ...)``). With ``decay``, the heads split from the projection and
        :meth:`mix`, which runs the decayed op."""
        if self.spatial_decay is not None:
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        dwconv = self.dwconv
        return projected_linear_attn(
            x, self.qkv.weight, self.qkv.bias, self.num_heads, self.op_feature_map,
            causal=is_causal, chunk_size=self.chunk_size,
            rope=None if self.rope is None else self.rope(grid, self.num_prefix_tokens, x),
            grid=grid, num_prefix_tokens=self.num_prefix_tokens,
            conv_weight=None if dwconv is None else dwconv.weight, conv_bias=None if dwconv is None else dwconv.bias,
            q_norm=_unless_identity(self.q_norm), k_norm=_unless_identity(self.k_norm), qk_map=self.learned_map,
        )

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        if is_causal and self.dwconv is not None:
            raise ValueError("linear: is_causal=True cannot be combined with dwconv_kernel (the convolution sees later tokens)")
        if is_causal and self.spatial_decay is not None:
            raise ValueError("linear: is_causal=True cannot be combined with decay (it weighs keys on both sides of the query)")
        rope = None if self.rope is None else self.rope(grid, self.num_prefix_tokens, q)
        if self.learned_map is not None:
            q, k = self.learned_map(q, k)  # (B, heads, N, d)
        if self.spatial_decay is not None:
            out = decayed_linear_attn(
                q, k, v, self.spatial_decay(), grid, self.num_prefix_tokens, feature_map=self.op_feature_map, rope=rope
            )
        else:
            out = linear_attn(
                q, k, v, feature_map=self.op_feature_map, causal=is_causal, chunk_size=self.chunk_size, rope=rope
            )
        if self.dwconv is None:
            return out
        # (B, N, C): a view when the op's output is token-major, a copy otherwise (the plain path)
        merged = add_locality(
            merge_heads(out), merge_heads(v), grid, self.num_prefix_tokens, self.dwconv.weight, self.dwconv.bias
        )
        return split_heads(merged, self.num_heads)

    def rotate(self, q, k, grid) -> tuple[torch.Tensor, torch.Tensor]:
        """Unchanged: :meth:`mix` hands the rope table to the op, which rotates the features of the
        numerator only."""
        return q, k

    def extra_repr(self) -> str:
        return super().extra_repr() + f", feature_map={self.feature_map!r}"

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """``4 N C (d + 1)``: the state phi(K)^T [V | 1] and phi(Q) [S | z] are ``2 N d (d + 1)`` each per head;
        with ``rope``, ``2 N C (2 d + 1)``: (R phi(K))^T V and (R phi(Q)) S are ``2 N d^2`` each, the
        normalizer phi(Q) z ``2 N d``;
        with ``decay``, instead, the products of :func:`decayed_linear_flops` per head;
        plus ``2 M C k^2`` for the depthwise k x k convolution over the M patches (``dwconv_kernel``);
        plus ``4 N C d`` for a learned feature map (q and k through a d x d matrix per head)."""
        layout, options, d = case.layout, case.options, case.head_dim
        n, c = layout.num_tokens, case.dim
        rotated = options.get("rope") is not None
        if check_decay_option(options.get("decay"), cls.name) is None:
            flops = 2 * n * c * (2 * d + 1) if rotated else 4 * n * c * (d + 1)
        else:
            flops = case.num_heads * decayed_linear_flops(layout.grid, layout.num_prefix_tokens, d, rotated=rotated)
        kernel = options["dwconv_kernel"]
        if kernel:
            flops += 2 * layout.num_patches * c * kernel**2
        if options.get("feature_map") == LEARNED_FEATURE_MAP:
            flops += LearnedFeatureMap.flops(n, case.num_heads, d)
        return flops

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """Token blocks of fp32 work stay small; the output is the only N x C tensor. The backward keeps q,
        k, v (the qkv output) and the (d, d + 1) state, and recomputes the feature maps.

        With ``decay``, fp32 copies of N x (C + heads) values: the forward holds about eight (the feature
        maps, [V, 1], their grid copies, the numerators and normalizers, the output) and the column states
        of the heads (six tensors of W d (d + 1) values per head, at most); the backward keeps about six
        (the feature maps' inputs, their grid copies, the numerators and normalizers).

        A learned feature map adds the mapped q and k, two N x C tensors, live in the forward and kept
        for the backward (the matrices' gradient needs q and k, the op's the mapped ones).

        Where the op takes its Triton kernels (on CUDA, in each mode as the chooser would: see
        :meth:`_triton_memory`), their figures replace these."""
        layout, options, act_bytes = case.layout, case.options, case.act_bytes
        n, c, heads, d = layout.num_tokens, case.dim, case.num_heads, case.head_dim
        infer, train = n * c * act_bytes, 3 * n * c * act_bytes
        if check_decay_option(options.get("decay"), cls.name) is not None:
            states = 6 * heads * layout.grid[1] * d * (d + 1)
            infer += (8 * n * (c + heads) + states) * 4
            train += 6 * n * (c + heads) * 4
        if options["dwconv_kernel"]:
            infer += 3 * layout.num_patches * c * act_bytes
            train += 2 * layout.num_patches * c * act_bytes
        if options.get("feature_map") == LEARNED_FEATURE_MAP:
            infer += 2 * n * c * act_bytes
            train += 2 * n * c * act_bytes
        return cls._triton_memory(case, MixingMemory(infer=infer, train=train))

    @classmethod
    def _triton_memory(cls, case: CostCase, other_paths: MixingMemory) -> MixingMemory:
        """``other_paths`` with each mode the op runs on its Triton kernels (on ``case.device``, or forced;
        without decay, a learned feature map, or in training a rope table with learned frequencies) replaced by
        theirs: the forward holds the output, the fp32 state [S | z] (4 d (d + 1) bytes a head) and, beyond
        one segment of tokens, a partial state per segment; the backward keeps q, k, v (the projection)
        and the state. The locality term inside the kernels adds nothing."""
        layout, options, act_bytes = case.layout, case.options, case.act_bytes
        n, c, heads, d = layout.num_tokens, case.dim, case.num_heads, case.head_dim
        if check_decay_option(options.get("decay"), cls.name) is not None:
            return other_paths
        learned, rope = options.get("feature_map") == LEARNED_FEATURE_MAP, options.get("rope")

        def on_triton(training: bool) -> bool:
            refusal = triton_refusal(
                causal=False, has_qk_norm=False, qk_map=learned, rope_needs_grad=training and rope == "mixed",
                head_dim=d, num_tokens=n, dtype=torch.float32 if act_bytes == 4 else torch.bfloat16,
            )

            def choose() -> str:
                return choose_projected_linear_backend(
                    case.device, False, False, rope is not None, learned, triton_refusal=refusal
                )

            return planned_backend("projected_linear", choose) == "triton"

        state = 4 * heads * d * (d + 1)
        segments = -(-n // CUDA_SEGMENT)
        partials = state * segments if segments > 1 else 0
        return MixingMemory(
            infer=n * c * act_bytes + state + partials if on_triton(False) else other_paths.infer,
            train=3 * n * c * act_bytes + state if on_triton(True) else other_paths.train,
        )


def _unless_identity(norm: nn.Module) -> nn.Module | None:
    """A q or k norm as the op takes it: None where the layer has none (``nn.Identity``)."""
    return None if isinstance(norm, nn.Identity) else norm


def decayed_linear_flops(
    grid: tuple[int, int], num_prefix_tokens: int, head_dim: int, tile_size: int = TILE_SIZE, rotated: bool = False
) -> int:
    """Forward FLOPs of :func:`visattn.ops.decayed_linear_attn` for one head and one image: 2 per multiply-add
    of every product it computes, the zero padding of partial tiles included. ``rotated`` (a rope table): the
    numerator's product on d values and the normalizer's on one, instead of one product on d + 1."""
    if rotated:
        return sum(_decayed_sums_flops(grid, num_prefix_tokens, head_dim, m, tile_size) for m in (head_dim, 1))
    return _decayed_sums_flops(grid, num_prefix_tokens, head_dim, head_dim + 1, tile_size)


def _decayed_sums_flops(grid: tuple[int, int], num_prefix_tokens: int, d: int, m: int, tile_size: int) -> int:
    """FLOPs of the op's tiled sums (``visattn.ops.linear.decay._decayed_sums``) with keys of width d and
    values of width m: the explicit scores of each tile, the edge sums within a tile-row, the column states
    swept down and up the grid, and the prefix tokens' plain products."""
    height, width = grid
    th, tw = min(tile_size, height), min(tile_size, width)
    n_rows, n_cols = -(-height // th), -(-width // tw)
    tile = th * tw
    per_tile_row = n_cols * tile * tile * (d + m)  # explicit scores and their sum over values
    state_filter = n_cols * tw * tw * d * m if tw > 1 else 0  # Gamma_W within tiles
    if n_cols > 1:
        # edge sums, carried across, rows mixed (a single row needs no mixing), read; both edges at once
        per_tile_row += tile * n_cols * d * 2 * m + 2 * th * n_cols**2 * d * m + tile * n_cols * d * 2 * m
        per_tile_row += th * th * n_cols * d * 2 * m if th > 1 else 0
        state_filter += 2 * (2 * n_cols * tw * d * m + n_cols**2 * d * m)  # to the edges, across, back
    # each sweep: a summary of every tile-row but the last, a filtered state read by every one but the first
    sweeps = 2 * (n_rows - 1) * (2 * tile * n_cols * d * m + state_filter)
    prefix = 2 * (num_prefix_tokens + height * width) * d * m if num_prefix_tokens else 0
    return 2 * (n_rows * per_tile_row + sweeps + prefix)
