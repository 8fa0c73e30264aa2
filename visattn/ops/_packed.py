"""timm's qkv projection (B, N, 3 C) as q, k, v views, for the ops that run on the projection itself."""
from __future__ import annotations

import torch


def check_packed_qkv(qkv: torch.Tensor, num_heads: int, op: str) -> None:
    if qkv.ndim != 3 or num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(
            f"{op}: qkv must be (B, N, 3 * C) with C divisible by num_heads={num_heads}, got {tuple(qkv.shape)}"
        )


def split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q, k, v (B, heads, N, d) of a qkv projection (B, N, 3 C) laid out as timm's: the q, k, v
    blocks of C channels, each heads x d."""
    return qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
