"""The attention-layer contract shared by every visattn layer.

Each layer honours timm's ``attn_layer`` contract (``timm.models.vision_transformer.Block``): the
constructor takes ``dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
norm_layer, device, dtype`` and the forward is ``forward(x, attn_mask=None, is_causal=False)`` on
``x`` of shape (B, N, C). The parameters are timm's (``qkv``, ``q_norm``, ``k_norm``, ``norm``,
``proj``), so weights move between attention types and from a stock timm ViT.

A 2D layer also needs the patch grid. It is told, never guessed: the model calls
:meth:`GridAttention.set_grid` with (H, W) and the number of prefix (class/register) tokens before the
blocks run, and the forward checks that ``N == num_prefix_tokens + H * W``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn as nn


class GridAttention(nn.Module, ABC):
    """qkv -> token mixing (:meth:`mix`, one op of :mod:`visattn.ops`) -> proj.

    Subclasses set ``name`` and the capability flags, and implement :meth:`mix`.
    """

    name: ClassVar[str]
    needs_grid: ClassVar[bool] = True  # mixing depends on the 2D layout of the patch tokens
    supports_causal: ClassVar[bool] = False
    supports_attn_mask: ClassVar[bool] = False
    supports_attn_drop: ClassVar[bool] = False  # there is an attention matrix whose weights can be dropped

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads != 0:
            raise ValueError(f"{self.name}: dim={dim} must be divisible by num_heads={num_heads}")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError(f"{self.name}: qk_norm / scale_norm need a norm_layer (e.g. nn.LayerNorm)")
        if attn_drop and not self.supports_attn_drop:
            raise ValueError(
                f"{self.name}: attention has no weight matrix to drop; attn_drop must be 0, got {attn_drop}"
            )
        dd = {"device": device, "dtype": dtype}
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.grid: tuple[int, int] | None = None
        self.num_prefix_tokens = 0

    def set_grid(self, grid: tuple[int, int], num_prefix_tokens: int = 0) -> None:
        """Tell the layer the patch grid (H, W) and how many prefix tokens precede the patches."""
        h, w = (int(g) for g in grid)
        if h < 1 or w < 1 or num_prefix_tokens < 0:
            raise ValueError(
                f"{self.name}: grid must be (H, W) with H, W >= 1 and num_prefix_tokens >= 0, "
                f"got grid={tuple(grid)}, num_prefix_tokens={num_prefix_tokens}"
            )
        self.grid = (h, w)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def _checked_grid(self, num_tokens: int) -> tuple[int, int] | None:
        if not self.needs_grid:
            return self.grid
        if self.grid is None:
            raise ValueError(
                f"{self.name}: the patch grid is not set; build the model with timm.create_model('visattn_vit_...'), "
                "use visattn.convert(model, ...), or call set_grid((H, W), num_prefix_tokens) first"
            )
        h, w = self.grid
        if self.num_prefix_tokens + h * w != num_tokens:
            raise ValueError(
                f"{self.name}: N={num_tokens} tokens do not match num_prefix_tokens={self.num_prefix_tokens} "
                f"+ grid {h}x{w} = {self.num_prefix_tokens + h * w}"
            )
        return self.grid

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: (B, N, C) with N = num_prefix_tokens + H * W -> (B, N, C)."""
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: x must be (B, N, {self.dim}), got shape {tuple(x.shape)}")
        if attn_mask is not None and not self.supports_attn_mask:
            raise ValueError(f"{self.name}: attn_mask is not supported; only attn='softmax' accepts a mask")
        if is_causal and not self.supports_causal:
            raise ValueError(
                f"{self.name}: is_causal=True is not supported; causal attention is offered by 'softmax' and 'linear'"
            )
        grid = self._checked_grid(x.shape[1])
        x = self.project_and_mix(x, grid, attn_mask, is_causal)
        x = self.norm(x)
        x = self.proj(x)
        return self.proj_drop(x)

    def project_and_mix(
        self, x: torch.Tensor, grid: tuple[int, int] | None, attn_mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        """The qkv projection, then :meth:`mix`: (B, N, C) -> (B, N, C) with the heads merged. A layer
        whose mixing commutes with part of the projection overrides this to fuse the two."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, d)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self.mix(q, k, v, grid=grid, attn_mask=attn_mask, is_causal=is_causal)  # (B, heads, N, d)
        return x.transpose(1, 2).reshape(B, N, C)

    @abstractmethod
    def mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: tuple[int, int] | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """Token mixing on (B, heads, N, d) -> (B, heads, N, d)."""

    @property
    def dropout_p(self) -> float:
        return self.attn_drop.p if self.training else 0.0

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}"
