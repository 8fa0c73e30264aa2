"""Linear attention (Katharopoulos et al. 2020), ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``, on the
path :func:`visattn.ops.backends.choose_linear_backend` picks."""
from __future__ import annotations

import torch

from visattn.ops.backends import choose_linear_backend, needs_autograd, select_backend
from visattn.ops.checks import check_positive_int
from visattn.ops.linear.blocked import blocked_linear_attn
from visattn.ops.linear.chunk import chunk_linear_attn
from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.linear.plain import checkpointed_plain_linear_attn, plain_linear_attn
from visattn.ops.rope import check_rope_table


def linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    chunk_size: int = 64,
    eps: float = 1e-6,
    backend: str | None = None,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Linear attention.

    Args:
        q, k, v: (B, heads, N, d).
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        causal: each token attends to itself and earlier tokens (raster order).
        chunk_size: tokens per chunk of the causal form.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
        backend: ``"blocked"`` (:func:`visattn.ops.linear.blocked.blocked_linear_attn`), ``"plain"``
            (:func:`visattn.ops.linear.plain.plain_linear_attn`) or ``"plain_checkpoint"`` (the same, recomputed
            in the backward) when non-causal, ``"chunk"``
            (:func:`visattn.ops.linear.chunk.chunk_linear_attn`) when causal; None: chosen by
            :func:`visattn.ops.backends.choose_linear_backend`.
        rope: a rotation table, (N, 2 d) or (heads, N, 2 d) (:mod:`visattn.ops.rope`): the features are
            rotated after the feature map, in the numerator only (RoFormer's linear attention,
            ``sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j)``), so the normalizer stays
            positive. Runs on every path; ``"blocked"`` takes it as a constant, so a table that needs a
            gradient (learned frequencies) runs on ``"plain"`` (non-causal) or ``"chunk"`` (causal).
    Returns:
        (B, heads, N, d), in v's dtype; computed in fp32, but bf16 inputs without autograd on ``"plain"``
        run in bf16 with fp32 token sums (:func:`visattn.ops.linear.plain.bf16_linear_attn`).
    """
    check_positive_int(chunk_size, "chunk_size", "linear_attn")
    get_feature_map(feature_map)  # a bad name fails before a path is chosen
    if rope is not None:
        check_rope_table(q, rope, "linear_attn")
    rope_needs_grad = rope is not None and needs_autograd(rope)
    needs_grad = needs_autograd(q, k, v, rope)
    name = select_backend("linear", backend, lambda: choose_linear_backend(q.device, causal, rope_needs_grad, needs_grad))
    if causal != (name == "chunk"):
        raise ValueError(
            f"linear_attn: backend {name!r} is {'non-' if causal else ''}causal; causal={causal} needs "
            f"{'chunk' if causal else 'blocked, plain or plain_checkpoint'}"
        )
    if name == "chunk":
        return chunk_linear_attn(q, k, v, feature_map, chunk_size, eps, rope)
    if name == "plain":
        return plain_linear_attn(q, k, v, feature_map, eps, rope)
    if name == "plain_checkpoint":
        return checkpointed_plain_linear_attn(q, k, v, feature_map, eps, rope)
    if rope_needs_grad:
        raise ValueError(
            "linear_attn: backend 'blocked' takes a constant rope table; one that needs a gradient (learned "
            "frequencies, rope='mixed') needs 'plain' (or 'chunk' when causal)"
        )
    return blocked_linear_attn(q, k, v, feature_map, eps, rope)
