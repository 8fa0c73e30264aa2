"""neighborhood vs its explicit-mask twin, NATTEN window semantics, prefix tokens, and a memory bound."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.helpers import assert_rms_close, grads_of
from visattn.ops import neighborhood_attn
from visattn.ops.neighborhood import naive_neighborhood_attn, neighborhood_mask

# (B, heads, H, W, kernel_size, tile_size, head_dim)
CASES = [
    (2, 3, 7, 5, 3, 8, 8),
    (1, 2, 5, 9, 5, 4, 8),
    (2, 1, 12, 10, 5, 8, 16),  # 12 and 10 are not multiples of the tile
    (1, 2, 12, 10, 7, 3, 8),
    (1, 1, 9, 8, 7, 8, 8),
    (2, 2, 4, 11, 7, 4, 8),  # k > H: clamped to the whole column
    (1, 1, 3, 2, 5, 2, 8),  # k > H and k > W
    (2, 1, 1, 6, 3, 8, 8),  # a single row
    (1, 2, 6, 5, 1, 4, 8),  # k = 1: each query sees itself
]
IDS = [f"B{b}-H{h}-grid{gh}x{gw}-k{ks}-t{t}-d{d}" for b, h, gh, gw, ks, t, d in CASES]


def _qkv(b, heads, gh, gw, d, dtype=torch.float32, p=0):
    """q, k, v (B, heads, P + H * W, d): the prefix tokens first, then the patches in raster order."""
    return [torch.randn(b, heads, p + gh * gw, d, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("b,heads,gh,gw,ks,t,d", CASES, ids=IDS)
def test_matches_reference_fp32(b, heads, gh, gw, ks, t, d):
    q, kk, v = _qkv(b, heads, gh, gw, d)
    out, grads = grads_of(lambda q, k, v: neighborhood_attn(q, k, v, (gh, gw), ks, tile_size=t), q, kk, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_neighborhood_attn(q, k, v, (gh, gw), ks), q, kk, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,ks,t,d", CASES, ids=IDS)
def test_matches_reference_bf16(b, heads, gh, gw, ks, t, d):
    q, kk, v = _qkv(b, heads, gh, gw, d)
    out, grads = grads_of(lambda q, k, v: neighborhood_attn(q, k, v, (gh, gw), ks, tile_size=t), *(x.bfloat16() for x in (q, kk, v)))
    ref, ref_grads = grads_of(lambda q, k, v: naive_neighborhood_attn(q, k, v, (gh, gw), ks), q, kk, v)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, ref, 2e-2, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 2e-2, f"d{name}")


@pytest.mark.parametrize(
    "gh,gw,ks", [(12, 10, 5), (9, 7, 7), (4, 11, 7)], ids=["grid12x10-k5", "grid9x7-k7", "grid4x11-k7"]
)
def test_result_does_not_depend_on_tile_size(gh, gw, ks):
    q, kk, v = _qkv(2, 2, gh, gw, 8)
    out, grads = grads_of(lambda q, k, v: neighborhood_attn(q, k, v, (gh, gw), ks, tile_size=8), q, kk, v)
    for tile in (1, 2, 3, 5, 16):
        other, other_grads = grads_of(lambda q, k, v: neighborhood_attn(q, k, v, (gh, gw), ks, tile_size=tile), q, kk, v)
        assert_rms_close(other, out, 1e-6, f"out tile={tile}")
        for name, g, g_ref in zip("qkv", other_grads, grads):
            assert_rms_close(g, g_ref, 1e-6, f"d{name} tile={tile}")


@pytest.mark.parametrize(
    "length,k,windows",
    [
        (5, 3, [[0, 1, 2], [0, 1, 2], [1, 2, 3], [2, 3, 4], [2, 3, 4]]),
        (6, 5, [[0, 1, 2, 3, 4]] * 3 + [[1, 2, 3, 4, 5]] * 3),
        (3, 5, [[0, 1, 2]] * 3),  # k > L: the whole axis
    ],
    ids=["L5-k3", "L6-k5", "L3-k5-clamped"],
)
def test_windows_shift_inward_at_the_border(length, k, windows):
    """The reference mask itself, checked against windows written out by hand (NATTEN semantics)."""
    for grid in ((1, length), (length, 1)):
        allowed = neighborhood_mask(grid, k)
        assert [row.nonzero().flatten().tolist() for row in allowed] == windows


@pytest.mark.parametrize("gh,gw,k", [(7, 5, 3), (4, 11, 7)], ids=["grid7x5-k3", "grid4x11-k7"])
def test_every_query_sees_k_squared_keys_including_itself(gh, gw, k):
    allowed = neighborhood_mask((gh, gw), k)
    assert (allowed.sum(dim=-1) == min(k, gh) * min(k, gw)).all()
    assert allowed.diagonal().all()


def test_kernel_one_returns_values():
    q, kk, v = _qkv(2, 2, 5, 6, 8)
    torch.testing.assert_close(neighborhood_attn(q, kk, v, (5, 6), 1), v)


def test_same_input_same_output_bit_for_bit():
    q, kk, v = _qkv(2, 2, 9, 7, 8)
    assert torch.equal(neighborhood_attn(q, kk, v, (9, 7), 5, tile_size=4), neighborhood_attn(q, kk, v, (9, 7), 5, tile_size=4))


def test_scale_and_dropout_are_passed_on():
    q, kk, v = _qkv(1, 2, 6, 5, 8)
    grid = (6, 5)
    assert_rms_close(
        neighborhood_attn(q, kk, v, grid, 3, scale=0.3), naive_neighborhood_attn(q, kk, v, grid, 3, scale=0.3), 1e-5
    )
    assert not torch.allclose(neighborhood_attn(q, kk, v, grid, 3, dropout_p=0.5), neighborhood_attn(q, kk, v, grid, 3))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kernel_size": 4}, "kernel_size"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"kernel_size": 3, "tile_size": 0}, "tile_size"),
    ],
    ids=["k-even", "k-zero", "tile-zero"],
)
def test_bad_options_raise(kwargs, match):
    q, kk, v = _qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=match):
        neighborhood_attn(q, kk, v, (4, 4), **kwargs)


def test_bad_shapes_raise():
    q, kk, v = _qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="B, heads, N, d"):
        neighborhood_attn(*(t.unflatten(2, (4, 4)) for t in (q, kk, v)), (4, 4), 3)
    with pytest.raises(ValueError, match="agree"):
        neighborhood_attn(q, kk[:, :, :3], v, (4, 4), 3)
    with pytest.raises(ValueError, match="num_prefix_tokens=1"):
        neighborhood_attn(q, kk, v, (4, 4), 3, num_prefix_tokens=1)
    with pytest.raises(ValueError, match="grid"):
        neighborhood_attn(q, kk, v, (4, 3), 3)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward) while active."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out


def test_memory_stays_blocked_at_grid96x96():
    """Forward + backward at 96 x 96 (N = 9,216), k = 7: no tensor reaches the tiles' score size
    N (t + k - 1)^2 per head, which is far below N^2 and below an unfold of the windows, N k^2 d."""
    B, heads, H, W, d, k, tile = 1, 2, 96, 96, 16, 7, 8
    q, kk, v = (t.requires_grad_(True) for t in _qkv(B, heads, H, W, d))
    with _LargestTensor() as meter:
        neighborhood_attn(q, kk, v, (H, W), k, tile_size=tile).square().sum().backward()
    n = H * W
    tile_scores = B * heads * n * (tile + k - 1) ** 2
    assert meter.numel <= tile_scores, meter.op
    assert meter.numel < B * heads * n * k * k * d, meter.op
    assert 40 * tile_scores < B * heads * n * n
    assert all(torch.isfinite(t.grad).all() for t in (q, kk, v))


def test_memory_meter_sees_dense_scores():
    """The meter above can fail: the N x N reference trips it."""
    q, kk, v = _qkv(1, 1, 12, 12, 8)
    with _LargestTensor() as meter:
        naive_neighborhood_attn(q, kk, v, (12, 12), 3)
    assert meter.numel >= 144 * 144
