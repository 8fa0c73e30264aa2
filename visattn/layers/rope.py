"""The ``rope=`` option of the layers: the rotation table of the live grid, and RoPE-Mixed's frequencies.

The math lives in :mod:`visattn.ops.rope`; this module only owns what a layer keeps between forwards.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.ops.rope import axial_rope, check_rope, init_mixed_rope_freqs, mixed_rope


class GridRope(nn.Module):
    """One layer's rotary position embedding over the patch grid, ``mode`` ``"axial"`` or ``"mixed"``.

    ``"axial"`` has no parameters (its tables are cached per grid, device and dtype by
    :func:`visattn.ops.rope.axial_rope`); ``"mixed"`` learns ``freqs`` (2, heads, d / 2), the row and
    column frequency of every channel pair of every head.
    """

    def __init__(
        self,
        mode: str,
        num_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_rope(mode, head_dim, "rope")
        self.mode = mode
        self.num_heads = num_heads
        self.head_dim = head_dim
        if mode == "mixed":
            self.freqs = nn.Parameter(init_mixed_rope_freqs(head_dim, num_heads, device=device, dtype=dtype))
        else:
            self.register_parameter("freqs", None)

    def reset_parameters(self) -> None:
        """New random RoPE-Mixed frequencies (timm's weight init calls this); nothing to do for axial."""
        if self.freqs is not None:
            with torch.no_grad():
                self.freqs.copy_(init_mixed_rope_freqs(self.head_dim, self.num_heads, device=self.freqs.device))

    def no_weight_decay(self) -> set[str]:
        """RoPE-Mixed's frequencies stay out of weight decay, as in timm's own rotary modules: decay would pull
        every frequency towards 0, i.e. towards no position at all."""
        return {"freqs"} if self.freqs is not None else set()

    def forward(self, grid: tuple[int, int], num_prefix_tokens: int, like: torch.Tensor) -> torch.Tensor:
        """The table of ``grid`` for tokens like ``like`` (B, heads, N, d): (N, 2 d) for axial (at least
        fp32, on like's device), (heads, N, 2 d) for mixed (in the frequencies' dtype)."""
        if self.freqs is None:
            dtype = torch.promote_types(like.dtype, torch.float32)
            return axial_rope(grid, self.head_dim, num_prefix_tokens, device=like.device, dtype=dtype)
        return mixed_rope(self.freqs, grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"
