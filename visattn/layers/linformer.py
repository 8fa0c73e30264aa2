"""Linformer attention layer (Wang et al. 2020): keys and values projected along the token axis."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from visattn.layers.base import AUTOCAST_DTYPES, GridAttention
from visattn.layers.cost import CostCase, MixingMemory
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.linformer import area_pooling_projection, linformer_attn, project_keys_values, resample_projection


class LinformerAttention(GridAttention):
    """Every query attends to the prefix keys plus k learned mixtures of the patch keys; O(N k d) per head.

    The projections ``proj_k`` and ``proj_v`` (k, Hr, Wr) are shared by all heads and defined on a
    reference grid; every forward resamples them to the live grid (:func:`visattn.ops.resample_projection`),
    so any image size works. They start as area pooling (:func:`visattn.ops.linformer.area_pooling_projection`):
    at initialisation each query attends to a pooled image, a sensible start that also suits converting a
    pretrained softmax model.

    Type options:
        k: number of projected tokens. Linformer pays off when k is well below the live H * W. k above
            Hr * Wr is accepted: the pooled initialisation then overlaps neighbouring blocks, but the
            projection has at most Hr * Wr independent rows, so such a k only adds cost.
        ref_grid: (Hr, Wr), the grid the projections are defined on; a model passes its own patch grid.
        rope: None only. A projected key is a learned mixture of the keys of all patch positions, so it
            has no position of its own for a rotation to be relative to: rotating the keys before the
            projection would give scores that mix relative offsets with E's absolute weights, and it would
            rule out projecting the tokens before the key projection.
    """

    name = "linformer"
    supports_attn_drop = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        k: int = 256,
        ref_grid: tuple[int, int] = (14, 14),
        rope: str | None = None,
        **contract: Any,
    ) -> None:
        if rope is not None:
            raise ValueError(
                f"linformer: rope={rope!r} is not supported: its projected keys mix all patch positions, so they "
                "have no position to rotate by; use rope=None or another type"
            )
        super().__init__(dim, num_heads, **contract)
        init = area_pooling_projection(k, ref_grid)  # validates k and ref_grid
        self.k = k
        self.ref_grid = (int(ref_grid[0]), int(ref_grid[1]))
        dd = self.factory_kwargs
        self.proj_k = nn.Parameter(init.to(**dd))
        self.proj_v = nn.Parameter(init.to(**dd, copy=True))  # its own storage, not proj_k's

    def reset_parameters(self) -> None:
        """Area-pooling projections (timm's weight init calls this; qkv and proj are its own Linears)."""
        init = area_pooling_projection(self.k, self.ref_grid)
        with torch.no_grad():
            self.proj_k.copy_(init)
            self.proj_v.copy_(init)

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """Without a key norm and with k < H * W, the keys and values are projected along the tokens before
        the key and value projections (:func:`visattn.ops.linformer.project_keys_values`): those then run
        on P + k tokens instead of N, and no key or value of the N tokens is ever formed."""
        # E X costs what E K does, so projecting first saves the key and value projections of H W - k tokens
        if not isinstance(self.k_norm, nn.Identity) or self.k >= grid[0] * grid[1]:
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        C = x.shape[-1]
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type) and {x.dtype, self.qkv.weight.dtype} <= AUTOCAST_DTYPES:
            x = x.to(torch.get_autocast_dtype(device_type))  # one cast of x for both products, in their dtype
        weight, bias = self.qkv.weight, self.qkv.bias
        q = F.linear(x, weight[:C], None if bias is None else bias[:C])
        keys, values = project_keys_values(
            x, *self._live_projections(grid), weight[C:], None if bias is None else bias[C:], self.num_prefix_tokens
        )  # (B, P + k, C) each
        q, keys, values = (split_heads(t, self.num_heads) for t in (q, keys, values))  # (B, heads, n, d)
        return merge_heads(F.scaled_dot_product_attention(self.q_norm(q), keys, values, dropout_p=self.dropout_p))

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        proj_k, proj_v = self._live_projections(grid)
        return linformer_attn(
            q, k, v, proj_k, proj_v, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p
        )

    def _live_projections(self, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """proj_k and proj_v resampled to the live grid, each (k, H * W)."""
        return tuple(resample_projection(p, self.ref_grid, grid) for p in (self.proj_k, self.proj_v))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", k={self.k}, ref_grid={self.ref_grid}"

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """``8 C N (P + k)``: K and V projected to P + k tokens, then N x (P + k) attention. The projection
        is one (P + k, N) matmul over all N tokens whose P identity rows carry the prefix tokens through
        (:func:`visattn.ops.linformer.linformer_attn`, :func:`visattn.ops.linformer.project_keys_values`),
        so its ``4 C (P + k) N`` counts those rows' products too, ``4 C P (N + k)`` beyond the ``4 C k M`` of
        mixing the patches: about P / k of the projection, what a FLOP counter sees."""
        rows = case.layout.num_prefix_tokens + case.options["k"]  # P + k keys and values
        return 8 * case.dim * case.layout.num_tokens * rows

    @classmethod
    def qkv_flops(cls, case: CostCase) -> int:
        """With k < H W the keys and values are projected from ``E X`` (see :meth:`project_and_mix`), on
        P + k tokens instead of N: ``2 N C^2 + 4 (P + k) C^2`` (counted without a key norm)."""
        layout, k, c = case.layout, case.options["k"], case.dim
        if k >= layout.num_patches:
            return super().qkv_flops(case)
        return 2 * layout.num_tokens * c * c + 4 * (layout.num_prefix_tokens + k) * c * c

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """Projected keys and values ((P + k) x C each, the prefix tokens' among them) and the output. The
        backward keeps the output, SDPA's fp32 log-sum-exp per query and head, and, where the tokens are
        projected first (k < H W, see :meth:`project_and_mix`; counted without a key norm), q and the
        projected tokens of the two projections and the keys and values made from them, each (P + k) x C:
        2 N C + 4 (P + k) C; else q, k, v, views of the whole qkv projection, and the keys and values:
        4 N C + 2 (P + k) C. Each block resamples its two (k, H W) projections, shared by the batch, and runs
        them with P identity rows for the prefix tokens, (P + k) x N each in the activations' dtype; the
        backward keeps those."""
        k, n, c, act_bytes = case.options["k"], case.layout.num_tokens, case.dim, case.act_bytes
        rows = case.layout.num_prefix_tokens + k  # P + k keys and values
        kept = 2 * n * c + 4 * rows * c if k < case.layout.num_patches else 4 * n * c + 2 * rows * c
        return MixingMemory(
            infer=(n * c + 4 * rows * c) * act_bytes,
            train=kept * act_bytes + 4 * case.num_heads * n,
            shared=2 * rows * n * act_bytes,
        )
