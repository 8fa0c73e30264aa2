"""2D rotary position embedding (RoPE) over the patch grid: the rotation tables and their application.

A table holds, for every token, the sine and cosine of one angle per pair of channels, concatenated as
timm's ``apply_rot_embed_cat`` reads them: (N, 2 d) = [sin | cos], each half in timm's interleaved layout
(channels 2i and 2i + 1 form pair i and share its angle). Rotating a query at grid position p and a key at
p' by their angles gives ``R(p) q . R(p') k = q . R(p' - p) k``: the score depends on the offset only.

Two ways to choose the angles (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer"):

- ``"axial"``: the first d / 4 pairs turn with the row index, the last d / 4 with the column index, at the
  fixed frequencies ``theta ** (-4 j / d)``, j = 0 .. d / 4 - 1 (timm's ``build_rotary_pos_embed``).
  theta = 100, timm's (and the paper's) choice for RoPE-Axial ViTs: the slowest pair turns once in
  about 2 pi theta ** (1 - 4 / d) positions, a few hundred cells, more than any grid here.
- ``"mixed"``: every pair i of every head turns with ``row * f_row[i] + col * f_col[i]``, learnable
  frequencies initialised as RoPE-Mixed does (timm's ``init_random_2d_freqs``, theta = 10: magnitudes
  ``theta ** (-4 j / d)`` along a random direction per head); pairs then see diagonal offsets too.

Prefix (class/register) tokens are not rotated: their rows of a table are the identity (sin 0, cos 1), so a
table covers all P + H W tokens and one elementwise pass rotates q or k. Axial tables are cached per grid,
prefix count, head width, device and dtype; mixed tables depend on the parameters and are built each call.
"""
from __future__ import annotations

import torch
from timm.layers.pos_embed_sincos import (
    apply_rot_embed_cat,
    build_rotary_pos_embed,
    get_mixed_freqs,
    get_mixed_grid,
    init_random_2d_freqs,
)

from visattn.ops.cache import cache_per_inference_mode
from visattn.ops.checks import check_grid_size, check_nonnegative_int

ROPE_MODES = ("axial", "mixed")
AXIAL_THETA = 100.0
MIXED_THETA = 10.0


def check_rope(rope: str | None, head_dim: int, op: str) -> None:
    """``rope`` must be None or one of :data:`ROPE_MODES`, and a head then needs a width divisible by 4
    (two axes, each turning pairs of channels)."""
    if rope is not None and rope not in ROPE_MODES:
        raise ValueError(f"{op}: rope must be None, {' or '.join(repr(m) for m in ROPE_MODES)}, got {rope!r}")
    if rope is not None and head_dim % 4:
        raise ValueError(f"{op}: rope={rope!r} needs a head width divisible by 4, got head_dim={head_dim}")


def _with_identity_prefix(table: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(..., M, 2 d) patch rows -> (..., P + M, 2 d), the P prefix rows sin 0, cos 1 (no rotation)."""
    if not num_prefix_tokens:
        return table
    d = table.shape[-1] // 2
    identity = torch.cat([table.new_zeros(d), table.new_ones(d)])
    prefix = identity.expand(*table.shape[:-2], num_prefix_tokens, 2 * d)
    return torch.cat([prefix, table], dim=-2)


@cache_per_inference_mode(maxsize=64)
def _axial_table(
    grid: tuple[int, int], head_dim: int, num_prefix_tokens: int, theta: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    sin, cos = build_rotary_pos_embed(
        list(grid), dim=head_dim, temperature=theta, in_pixels=False, grid_indexing="ij", device=device, dtype=dtype
    )  # (H * W, d) each, interleaved: rows first, then columns
    return _with_identity_prefix(torch.cat([sin, cos], dim=-1), num_prefix_tokens)


def axial_rope(
    grid: tuple[int, int],
    head_dim: int,
    num_prefix_tokens: int = 0,
    theta: float = AXIAL_THETA,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The RoPE-Axial table of a grid: (P + H W, 2 d), patch tokens in raster order after P identity rows.

    Cached: the same arguments return the same tensor (kept for the 64 latest argument sets, separately in
    and out of ``torch.inference_mode``). Angles are computed in fp32, then cast to ``dtype``.
    """
    h, w = check_grid_size(grid, "grid", "axial_rope")
    check_nonnegative_int(num_prefix_tokens, "num_prefix_tokens", "axial_rope")
    check_rope("axial", head_dim, "axial_rope")
    device = torch.device("cpu") if device is None else torch.device(device)
    return _axial_table((h, w), head_dim, num_prefix_tokens, float(theta), device, dtype)


def init_mixed_rope_freqs(
    head_dim: int,
    num_heads: int,
    theta: float = MIXED_THETA,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RoPE-Mixed's initial frequencies, (2, heads, d / 2): [row, column] components per head and pair."""
    check_rope("mixed", head_dim, "init_mixed_rope_freqs")
    freqs = init_random_2d_freqs(head_dim, 1, num_heads, temperature=theta, device=device)  # (2, 1, heads, d / 2)
    return freqs[:, 0].to(dtype or torch.get_default_dtype())


def mixed_rope(freqs: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
    """The RoPE-Mixed table of a grid: (heads, P + H W, 2 d) from ``freqs`` (2, heads, d / 2), angles
    ``row * freqs[0] + col * freqs[1]`` computed in fp32, in ``freqs``' dtype; differentiable in ``freqs``."""
    h, w = check_grid_size(grid, "grid", "mixed_rope")
    check_nonnegative_int(num_prefix_tokens, "num_prefix_tokens", "mixed_rope")
    if freqs.ndim != 3 or freqs.shape[0] != 2:
        raise ValueError(f"mixed_rope: freqs must be (2, heads, head_dim / 2), got shape {tuple(freqs.shape)}")
    rows, cols = get_mixed_grid([h, w], grid_indexing="ij", device=freqs.device)  # (H * W,) each
    # timm before 1.0.31 forms the angles with a matmul, which autocast would run in bf16: with 8 bits kept,
    # an angle near 100 rad (a 64 x 64 grid) is off by up to a quarter radian
    with torch.autocast(device_type=freqs.device.type, enabled=False):
        table = get_mixed_freqs(freqs, rows, cols)
    return _with_identity_prefix(table, num_prefix_tokens)


def check_rope_table(x: torch.Tensor, rope: torch.Tensor, op: str) -> None:
    """``rope`` must be a table for ``x`` (B, heads, N, d): (N, 2 d) or (heads, N, 2 d)."""
    if x.ndim != 4:
        raise ValueError(f"{op}: the rotated tensor must be (B, heads, N, d), got shape {tuple(x.shape)}")
    _, heads, n, d = x.shape
    if tuple(rope.shape) not in ((n, 2 * d), (heads, n, 2 * d)):
        raise ValueError(
            f"{op}: rope must be ({n}, {2 * d}) or ({heads}, {n}, {2 * d}) for a tensor of shape {tuple(x.shape)}, "
            f"got {tuple(rope.shape)}"
        )


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``x`` (B, heads, N, d) with each token's channel pairs turned by its angles in ``rope`` (a table of
    :func:`axial_rope` or :func:`mixed_rope`); computed in the wider of the two dtypes, returned in x's."""
    check_rope_table(x, rope, "apply_rope")
    # timm 1.0.31 casts the rotation back to x's dtype itself; older releases return the wider dtype
    return apply_rot_embed_cat(x, rope).to(x.dtype)


def inverse_rope(rope: torch.Tensor) -> torch.Tensor:
    """The table of the opposite turns (angles negated: sin flips, cos stays), R^T for each token's R."""
    d = rope.shape[-1] // 2
    return torch.cat([-rope[..., :d], rope[..., d:]], dim=-1)


def naive_apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Naive twin of :func:`apply_rope`: each token times its explicit (d, d) block-diagonal rotation matrix,
    ``[[cos, -sin], [sin, cos]]`` on every channel pair (2i, 2i + 1)."""
    check_rope_table(x, rope, "naive_apply_rope")
    d = x.shape[-1]
    sin, cos = rope[..., 0:d:2], rope[..., d::2]  # (..., N, d / 2): one angle per pair
    even, odd = torch.arange(0, d, 2), torch.arange(1, d, 2)
    rotation = rope.new_zeros(*rope.shape[:-1], d, d)  # (..., N, d, d)
    rotation[..., even, even] = cos
    rotation[..., even, odd] = -sin
    rotation[..., odd, even] = sin
    rotation[..., odd, odd] = cos
    dtype = torch.promote_types(x.dtype, rope.dtype)
    return torch.einsum("...ij,...j->...i", rotation.to(dtype), x.to(dtype)).to(x.dtype)
