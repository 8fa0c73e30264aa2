"""The reshapes every op and layer shares, as einops patterns: heads, the packed qkv projection, the
patch grid and the prefix tokens.

Token-major tensors (B, N, heads * d) are what the qkv projection produces and what the output
projection reads; the ops take (B, heads, N, d). All helpers return views where the memory layout
allows, so splitting the heads of a projection and merging the heads of a token-major output copy
nothing.
"""
from __future__ import annotations

import torch
from einops import rearrange


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(..., N, heads * d) -> (..., heads, N, d), a view."""
    return rearrange(x, "... n (heads d) -> ... heads n d", heads=num_heads)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(..., heads, N, d) -> (..., N, heads * d); a view when ``x`` is token-major in memory."""
    return rearrange(x, "... heads n d -> ... n (heads d)")


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (..., heads, N, d) as views of a projection (..., N, 3 * C) laid out as timm's ``qkv``:
    the q, k and v blocks of C channels, each heads x d."""
    return rearrange(qkv, "... n (three heads d) -> three ... heads n d", three=3, heads=num_heads).unbind(0)


def token_major_empty(batch: int, heads: int, n: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, heads, N, d) tensor laid out (B, N, heads, d) in memory, so that :func:`merge_heads`
    of it is a view. Not itself a view, so a caller may add to it in place even under autograd."""
    return like.new_empty_strided((batch, heads, n, d), (n * heads * d, d, heads * d, 1))


def token_major(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, d) laid out (B, N, heads, d) in memory: ``x`` itself when it is, else a copy."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def tokens_to_image(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Patch tokens (B, H * W, C) in raster order -> (B, C, H, W), a view (channels-last in memory)."""
    return rearrange(x, "b (y x) c -> b c y x", y=grid[0], x=grid[1])


def image_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> patch tokens (B, H * W, C) in raster order; a view of a channels-last image."""
    return rearrange(x, "b c y x -> b (y x) c")


def split_prefix(x: torch.Tensor, num_prefix_tokens: int, dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix (class/register) tokens and the patch tokens of ``x`` along the token axis ``dim``, as
    views that may be written to in place: the prefix tokens come first."""
    return x.narrow(dim, 0, num_prefix_tokens), x.narrow(dim, num_prefix_tokens, x.shape[dim] - num_prefix_tokens)
