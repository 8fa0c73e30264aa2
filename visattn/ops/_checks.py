"""Shape checks shared by the ops. Each raises ValueError naming the offending values."""
from __future__ import annotations

import torch


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


def check_qkv_grid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> None:
    """q, k, v must be the grid layout (B, heads, H, W, d) with matching leading dims."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 5:
            raise ValueError(f"{op}: {name} must be (B, heads, H, W, d), got shape {tuple(t.shape)}")
    if q.shape[:4] != k.shape[:4] or k.shape[:4] != v.shape[:4]:
        raise ValueError(
            f"{op}: q, k, v must agree in (B, heads, H, W); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q and k must share head_dim; got {q.shape[-1]} and {k.shape[-1]}")


def check_packed_qkv(qkv: torch.Tensor, num_heads: int, op: str) -> None:
    """qkv must be timm's projection (B, N, 3 C) with C divisible by num_heads."""
    if qkv.ndim != 3 or num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(
            f"{op}: qkv must be (B, N, 3 * C) with C divisible by num_heads={num_heads}, got {tuple(qkv.shape)}"
        )


def check_grid_size(grid: tuple[int, int], name: str, op: str) -> tuple[int, int]:
    """A grid must be (H, W) with H, W >= 1; returns it as two ints."""
    if len(grid) != 2 or any(int(g) < 1 for g in grid):
        raise ValueError(f"{op}: {name} must be (H, W) with H, W >= 1, got {tuple(grid)}")
    return int(grid[0]), int(grid[1])


def check_grid(grid: tuple[int, int], num_tokens: int, num_prefix_tokens: int, op: str) -> tuple[int, int]:
    """The token count must be prefix tokens + H * W."""
    h, w = check_grid_size(grid, "grid", op)
    if num_prefix_tokens < 0:
        raise ValueError(f"{op}: num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
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
