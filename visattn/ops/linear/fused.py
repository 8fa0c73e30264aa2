"""Non-causal linear attention fused with the qkv projection, for inference: the (B, N, 3 C) projection
is never formed."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from visattn.ops.checks import check_qkv_projection
from visattn.ops.layout import split_heads
from visattn.ops.linear.blocked import Block, TokenBlocks, attend, kv_state
from visattn.ops.linear.feature_maps import get_feature_map


def fused_qkv_linear_attn(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    feature_map: str = "elu",
    eps: float = 1e-6,
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    keep_values: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal linear attention fused with the qkv projection, for inference (no autograd).

    Equal to projecting ``x`` with ``qkv_weight`` (timm's ``qkv``: the q rows, then k, then v; heads of
    ``d = C / num_heads``), applying the norms and :func:`visattn.ops.linear_attn`, but block by block
    of tokens (the blocks of :mod:`visattn.ops.linear.blocked`: whole images, or runs of one image's
    tokens, each a run of consecutive rows of ``x``): a first pass projects the keys and values of a
    block and folds them into ``S`` and ``z``, a second projects the queries of a block and writes its
    output. q, k and v live in cache.

    Args:
        x: (B, N, C_in).
        qkv_weight: (3 C, C_in); qkv_bias: (3 C,) or None.
        q_norm, k_norm: per-head norms on (B, heads, n, d), or None.
        keep_values: also return the projected values (B, N, C), e.g. for a locality term on them.
    Returns:
        (B, N, C), heads merged, in the projection's dtype (autocast applies to the projection; the
        mixing is fp32); with ``keep_values`` also the values.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, qkv_weight) if t is not None):
        raise ValueError("fused_qkv_linear_attn: inference only; use the qkv projection and linear_attn() for autograd")
    check_qkv_projection(x, qkv_weight, qkv_bias, num_heads, "fused_qkv_linear_attn")
    phi = get_feature_map(feature_map)
    projection = _BlockProjection(x, qkv_weight, qkv_bias, num_heads, q_norm, k_norm, keep_values)
    batch, n, _ = x.shape
    blocks = TokenBlocks(batch, num_heads, n, projection.dim // num_heads + 1, x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        state = kv_state(projection.keys_values, blocks, phi, batch)
        out = x.new_empty(batch, n, projection.dim, dtype=projection.dtype)  # the values' dtype, as in linear_attn()
        attend(projection.queries, state, blocks, phi, eps, split_heads(out, num_heads))
    return (out, projection.values) if keep_values else out


class _BlockProjection:
    """The qkv projection of ``x`` one block of tokens at a time, under the caller's autocast, as the plain
    projection would run: the keys and values (normed keys; the values kept in :attr:`values` if asked) and
    the normed queries of a block, each (b, heads, n, d)."""

    def __init__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        num_heads: int,
        q_norm: Callable[[torch.Tensor], torch.Tensor] | None,
        k_norm: Callable[[torch.Tensor], torch.Tensor] | None,
        keep_values: bool,
    ) -> None:
        batch, n, _ = x.shape
        self.dim = dim = weight.shape[0] // 3
        self.num_heads, self.weight = num_heads, weight
        self.q_norm = q_norm or (lambda t: t)
        self.k_norm = k_norm or (lambda t: t)
        self.q_bias, self.kv_bias = (None, None) if bias is None else (bias[:dim], bias[dim:])
        self.device = device = x.device.type
        # the caller's autocast, which the projection of each block runs under as the plain projection would
        self.autocast = {"enabled": torch.is_autocast_enabled(device), "dtype": torch.get_autocast_dtype(device)}
        self.dtype = self.autocast["dtype"] if self.autocast["enabled"] else x.dtype
        self.values = x.new_empty(batch, n, dim, dtype=self.dtype) if keep_values else None
        self.tokens = x.reshape(batch * n, -1)  # a block's tokens are consecutive rows of it

    def project(self, block: Block, out_features: slice, bias: torch.Tensor | None) -> torch.Tensor:
        """The block's tokens projected by the weight rows ``out_features``: (b, n, len(out_features))."""
        with torch.autocast(device_type=self.device, **self.autocast):
            return F.linear(self.tokens[block.rows], self.weight[out_features], bias).view(*block.size, -1)

    def keys_values(self, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        keys, vals = self.project(block, slice(self.dim, None), self.kv_bias).chunk(2, dim=-1)  # (b, n, C) each
        if self.values is not None:  # one copy: vals is a strided view
            self.values.view(-1, self.dim)[block.rows].view_as(vals).copy_(vals)
        return self.k_norm(split_heads(keys, self.num_heads)), split_heads(vals, self.num_heads)

    def queries(self, block: Block) -> torch.Tensor:
        return self.q_norm(split_heads(self.project(block, slice(None, self.dim), self.q_bias), self.num_heads))
