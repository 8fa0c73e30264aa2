"""Shape checks shared by the ops. Each raises ValueError naming the offending values."""
from __future__ import annotations

import operator

import torch


def check_same_float_tensors(op: str, **tensors: torch.Tensor) -> None:
    """The tensors must share one floating-point dtype and one device (the kernels mix neither)."""
    dtypes = {t.dtype for t in tensors.values()}
    devices = {t.device for t in tensors.values()}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        got = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"{op}: {', '.join(tensors)} must share one floating-point dtype; got {got}")
    if len(devices) > 1:
        got = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device; got {got}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> None:
    """q, k, v must be (B, heads, N, d) with matching batch, heads and tokens."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{op}: {name} must be (B, heads, N, d), got shape {tuple(t.shape)}")
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{op}: q, k, v must agree in (B, heads, N); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q and k must share head_dim; got {q.shape[-1]} and {k.shape[-1]}")
    check_same_float_tensors(op, q=q, k=k, v=v)


def check_packed_qkv(qkv: torch.Tensor, num_heads: int, op: str) -> None:
    """qkv must be timm's projection (B, N, 3 C) with C divisible by num_heads."""
    if qkv.ndim != 3 or num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(
            f"{op}: qkv must be (B, N, 3 * C) with C divisible by num_heads={num_heads}, got {tuple(qkv.shape)}"
        )
    check_same_float_tensors(op, qkv=qkv)


def check_qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, op: str
) -> None:
    """x (B, N, C_in) and timm's qkv projection: weight (3 C, C_in) with C divisible by num_heads, bias (3 C,)
    or None."""
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be (B, N, C_in), got shape {tuple(x.shape)}")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] % 3:
        raise ValueError(
            f"{op}: qkv_weight must be (3 C, C_in) with C_in={x.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    check_positive_int(num_heads, "num_heads", op)
    if (weight.shape[0] // 3) % num_heads:
        raise ValueError(f"{op}: num_heads={num_heads} must divide C={weight.shape[0] // 3}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: qkv_bias must be None or ({weight.shape[0]},), got shape {tuple(bias.shape)}")


def check_grid_size(grid: tuple[int, int], name: str, op: str) -> tuple[int, int]:
    """A grid must be (H, W) of integers H, W >= 1; returns it as two ints."""
    try:
        h, w = (operator.index(g) for g in grid)  # integers only: a float side is refused, never truncated
    except (TypeError, ValueError):
        raise ValueError(f"{op}: {name} must be (H, W) with integers H, W >= 1, got {grid!r}") from None
    if h < 1 or w < 1:
        raise ValueError(f"{op}: {name} must be (H, W) with integers H, W >= 1, got {grid!r}")
    return h, w


def check_grid(grid: tuple[int, int], num_tokens: int, num_prefix_tokens: int, op: str) -> tuple[int, int]:
    """The token count must be prefix tokens + H * W."""
    h, w = check_grid_size(grid, "grid", op)
    check_nonnegative_int(num_prefix_tokens, "num_prefix_tokens", op)
    if num_prefix_tokens + h * w != num_tokens:
        raise ValueError(
            f"{op}: N={num_tokens} tokens do not match num_prefix_tokens={num_prefix_tokens} + "
            f"grid {h}x{w} = {num_prefix_tokens + h * w}"
        )
    return h, w


def check_nonnegative_int(value: int, name: str, op: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{op}: {name} must be an integer >= 0, got {value!r}")


def check_positive_int(value: int, name: str, op: str, odd: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (odd and value % 2 == 0):
        kind = "an odd integer >= 1" if odd else "an integer >= 1"
        raise ValueError(f"{op}: {name} must be {kind}, got {value!r}")


def check_dropout(dropout_p: float, op: str) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be a probability in [0, 1], got {dropout_p!r}")
