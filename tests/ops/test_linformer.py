"""linformer vs its explicit-sum twin; the grid resampling and the area-pooling initialisation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_rms_close, grads_of
from visattn.ops import linformer_attn, resample_projection
from visattn.ops.linformer import area_pooling_projection, naive_linformer_attn, project_keys_values

REF_GRID = (5, 4)
# (B, heads, H, W, prefix tokens, projected tokens k); the projection lives on REF_GRID and is resampled
CASES = [
    (1, 1, 5, 4, 0, 6),
    (2, 3, 7, 5, 1, 6),
    (2, 2, 3, 8, 3, 4),
    (1, 2, 1, 6, 0, 3),
    (2, 1, 1, 6, 1, 6),
    (1, 3, 6, 1, 3, 2),
    (2, 2, 6, 1, 0, 5),
    (1, 1, 10, 8, 1, 25),
]
IDS = [f"B{b}-H{h}-grid{gh}x{gw}-k{kp}-p{p}" for b, h, gh, gw, p, kp in CASES]
HEAD_DIM = 8


def _inputs(b, heads, gh, gw, p, kp):
    n = p + gh * gw
    q, k, v = (torch.randn(b, heads, n, HEAD_DIM) for _ in range(3))
    learned = [area_pooling_projection(kp, REF_GRID) + 0.1 * torch.randn(kp, *REF_GRID) for _ in range(2)]
    proj_k, proj_v = (resample_projection(proj, REF_GRID, (gh, gw)) for proj in learned)
    return q, k, v, proj_k, proj_v


@pytest.mark.parametrize("b,heads,gh,gw,p,kp", CASES, ids=IDS)
def test_matches_reference_fp32(b, heads, gh, gw, p, kp):
    inputs = _inputs(b, heads, gh, gw, p, kp)
    out, grads = grads_of(lambda *t: linformer_attn(*t, num_prefix_tokens=p), *inputs)
    ref, ref_grads = grads_of(lambda *t: naive_linformer_attn(*t, num_prefix_tokens=p), *inputs)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip(["q", "k", "v", "proj_k", "proj_v"], grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,p,kp", CASES, ids=IDS)
def test_matches_reference_bf16(b, heads, gh, gw, p, kp):
    q, k, v, proj_k, proj_v = _inputs(b, heads, gh, gw, p, kp)
    out, grads = grads_of(
        lambda *t: linformer_attn(*t, num_prefix_tokens=p), q.bfloat16(), k.bfloat16(), v.bfloat16(), proj_k, proj_v
    )
    ref, ref_grads = grads_of(lambda *t: naive_linformer_attn(*t, num_prefix_tokens=p), q, k, v, proj_k, proj_v)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, ref, 2e-2, "out")
    for name, g, g_ref in zip(["q", "k", "v", "proj_k", "proj_v"], grads, ref_grads):
        assert_rms_close(g, g_ref, 2e-2, f"d{name}")


@pytest.mark.parametrize(
    "grid,p", [((5, 4), 0), ((5, 4), 2), ((10, 8), 1)], ids=["ref-grid-p0", "ref-grid-p2", "grid10x8-p1"]
)
def test_pooled_init_returns_constant_values(grid, p):
    """Pooling rows sum to 1 (also after an integer upscale), so constant values come back unchanged."""
    proj = resample_projection(area_pooling_projection(6, REF_GRID), REF_GRID, grid)
    n = p + grid[0] * grid[1]
    q, k = torch.randn(2, 2, n, HEAD_DIM), torch.randn(2, 2, n, HEAD_DIM)
    v = torch.randn(HEAD_DIM).expand(2, 2, n, HEAD_DIM)
    torch.testing.assert_close(linformer_attn(q, k, v, proj, proj, p), v.expand_as(q), rtol=1e-5, atol=1e-5)


def test_resample_at_reference_grid_is_identity():
    proj = torch.randn(6, *REF_GRID)
    assert torch.equal(resample_projection(proj, REF_GRID, REF_GRID), proj.reshape(6, -1))


@pytest.mark.parametrize("grid", [(7, 5), (3, 8), (1, 6), (6, 1), (2, 2), (20, 13)], ids=lambda g: f"grid{g[0]}x{g[1]}")
def test_resample_keeps_mass_of_constant_rows(grid):
    proj = torch.randn(4, 1, 1).expand(4, *REF_GRID)  # each row constant over the grid
    resampled = resample_projection(proj, REF_GRID, grid)
    assert resampled.shape == (4, grid[0] * grid[1])
    torch.testing.assert_close(resampled.sum(dim=1), proj.sum(dim=(1, 2)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [2, 3], ids=["x2", "x3"])
def test_resample_keeps_mass_on_integer_upscale(factor):
    proj = torch.randn(4, *REF_GRID)
    resampled = resample_projection(proj, REF_GRID, (REF_GRID[0] * factor, REF_GRID[1] * factor))
    torch.testing.assert_close(resampled.sum(dim=1), proj.sum(dim=(1, 2)), rtol=1e-5, atol=1e-5)


def test_shrinking_keeps_every_pooled_block():
    """Shrinking 16x16 -> 2x2 averages instead of sampling: no pooled block loses its weight."""
    proj = area_pooling_projection(64, (16, 16))  # 8 x 8 blocks of 2 x 2 cells
    mass = resample_projection(proj, (16, 16), (2, 2)).sum(dim=1)
    assert bool((mass > 0.5).all() and (mass < 1.5).all()), mass


@pytest.mark.parametrize(
    "k,grid",
    [(6, (7, 5)), (7, (3, 8)), (16, (4, 4)), (4, (1, 6)), (256, (14, 14))],
    ids=["k6-grid7x5", "k7-grid3x8", "k16-grid4x4", "k4-grid1x6", "k256-grid14x14"],
)
def test_area_pooling_projection_is_adaptive_avg_pool(k, grid):
    kh = max(d for d in range(1, int(k**0.5) + 1) if k % d == 0)
    proj = area_pooling_projection(k, grid)
    assert proj.shape == (k, *grid)
    image = torch.randn(3, *grid)
    pooled = F.adaptive_avg_pool2d(image, (kh, k // kh)).reshape(3, k)
    torch.testing.assert_close(image.reshape(3, -1) @ proj.reshape(k, -1).T, pooled, rtol=1e-5, atol=1e-6)


def test_bad_input_raises():
    q = torch.randn(1, 2, 13, HEAD_DIM)
    proj = torch.randn(4, 12)
    with pytest.raises(ValueError, match="proj_k"):
        linformer_attn(q, q, q, torch.randn(4, 13), proj, num_prefix_tokens=1)
    with pytest.raises(ValueError, match="same shape"):
        linformer_attn(q, q, q, proj, torch.randn(5, 12), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        linformer_attn(q, q, q, proj, proj, num_prefix_tokens=13)
    with pytest.raises(ValueError, match="proj must be"):
        resample_projection(torch.randn(4, 3, 4), (4, 3), (5, 5))
    with pytest.raises(ValueError, match="grid"):
        resample_projection(torch.randn(4, 3, 4), (3, 4), (0, 5))
    with pytest.raises(ValueError, match="k must be"):
        area_pooling_projection(0, (3, 4))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("p", [0, 1, 3], ids=["p0", "p1", "p3"])
def test_keys_values_projected_from_the_input(p, bias):
    """E (X W^T + b) computed as (E X) W^T + (E 1) b equals the keys and values linformer_attn() forms from the
    projected k and v of every token; outputs and gradients."""
    b, gh, gw, c_in, dim, kp = 2, 5, 4, 12, 16, 6
    x, weight = torch.randn(b, p + gh * gw, c_in), torch.randn(2 * dim, c_in)
    kv_bias = torch.randn(2 * dim) if bias else None
    proj_k, proj_v = torch.rand(kp, gh * gw), torch.rand(kp, gh * gw)

    def from_input(x, weight):
        return torch.cat(project_keys_values(x, proj_k, proj_v, weight, kv_bias, p), dim=-1)

    def from_every_token(x, weight):
        kv = F.linear(x, weight, kv_bias)  # (B, N, 2 D): keys and values of all N tokens
        keys = torch.cat([kv[:, :p, :dim], proj_k @ kv[:, p:, :dim]], dim=1)
        values = torch.cat([kv[:, :p, dim:], proj_v @ kv[:, p:, dim:]], dim=1)
        return torch.cat([keys, values], dim=-1)

    out, grads = grads_of(from_input, x, weight)
    expected, expected_grads = grads_of(from_every_token, x, weight)
    assert out.shape == (b, p + kp, 2 * dim)
    assert_rms_close(out, expected, 1e-5, "keys and values")
    for name, g, g_ref in zip(("dx", "dweight"), grads, expected_grads):
        assert_rms_close(g, g_ref, 1e-5, name)
