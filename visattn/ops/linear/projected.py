"""Linear attention from the qkv projection's input to the output projection's input, token-major in and
out, with the linear layer's locality term: the whole token mixing of :class:`visattn.layers.linear.LinearAttention`
(without decay), on the path :func:`visattn.ops.backends.choose_projected_linear_backend` picks.

Paths (``backend=``, or ``force_backend("projected_linear", ...)``):

- ``"fused_qkv"``: the mixing fused with the qkv projection block by block of tokens
  (:func:`visattn.ops.linear.fused_qkv_linear_attn`; inference only), so the (B, N, 3 C) projection is never
  formed;
- ``"packed"``: the projection, then the blocked op on it (:func:`visattn.ops.linear.packed_linear_attn`; no
  q/k norm), whose gradient comes back as one (B, N, 3 C) tensor;
- ``"split"``: the projection split into heads, the norms and the q/k map, then
  :func:`visattn.ops.linear_attn` on its own paths; the only path with a q/k map and causal attention;
- ``"triton"``: the projection, then Triton kernels that read q, k, v in place from it and add the locality
  term inside (:func:`visattn.ops.linear.triton.triton_linear_attn`; CUDA, or the CPU interpreted; no q/k norm
  or map, a rope table only if it needs no gradient).

Every path returns the heads merged, (B, N, C), with the locality term added in place.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from visattn.ops.backends import choose_projected_linear_backend, needs_autograd, select_backend
from visattn.ops.checks import check_positive_int, check_qkv_projection
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.linear.blocked import packed_linear_attn
from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.linear.functional import linear_attn
from visattn.ops.linear.fused import fused_qkv_linear_attn
from visattn.ops.linear.locality import add_locality, check_locality
from visattn.ops.linear.triton import triton_linear_attn, triton_refusal

_OP = "projected_linear_attn"

HeadMap = Callable[[torch.Tensor], torch.Tensor]  # (B, heads, n, d) -> (B, heads, n, d)
QKMap = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (q, k) -> (q, k)


def projected_linear_attn(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    feature_map: str = "elu",
    *,
    causal: bool = False,
    chunk_size: int = 64,
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    conv_weight: torch.Tensor | None = None,
    conv_bias: torch.Tensor | None = None,
    q_norm: HeadMap | None = None,
    k_norm: HeadMap | None = None,
    qk_map: QKMap | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Linear attention on ``x`` projected by timm's qkv weights, plus the locality term.

    Equal to projecting ``x``, splitting the heads, applying the norms and the q/k map,
    :func:`visattn.ops.linear_attn` and merging the heads, then adding the locality term to the patch tokens.

    Args:
        x: (B, N, C_in), the qkv projection's input: N = num_prefix_tokens + H W tokens, patches in raster order.
        qkv_weight: (3 C, C_in), the q rows, then k, then v, each heads of d = C / num_heads; qkv_bias: (3 C,) or None.
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        causal, chunk_size: causal attention in raster order, by chunks of ``chunk_size`` tokens.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
        rope: a rotation table, (N, 2 d) or (heads, N, 2 d), as :func:`visattn.ops.linear_attn` takes it.
        grid, num_prefix_tokens: the patch grid (H, W), needed with ``conv_weight``, and the prefix tokens
            before it.
        conv_weight: (C, 1, K, K), K odd: the locality term, the depthwise K x K convolution of the patch
            values over the grid (zero-padded) added to the patch outputs; None: none. Not with ``causal``
            (the convolution sees later tokens). conv_bias: (C,) or None.
        q_norm, k_norm: maps of q and k per head (timm's q/k norms), or None.
        qk_map: a map of q and k together after the norms (the linear layer's learned feature map), or None.
        backend: ``"fused_qkv"``, ``"packed"``, ``"split"`` or ``"triton"`` (see the module); None: chosen by
            :func:`visattn.ops.backends.choose_projected_linear_backend`.
    Returns:
        (B, N, C), heads merged, the output projection's input.
    """
    channels = _check_arguments(x, qkv_weight, qkv_bias, num_heads, feature_map, causal, chunk_size, conv_weight)
    check_locality(conv_weight, conv_bias, channels, grid, x.shape[1], num_prefix_tokens, _OP)
    name = _choose_path(x, channels // num_heads, backend, causal, rope, q_norm, k_norm, qk_map)
    if name == "triton":  # the locality term inside the kernels
        return triton_linear_attn(
            F.linear(x, qkv_weight, qkv_bias), num_heads, feature_map, eps, conv_weight=conv_weight,
            conv_bias=conv_bias, grid=grid, num_prefix_tokens=num_prefix_tokens, rope=rope,
        )
    if name == "fused_qkv":
        out, values = fused_qkv_linear_attn(
            x, qkv_weight, qkv_bias, num_heads, feature_map, eps, q_norm=q_norm, k_norm=k_norm, keep_values=True
        )
    elif name == "packed":
        out, values = packed_linear_attn(F.linear(x, qkv_weight, qkv_bias), num_heads, feature_map, eps)
    else:
        qkv, norms = F.linear(x, qkv_weight, qkv_bias), (q_norm, k_norm, qk_map)
        out, values = _split_heads_path(qkv, num_heads, feature_map, causal, chunk_size, eps, rope, *norms)
    if conv_weight is None:
        return out
    return add_locality(out, values, grid, num_prefix_tokens, conv_weight, conv_bias)


def _split_heads_path(
    qkv: torch.Tensor,
    num_heads: int,
    feature_map: str,
    causal: bool,
    chunk_size: int,
    eps: float,
    rope: torch.Tensor | None,
    q_norm: HeadMap | None,
    k_norm: HeadMap | None,
    qk_map: QKMap | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"split"`` path on the projection (B, N, 3 C): the output and the values, each (B, N, C)."""
    q, k, v = split_qkv(qkv, num_heads)  # (B, heads, N, d), views
    q, k = q if q_norm is None else q_norm(q), k if k_norm is None else k_norm(k)
    if qk_map is not None:
        q, k = qk_map(q, k)
    # (B, N, C): a view when the op's output is token-major, a copy otherwise (the plain path)
    return merge_heads(linear_attn(q, k, v, feature_map, causal, chunk_size, eps, rope=rope)), merge_heads(v)


def _check_arguments(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    feature_map: str,
    causal: bool,
    chunk_size: int,
    conv_weight: torch.Tensor | None,
) -> int:
    """The checks every path shares, before a path is chosen; returns C, the width of q, k, v."""
    check_qkv_projection(x, qkv_weight, qkv_bias, num_heads, _OP)
    get_feature_map(feature_map)
    check_positive_int(chunk_size, "chunk_size", _OP)
    if causal and conv_weight is not None:
        raise ValueError(
            f"{_OP}: causal=True cannot be combined with a locality term (conv_weight; the linear layer's "
            "dwconv_kernel): the convolution sees later tokens"
        )
    return qkv_weight.shape[0] // 3


def _choose_path(
    x: torch.Tensor,
    head_dim: int,
    backend: str | None,
    causal: bool,
    rope: torch.Tensor | None,
    q_norm: HeadMap | None,
    k_norm: HeadMap | None,
    qk_map: QKMap | None,
) -> str:
    """The path the op runs (:func:`visattn.ops.backends.select_backend`); a path that cannot do what the
    arguments ask is refused with a one-line ValueError."""
    has_qk_norm = q_norm is not None or k_norm is not None
    rotated, mapped = rope is not None, qk_map is not None
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    projection_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
    refusal = triton_refusal(
        causal=causal, has_qk_norm=has_qk_norm, qk_map=mapped, rope_needs_grad=rotated and needs_autograd(rope),
        head_dim=head_dim, num_tokens=x.shape[1], dtype=projection_dtype,
    )
    name = select_backend(
        "projected_linear", backend,
        lambda: choose_projected_linear_backend(
            x.device, causal, has_qk_norm, rotated, learned_map=mapped, triton_refusal=refusal
        ),
    )
    if name != "split":
        _refuse_unsplit(name, causal, rotated, mapped, has_qk_norm)
    return name


def _refuse_unsplit(name: str, causal: bool, rotated: bool, mapped: bool, has_qk_norm: bool) -> None:
    """What the ``"fused_qkv"``, ``"packed"`` and ``"triton"`` paths cannot do (the triton path's other
    limits are checked by its op)."""
    if causal:
        raise ValueError(f"{_OP}: the {name!r} path is non-causal; causal=True needs 'split'")
    if name == "triton" and (mapped or has_qk_norm):
        raise ValueError(f"{_OP}: the 'triton' path reads q and k straight from the projection: no q/k norm or map")
    if rotated and name != "triton":
        raise ValueError(f"{_OP}: the {name!r} path does not rotate; rope needs 'split' or 'triton'")
    if mapped:
        raise ValueError(
            f"{_OP}: the {name!r} path takes no qk_map (a learned feature map: feature_map='learned' needs 'split')"
        )
    if name == "packed" and has_qk_norm:
        raise ValueError(f"{_OP}: the 'packed' path has no q/k norm; use 'split' or 'fused_qkv'")
