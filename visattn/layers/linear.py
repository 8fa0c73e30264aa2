"""Linear attention layer (Katharopoulos et al. 2020), with an optional 2D locality term."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn import ops
from visattn.layers.base import GridAttention
from visattn.ops.linear import get_feature_map, linear_from_input, linear_packed


class LinearAttention(GridAttention):
    """``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)`` over all tokens; O(N d^2) per head.

    Type options:
        feature_map: ``"elu"`` (elu + 1, default) or ``"relu"``.
        chunk_size: chunk length of the causal form (``is_causal=True``, raster order).
        dwconv_kernel: odd k: add a depthwise k x k convolution of V over the patch grid to the output
            (the locality term of FLatten Transformer and MLLA); None: pure linear attention, which then
            needs no grid and supports ``is_causal``. Linear attention alone spreads its weight thinly over
            all tokens and has no notion of neighbourhood: on the embedded digits recipe, test accuracy
            was 88.6% without the term and 98.1% with k = 3, hence the default of 3.
    """

    name = "linear"
    supports_causal = True

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
        device=None,
        dtype=None,
        *,
        feature_map: str = "elu",
        chunk_size: int = 64,
        dwconv_kernel: int | None = 3,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype
        )
        get_feature_map(feature_map)  # fail early on a bad name
        if dwconv_kernel is not None and (not isinstance(dwconv_kernel, int) or dwconv_kernel < 1 or dwconv_kernel % 2 == 0):
            raise ValueError(f"linear: dwconv_kernel must be None or an odd integer >= 1, got {dwconv_kernel!r}")
        self.feature_map = feature_map
        self.chunk_size = chunk_size
        self.dwconv = (
            nn.Conv2d(dim, dim, dwconv_kernel, padding=dwconv_kernel // 2, groups=dim, device=device, dtype=dtype)
            if dwconv_kernel
            else None
        )

    @property
    def needs_grid(self) -> bool:  # type: ignore[override]
        return self.dwconv is not None

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """Non-causal: without autograd (inference) the mixing is fused with the qkv projection block by
        block of tokens (:func:`visattn.ops.linear.linear_from_input`), so the (B, N, 3 C) projection is
        never formed; with autograd and no q/k norm it runs on the projection itself
        (:func:`visattn.ops.linear.linear_packed`), whose gradient then comes back in one piece."""
        if is_causal or torch.compiler.is_compiling():
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        if not torch.is_grad_enabled():
            out, values = linear_from_input(
                x, self.qkv.weight, self.qkv.bias, self.num_heads, self.feature_map,
                q_norm=self.q_norm, k_norm=self.k_norm, keep_values=True,
            )
        elif isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity):
            out, values = linear_packed(self.qkv(x), self.num_heads, self.feature_map)
        else:
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        return self._add_locality(out, values, grid)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        if is_causal and self.dwconv is not None:
            raise ValueError("linear: is_causal=True cannot be combined with dwconv_kernel (the convolution sees later tokens)")
        out = ops.linear(q, k, v, feature_map=self.feature_map, causal=is_causal, chunk_size=self.chunk_size)
        if self.dwconv is None:
            return out
        # (B, N, C): a view when the op's output is token-major, a copy otherwise (a compiled graph)
        merged = self._add_locality(out.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2), grid)
        return merged.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def _add_locality(self, out: torch.Tensor, values: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """Adds the depthwise convolution of the patch values over the grid to the patch outputs, in place.

        out, values: (B, N, C), token-major; the values seen as (B, C, H, W) are channels-last, the layout
        in which the convolution is fastest, and so is its output, which is added back as tokens.
        """
        if self.dwconv is None:
            return out
        p = self.num_prefix_tokens
        v_img = values[:, p:].unflatten(1, grid).permute(0, 3, 1, 2)  # (B, C, H, W)
        local = self.dwconv(v_img).permute(0, 2, 3, 1).flatten(1, 2)  # (B, H * W, C)
        out[:, p:] += local
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", feature_map={self.feature_map!r}"
