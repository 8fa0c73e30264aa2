"""The attention-layer contract shared by every visattn layer.

Each layer honours timm's ``attn_layer`` contract (``timm.models.vision_transformer.Block``): the
constructor takes ``dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
norm_layer, device, dtype`` and the forward is ``forward(x, attn_mask=None, is_causal=False)`` on
``x`` of shape (B, N, C). The parameters are timm's (``qkv``, ``q_norm``, ``k_norm``, ``norm``,
``proj``), so weights move between attention types and from a stock timm ViT. The contract is
written once, on :class:`GridAttention`: a layer with options of its own takes ``dim, num_heads``, its
options keyword-only, and passes the rest of the contract on as ``**contract``.

One option is shared by the types that score q against k and lives here, keyword-only after the contract:
``rope`` (None, ``"axial"`` or ``"mixed"``), a 2D rotary position embedding of q and k over the patch grid
(:mod:`visattn.ops.rope`).

A 2D layer also needs the patch grid. It is told, never guessed: the model calls
:meth:`GridAttention.set_grid` with (H, W) and the number of prefix (class/register) tokens before the
blocks run, and the forward checks that ``N == num_prefix_tokens + H * W``.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn as nn

from visattn.layers.cost import CostCase, MixingMemory
from visattn.layers.rope import GridRope
from visattn.ops.checks import check_grid, check_grid_size, check_nonnegative_int
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.rope import apply_rope, check_rope

AUTOCAST_DTYPES = {torch.float32, torch.float16, torch.bfloat16}  # what torch.autocast casts


class GridAttention(nn.Module, ABC):
    """qkv -> token mixing (:meth:`mix`, one op of :mod:`visattn.ops`) -> proj.

    Subclasses set ``name`` and the capability flags, implement :meth:`mix`, and state their cost
    (:meth:`mixing_flops`, :meth:`mixing_memory`, and :meth:`qkv_flops` where it differs), each from one
    :class:`visattn.layers.cost.CostCase`, which ``visattn-bench`` reads.
    """

    name: ClassVar[str]
    needs_grid: ClassVar[bool] = True  # mixing depends on the 2D layout of the patch tokens
    supports_causal: ClassVar[bool] = False
    supports_attn_mask: ClassVar[bool] = False
    supports_attn_drop: ClassVar[bool] = False  # there is an attention matrix whose weights can be dropped
    takes_rope: ClassVar[bool] = True  # q and k are scored against each other, so rope can turn them

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
        *,
        rope: str | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads != 0:
            raise ValueError(f"{self.name}: dim={dim} must be divisible by num_heads={num_heads}")
        if rope is not None and not self.takes_rope:
            raise ValueError(f"{self.name}: rope must be None: this type scores no query against a key, got {rope!r}")
        check_rope(rope, dim // num_heads, self.name)
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
        self.rope = GridRope(rope, num_heads, self.head_dim, **dd) if rope is not None else None
        self.grid: tuple[int, int] | None = None
        self.num_prefix_tokens = 0

    def set_grid(self, grid: tuple[int, int], num_prefix_tokens: int = 0) -> None:
        """Tell the layer the patch grid (H, W) and how many prefix tokens precede the patches."""
        h, w = check_grid_size(grid, "grid", self.name)
        check_nonnegative_int(num_prefix_tokens, "num_prefix_tokens", self.name)
        self.grid = (h, w)
        self.num_prefix_tokens = num_prefix_tokens

    def _checked_grid(self, num_tokens: int) -> tuple[int, int] | None:
        if not self.needs_grid and self.rope is None:  # rope's angles come from the grid
            return self.grid
        if self.grid is None:
            raise ValueError(
                f"{self.name}: the patch grid is not set; build the model with timm.create_model('visattn_vit_...'), "
                "use visattn.convert(model, ...), or call set_grid((H, W), num_prefix_tokens) first"
            )
        check_grid(self.grid, num_tokens, self.num_prefix_tokens, self.name)
        return self.grid

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: (B, N, C) with N = num_prefix_tokens + H * W -> (B, N, C)."""
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: x must be (B, N, {self.dim}), got shape {tuple(x.shape)}")
        weight = self.qkv.weight
        autocast_casts = torch.is_autocast_enabled(x.device.type) and {x.dtype, weight.dtype} <= AUTOCAST_DTYPES
        if x.dtype != weight.dtype and not autocast_casts:
            raise ValueError(
                f"{self.name}: x is {x.dtype} but the layer's weights are {weight.dtype}; convert one to the other "
                "or run under torch.autocast (which casts fp32, fp16 and bf16, not fp64)"
            )
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
        q, k, v = split_qkv(self.qkv(x), self.num_heads)  # (B, heads, N, d)
        q, k = self.rotate(self.q_norm(q), self.k_norm(k), grid)
        x = self.mix(q, k, v, grid=grid, attn_mask=attn_mask, is_causal=is_causal)  # (B, heads, N, d)
        return merge_heads(x)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (B, heads, N, d) turned by the ``rope`` table of ``grid`` (the prefix tokens unturned),
        so that every score of the mixing depends on the grid offset of its query and key; unchanged
        without rope. A type whose op applies the table itself overrides this."""
        if self.rope is None:
            return q, k
        table = self.rope(grid, self.num_prefix_tokens, q)
        return apply_rope(q, table), apply_rope(k, table)

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

    @classmethod
    @abstractmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """Forward FLOPs of one block's token mixing for one image (counting rules: :mod:`visattn.layers.cost`),
        from the case's layout, heads and type options."""
        raise NotImplementedError(f"{cls.__name__} states no mixing_flops; the benchmark needs it to count its cost")

    @classmethod
    @abstractmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """Bytes of one block's token mixing with activations of ``case.act_bytes`` bytes, on the paths its op
        takes on ``case.device`` (:mod:`visattn.ops.backends`). The paths are the eager ones: the choosers
        read ``torch.compiler.is_compiling()``, False outside a compiled graph, so a compiled model is
        estimated on the eager paths."""
        raise NotImplementedError(f"{cls.__name__} states no mixing_memory; the benchmark needs it to estimate memory")

    @classmethod
    def qkv_flops(cls, case: CostCase) -> int:
        """Forward FLOPs of the qkv projection for one image: ``6 N C^2``. A type that projects part of q,
        k, v on fewer tokens overrides this."""
        return 6 * case.layout.num_tokens * case.dim * case.dim

    @classmethod
    def type_options(cls) -> dict[str, Any]:
        """The options of this type beyond timm's contract (the other constructor arguments, keyword-only
        by convention) and their defaults, then the shared ones (``rope``) where the type takes them; what
        ``convert(..., **options)``, ``attn_kwargs`` and the cost formulas accept."""
        base = inspect.signature(GridAttention.__init__).parameters.values()
        contract = {p.name for p in base if p.kind is p.POSITIONAL_OR_KEYWORD}
        shared = {p.name: p.default for p in base if p.kind is p.KEYWORD_ONLY}
        own = {
            p.name: p.default
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in contract | shared.keys()
        }
        return own | shared if cls.takes_rope else own

    @property
    def factory_kwargs(self) -> dict[str, Any]:
        """The device and dtype of the projections, for the parameters a type adds to them."""
        return {"device": self.qkv.weight.device, "dtype": self.qkv.weight.dtype}

    @property
    def dropout_p(self) -> float:
        return self.attn_drop.p if self.training else 0.0

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}"
