"""Non-causal linear attention fused with the qkv projection, for inference: the (B, N, 3 C) projection
is never formed."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from visattn.ops.checks import check_positive_int
from visattn.ops.layout import split_heads
from visattn.ops.linear.blocked import Block, TokenBlocks, attend, kv_state
from visattn.ops.linear.feature_maps import get_feature_map


def _check_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> None:
    op = "fused_qkv_linear_attn"
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be (B, N, C_in), got shape {tuple(x.shape)}")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] % 3:
        raise ValueError(
            f"{op}: qkv_weight must be (3 C, C_in) with C_in={x.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    check_positive_int(num_heads, "num_heads", op)
    if (weight.shape[0] // 3) % num_heads:
        raise ValueError(f"{op}: num_heads={num_heads} must divide C={weight.shape[0] // 3}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: qkv_bias must be None or ({weight.shape[0]},), got shape {tuple(bias.shape)}")


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
    _check_projection(x, qkv_weight, qkv_bias, num_heads)
    phi = get_feature_map(feature_map)
    batch, n, _ = x.shape
    dim = qkv_weight.shape[0] // 3
    q_norm = q_norm or (lambda t: t)
    k_norm = k_norm or (lambda t: t)
    q_bias, kv_bias = (None, None) if qkv_bias is None else (qkv_bias[:dim], qkv_bias[dim:])
    device = x.device.type
    caller_autocast = {"enabled": torch.is_autocast_enabled(device), "dtype": torch.get_autocast_dtype(device)}

    values_dtype = caller_autocast["dtype"] if caller_autocast["enabled"] else x.dtype
    values = x.new_empty(batch, n, dim, dtype=values_dtype) if keep_values else None
    tokens = x.reshape(batch * n, -1)  # a block's tokens are consecutive rows of it

    def project(block: Block, out_features: slice, bias: torch.Tensor | None) -> torch.Tensor:
        """The block's tokens projected by the weight rows ``out_features``: (b, n, len(out_features))."""
        with torch.autocast(device_type=device, **caller_autocast):  # as the plain projection would run
            return F.linear(tokens[block.rows], qkv_weight[out_features], bias).view(*block.size, -1)

    def keys_values(block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        keys, vals = project(block, slice(dim, None), kv_bias).chunk(2, dim=-1)  # (b, n, C) each
        if values is not None:
            values.view(batch * n, dim)[block.rows].view_as(vals).copy_(vals)  # one copy: vals is a strided view
        return k_norm(split_heads(keys, num_heads)), split_heads(vals, num_heads)

    def queries(block: Block) -> torch.Tensor:
        return q_norm(split_heads(project(block, slice(None, dim), q_bias), num_heads))

    d = dim // num_heads
    blocks = TokenBlocks(batch, num_heads, n, d + 1, x.device)
    with torch.autocast(device_type=device, enabled=False):
        state = kv_state(keys_values, blocks, phi, batch)
        out = x.new_empty(batch, n, dim, dtype=values_dtype)  # in the values' dtype, as in linear_attn()
        attend(queries, state, blocks, phi, eps, split_heads(out, num_heads))
    return (out, values) if keep_values else out
