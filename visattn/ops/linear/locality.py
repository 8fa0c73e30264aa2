"""The locality term of the linear layer (FLatten Transformer, MLLA): a depthwise K x K convolution of the
patch tokens' values over the grid, added to their outputs, token-major."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from visattn.ops.checks import check_grid
from visattn.ops.layout import image_to_tokens, split_prefix, tokens_to_image


def check_locality(
    conv_weight: torch.Tensor | None,
    conv_bias: torch.Tensor | None,
    channels: int,
    grid: tuple[int, int] | None,
    num_tokens: int,
    num_prefix_tokens: int,
    op: str,
) -> None:
    """``conv_weight`` (C, 1, K, K) with K odd and ``conv_bias`` (C,) or None, for C = ``channels``; with a
    weight, the grid must hold the patch tokens: N = num_prefix_tokens + H W."""
    if conv_weight is None:
        if conv_bias is not None:
            raise ValueError(f"{op}: conv_bias needs a conv_weight; got a bias of shape {tuple(conv_bias.shape)} alone")
        return
    shape = tuple(conv_weight.shape)
    if len(shape) != 4 or shape[:2] != (channels, 1) or shape[2] != shape[3] or shape[2] % 2 == 0:
        raise ValueError(f"{op}: conv_weight must be (C, 1, K, K) with C={channels} and K odd, got shape {shape}")
    if conv_bias is not None and tuple(conv_bias.shape) != (channels,):
        raise ValueError(f"{op}: conv_bias must be None or ({channels},), got shape {tuple(conv_bias.shape)}")
    if grid is None:
        raise ValueError(f"{op}: the locality term (conv_weight) needs the patch grid; pass grid=(H, W)")
    check_grid(grid, num_tokens, num_prefix_tokens, op)


def add_locality(
    out: torch.Tensor,
    values: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Adds the depthwise convolution of the patch values over the grid (zero-padded, ``conv_weight`` (C, 1,
    K, K), ``conv_bias`` (C,) or None) to the patch outputs, in place, and returns ``out``.

    out, values: (B, N, C), token-major; the values seen as (B, C, H, W) are channels-last, the layout in
    which the convolution is fastest, and so is its output, which is added back as tokens.
    """
    _, patch_values = split_prefix(values, num_prefix_tokens, dim=1)
    _, patch_out = split_prefix(out, num_prefix_tokens, dim=1)  # a view: added to in place
    image = tokens_to_image(patch_values, grid)  # (B, C, H, W)
    conv = F.conv2d(image, conv_weight, conv_bias, padding=conv_weight.shape[-1] // 2, groups=conv_weight.shape[0])
    patch_out += image_to_tokens(conv)  # (B, H * W, C)
    return out
