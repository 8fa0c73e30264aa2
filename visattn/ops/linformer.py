"""Linformer (Wang et al. 2020): softmax attention over keys and values projected along the token axis.

The H * W patch keys and values are mixed down to k tokens, ``K' = E K_patch`` and ``V' = F V_patch``
with E, F of shape (k, H * W), shared across batch and heads. Every query (patch and prefix) attends
to the P prefix keys plus the k projected keys. Cost per head: O(k H W d) for the projections plus
O(N (P + k) d) for the attention: linear in N for a fixed k.

The prefix keys and values pass through the projection unchanged: ``E`` runs as the block-diagonal
``[[I_P, 0], [0, E]]`` of shape (P + k, P + H * W) (:func:`_with_prefix_rows`), so the P + k keys
of all N tokens are one matmul and no activation is sliced or concatenated.

The projections are learned on a reference grid as (k, Hr, Wr) and resampled in 2D to the live grid
(:func:`resample_projection`), so one layer serves any image size. :func:`area_pooling_projection` is
their initial value: each projected token averages one block of the grid.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from visattn.ops.checks import check_dropout, check_grid_size, check_positive_int, check_qkv
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.local.naive import naive_masked_attn


def _check_projections(
    q: torch.Tensor, proj_k: torch.Tensor, proj_v: torch.Tensor, num_prefix_tokens: int, op: str
) -> None:
    if num_prefix_tokens < 0 or num_prefix_tokens >= q.shape[2]:
        raise ValueError(
            f"{op}: num_prefix_tokens must be in [0, N) with N={q.shape[2]}, got {num_prefix_tokens}"
        )
    num_patches = q.shape[2] - num_prefix_tokens
    for name, proj in (("proj_k", proj_k), ("proj_v", proj_v)):
        if proj.ndim != 2 or proj.shape[1] != num_patches or proj.shape[0] < 1:
            raise ValueError(
                f"{op}: {name} must be (k, H * W) = (k, {num_patches}) with k >= 1, got shape {tuple(proj.shape)}"
            )
    if proj_k.shape != proj_v.shape:
        raise ValueError(
            f"{op}: proj_k and proj_v must have the same shape, got {tuple(proj_k.shape)} and {tuple(proj_v.shape)}"
        )


def _with_prefix_rows(proj: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The projection over all N tokens, ``[[I_P, 0], [0, proj]]``: its first P rows copy the prefix tokens,
    the other k mix the patches. Built per forward from the parameters: (P + k) x N values, tiny next to
    the (B, heads, N, d) activations it multiplies.

    Args:
        proj: (k, H * W).
    Returns:
        (P + k, P + H * W) in proj's dtype and device; ``proj`` itself when P = 0.
    """
    if num_prefix_tokens == 0:
        return proj
    return torch.block_diag(torch.eye(num_prefix_tokens, dtype=proj.dtype, device=proj.device), proj)


def linformer_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    proj_k: torch.Tensor,
    proj_v: torch.Tensor,
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of every query over [prefix keys, proj_k @ patch keys].

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first.
        proj_k, proj_v: (k, H * W), the token-axis projections on the live grid (see
            :func:`resample_projection`); cast to the dtype of k and v.
        num_prefix_tokens: P, the class/register tokens before the patches; they are kept as keys
            and values as they are, not projected.
        dropout_p: attention dropout.
        scale: score scale; ``d ** -0.5`` if None.
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "linformer_attn")
    check_dropout(dropout_p, "linformer_attn")
    _check_projections(q, proj_k, proj_v, num_prefix_tokens, "linformer_attn")
    keys = _project_tokens(_with_prefix_rows(proj_k.to(k.dtype), num_prefix_tokens), k)  # (B, heads, P + k, d)
    values = _project_tokens(_with_prefix_rows(proj_v.to(v.dtype), num_prefix_tokens), v)
    return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout_p, scale=scale)


def _project_tokens(proj: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``proj @ t`` along the tokens, (R, N) @ (B, heads, N, d) -> (B, heads, R, d), without a copy of ``t``
    (which autograd would keep): a view of a qkv projection is token-major, so its heads cannot fold into
    the batch of a matmul, but its (B, N, C) view multiplies in one batched product."""
    heads = t.shape[1]
    tokens = t.transpose(1, 2)  # (B, N, heads, d)
    if tokens.stride(3) == 1 and tokens.stride(2) == t.shape[3]:  # heads side by side in each token's row
        projected = torch.bmm(proj.expand(t.shape[0], -1, -1), merge_heads(t))  # (B, R, C)
        return split_heads(projected, heads)
    return proj @ t


def project_keys_values(
    x: torch.Tensor,
    proj_k: torch.Tensor,
    proj_v: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    num_prefix_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linformer's keys and values computed from the layer input, projecting along the tokens *before*
    the key and value projections: ``E (X W^T + 1 b^T) = (E X) W^T + (E 1) b^T``. Equal to projecting the
    keys and values of all N tokens (up to rounding), but the key and value projections then run on
    P + k tokens instead of N. Only valid when no per-token operation (such as a key norm) sits between
    the projection and the mixing.

    Args:
        x: (B, N, C), N = num_prefix_tokens + H * W, prefix tokens first.
        proj_k, proj_v: (k, H * W), the token-axis projections on the live grid; cast to x's dtype.
        kv_weight: (2 D, C), the key rows then the value rows of the qkv projection's weight.
        kv_bias: (2 D,) or None, the matching bias.
    Returns:
        keys, values: (B, P + k, D) each, the prefix tokens first.
    """
    _check_projections(x.unsqueeze(1), proj_k, proj_v, num_prefix_tokens, "project_keys_values")
    rows, dim = num_prefix_tokens + proj_k.shape[0], kv_weight.shape[0] // 2
    both = torch.cat([_with_prefix_rows(proj.to(x.dtype), num_prefix_tokens) for proj in (proj_k, proj_v)])
    # one batched product over x as it is: broadcasting the (2 (P + k), N) matrix against (B, N, C) would fold
    # x into one (B C, N) matrix, a copy of x for each projection that autograd would keep
    tokens = torch.bmm(both.expand(x.shape[0], -1, -1), x)  # (B, 2 (P + k), C): E'_k X, then E'_v X
    keys = F.linear(tokens[:, :rows], kv_weight[:dim])  # (B, P + k, D)
    values = F.linear(tokens[:, rows:], kv_weight[dim:])
    if kv_bias is not None:  # row j carries the bias sum_t E'_jt times: a prefix token once
        weight_sum = both.sum(dim=1)[:, None]  # (2 (P + k), 1)
        keys = keys + (weight_sum[:rows] * kv_bias[:dim]).to(keys.dtype)  # an fp32 bias would promote them
        values = values + (weight_sum[rows:] * kv_bias[dim:]).to(values.dtype)
    return keys, values


def naive_linformer_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    proj_k: torch.Tensor,
    proj_v: torch.Tensor,
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`linformer_attn`: explicit sums over tokens, then explicit scores."""
    check_qkv(q, k, v, "naive_linformer_attn")
    _check_projections(q, proj_k, proj_v, num_prefix_tokens, "naive_linformer_attn")
    p = num_prefix_tokens
    k_proj = torch.einsum("jt,bhtd->bhjd", proj_k.to(k.dtype), k[:, :, p:])  # K'_j = sum_t E_jt K_t
    v_proj = torch.einsum("jt,bhtd->bhjd", proj_v.to(v.dtype), v[:, :, p:])
    keys = torch.cat([k[:, :, :p], k_proj], dim=2)
    values = torch.cat([v[:, :, :p], v_proj], dim=2)
    allowed = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device)
    return naive_masked_attn(q, keys, values, allowed, scale)


def resample_projection(proj: torch.Tensor, ref_grid: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """A token-axis projection defined on ``ref_grid``, carried over to the live ``grid``.

    Each row of the projection is a weight map over the reference grid. For another grid it is
    resized in 2D with bilinear interpolation (``F.interpolate``, ``align_corners=False``,
    ``antialias=True``; antialiasing only changes shrinking, where it averages instead of sampling, so
    a block of weight is never skipped), then multiplied by ``(Hr * Wr) / (H * W)``: a projected token
    is a weighted *sum* over tokens, and resizing keeps the mean weight, so the rescale keeps each
    row's total weight (exactly for rows constant over the grid and for integer upscaling, closely
    otherwise) and the projected keys and values keep their magnitude at any image size. At the
    reference grid the projection is returned unchanged (no interpolation).

    Args:
        proj: (k, Hr, Wr).
        ref_grid: (Hr, Wr), the grid the projection is defined on.
        grid: (H, W), the live patch grid.
    Returns:
        (k, H * W) in proj's dtype, for :func:`linformer_attn`.
    """
    hr, wr = check_grid_size(ref_grid, "ref_grid", "resample_projection")
    h, w = check_grid_size(grid, "grid", "resample_projection")
    if proj.ndim != 3 or tuple(proj.shape[1:]) != (hr, wr):
        raise ValueError(
            f"resample_projection: proj must be (k, Hr, Wr) = (k, {hr}, {wr}), got shape {tuple(proj.shape)}"
        )
    if (h, w) == (hr, wr):
        return proj.flatten(1)
    resized = F.interpolate(  # in fp32: the antialiased kernel has no bf16/fp16 CPU implementation
        proj.float().unsqueeze(0), size=(h, w), mode="bilinear", align_corners=False, antialias=True
    ).squeeze(0)  # (k, H, W)
    return (resized.flatten(1) * ((hr * wr) / (h * w))).to(proj.dtype)


def _block_averages(num_blocks: int, size: int) -> torch.Tensor:
    """(num_blocks, size): row a averages cells [floor(a size / n), ceil((a + 1) size / n)), the
    blocks of adaptive average pooling."""
    weights = torch.zeros(num_blocks, size)
    for a in range(num_blocks):
        start = (a * size) // num_blocks
        end = -((-(a + 1) * size) // num_blocks)
        weights[a, start:end] = 1.0 / (end - start)
    return weights


def area_pooling_projection(k: int, grid: tuple[int, int]) -> torch.Tensor:
    """The projection that average-pools the grid into k blocks: the Linformer initialisation.

    k is laid out as kh x kw with kh the largest divisor of k not above sqrt(k); row ``j = a * kw + b``
    averages the cell block that ``F.adaptive_avg_pool2d`` to (kh, kw) averages for output (a, b).
    Each row sums to 1, so at initialisation every query attends to a pooled image; for a model
    converted from softmax attention this keeps the keys and values in the range the weights expect.
    If kh > H or kw > W, adaptive pooling repeats cells (neighbouring blocks overlap); the rows then
    span at most H * W distinct maps, so k > H * W costs more than it adds.

    Returns:
        (k, H, W), fp32.
    """
    check_positive_int(k, "k", "area_pooling_projection")
    h, w = check_grid_size(grid, "grid", "area_pooling_projection")
    kh = max(div for div in range(1, math.isqrt(k) + 1) if k % div == 0)
    kw = k // kh
    rows, cols = _block_averages(kh, h), _block_averages(kw, w)  # (kh, H), (kw, W)
    return torch.einsum("ay,bx->abyx", rows, cols).reshape(k, h, w)
