"""The FlexAttention path of the local ops: its mask (evaluated pair by pair, back in token order) and its
block tables against the plain definitions, its outputs against the naive twins and the gathered path,
its cache, the choice of it on CUDA, and a compiled graph around it.

On the CPU FlexAttention has no backward ("NotImplementedError: FlexAttention does not support backward
on CPU. Please set the input requires_grad to False or use another device.", torch 2.14), so gradients
are compared in the ``cuda`` tests only; on the CPU it runs its eager form, which computes every score
and warns that it does."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tests.helpers import assert_rms_close
from visattn import ops
from visattn.layers.registry import get_attention
from visattn.ops import backends
from visattn.ops.local import flex as local_flex
from visattn.ops.local import naive_masked_attn
from visattn.ops.backends import force_backend
from visattn.ops.local import blocked_axis, neighborhood_axis, tiled_local_attn
from visattn.ops.local.flex import flex_layout, flex_local_attn
from visattn.ops.longformer import longformer_mask, naive_longformer_attn
from visattn.ops.neighborhood import neighborhood_mask, neighborhood_plans
from visattn.ops.sparse import sparse_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

GRIDS = [(5, 7), (9, 4), (13, 11)]
PREFIX = [0, 1, 3]
WINDOWS = [("neighborhood", 5, 4), ("sparse", 3, 1)]  # (kind, kernel or block, tile_size or halo)


def _plans(window, grid, device=torch.device("cpu")):
    kind, size, extra = window
    if kind == "neighborhood":
        return [neighborhood_axis(length, size, extra, device) for length in grid]
    return [blocked_axis(length, size, extra, device) for length in grid]


def _allowed(window, grid, p, prefix_visible, device=None):
    """(N, N) bool from the naive twins' masks: prefix rows all True, the patch block the window."""
    kind, size, extra = window
    if prefix_visible:
        local = "neighborhood" if kind == "neighborhood" else "sparse"
        return longformer_mask(grid, p, local, kernel_size=size, block_size=size, halo=extra, device=device)
    allowed = torch.ones(p + grid[0] * grid[1], p + grid[0] * grid[1], dtype=torch.bool, device=device)
    allowed[p:, :p] = False
    allowed[p:, p:] = neighborhood_mask(grid, size, device) if kind == "neighborhood" else sparse_mask(grid, size, extra, device)
    return allowed


def _dense_blocks(num_blocks, indices, count):
    """(Qb, KVb) bool from FlexAttention's ordered (1, 1, Qb) counts and (1, 1, Qb, KVb) indices."""
    dense = torch.zeros(count, count, dtype=torch.bool)
    for row in range(count):
        dense[row, indices[0, 0, row, : num_blocks[0, 0, row]].long()] = True
    return dense


CASES = [(grid, p, vis, window) for grid in GRIDS for p in PREFIX for vis in (False, True) for window in WINDOWS]
IDS = [f"grid{g[0]}x{g[1]}-p{p}-{'global' if vis else 'local'}-{w[0]}{w[1]}" for g, p, vis, w in CASES]


@pytest.mark.parametrize("grid,p,prefix_visible,window", CASES, ids=IDS)
def test_mask_and_block_tables_match_the_definitions(grid, p, prefix_visible, window):
    rows, cols = _plans(window, grid)
    layout = flex_layout(rows, cols, p, prefix_visible)
    slots = layout.slot_token.shape[0]
    assert slots % local_flex.BLOCK == 0
    pairs = torch.arange(slots)
    kept = layout.block_mask.mask_mod(0, 0, pairs[:, None], pairs[None, :])  # (S, S): every slot pair
    in_token_order = kept[layout.token_slot][:, layout.token_slot]
    assert torch.equal(in_token_order, _allowed(window, grid, p, prefix_visible))
    assert torch.equal(layout.slot_token[layout.token_slot], torch.arange(p + grid[0] * grid[1]))
    # the block tables built from the axes are the ones FlexAttention derives from mask_mod
    mask, reference = layout.block_mask, create_block_mask(layout.block_mask.mask_mod, 1, 1, slots, slots, device="cpu")
    count = slots // local_flex.BLOCK
    for table in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        ours = _dense_blocks(*(getattr(mask, name) for name in table), count)
        assert torch.equal(ours, _dense_blocks(*(getattr(reference, name) for name in table), count)), table[0]


@pytest.mark.parametrize("b,heads,d", [(1, 2, 8), (3, 3, 16)], ids=["B1-H2-d8", "B3-H3-d16"])
@pytest.mark.parametrize("grid,p,prefix_visible,window", CASES[::5], ids=IDS[::5])
def test_forward_matches_naive_and_gathered(grid, p, prefix_visible, window, b, heads, d):
    rows, cols = _plans(window, grid)
    q, k, v = (torch.randn(b, heads, p + grid[0] * grid[1], d) for _ in range(3))
    out = flex_local_attn(q, k, v, rows, cols, p, prefix_visible)
    assert out.transpose(1, 2).is_contiguous()  # token-major, as the engine's other paths return
    naive = naive_masked_attn(q, k, v, _allowed(window, grid, p, prefix_visible))
    assert_rms_close(out, naive, 1e-5, "flex vs naive")
    gathered = tiled_local_attn(q, k, v, rows, cols, p, prefix_visible, backend="gathered")
    assert_rms_close(out, gathered, 1e-5, "flex vs gathered")


def test_block_mask_is_built_once_per_key(monkeypatch):
    builds = []

    def counted(plan, tile):
        builds.append(plan.length)
        return axis_blocks(plan, tile)

    axis_blocks = local_flex._axis_blocks
    monkeypatch.setattr(local_flex, "_axis_blocks", counted)
    rows, cols = _plans(("neighborhood", 3, 2), (17, 19))
    q, k, v = (torch.randn(1, 2, 2 + 17 * 19, 8) for _ in range(3))
    first = flex_layout(rows, cols, 2, True)
    for _ in range(3):
        flex_local_attn(q, k, v, rows, cols, 2, True)
    assert flex_layout(rows, cols, 2, True) is first
    assert builds == [17, 19]  # one build: the two axes' tables
    assert flex_layout(rows, cols, 2, False) is not first
    assert builds == [17, 19, 17, 19]


LAYERS = [
    ("neighborhood", {"kernel_size": 3}, 0),
    ("sparse", {"block_size": 3, "halo": 1}, 1),
    ("longformer", {"local": "neighborhood", "kernel_size": 5, "num_extra_global_tokens": 1}, 1),
]


@pytest.mark.parametrize("name,opts,p", LAYERS, ids=[name for name, _, _ in LAYERS])
def test_forced_flex_runs_a_layer_like_gathered(name, opts, p):
    layer = get_attention(name)(32, 2, qkv_bias=True, **opts)
    layer.set_grid((9, 7), p)
    x = torch.randn(3, p + 9 * 7, 32)
    with torch.no_grad():
        with force_backend("local", "flex"):
            flex = layer(x)
        with force_backend("local", "gathered"):
            gathered = layer(x)
    assert_rms_close(flex, gathered, 1e-5, f"{name}: flex vs gathered")


def test_flex_is_chosen_on_cuda_without_dropout(monkeypatch):
    """Where Triton is missing; with it, the Triton kernels (tests/ops/test_local_triton.py)."""
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: False)
    cuda = torch.device("cuda")
    for needs_grad in (False, True):
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, dense_cheaper=False) == "flex"
        # short sequences: no empty block to skip, dense as on every device
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, dense_cheaper=True) == "dense"
        # FlexAttention has no dropout: the SDPA paths take it
        assert backends.choose_local_backend(cuda, needs_grad, 0.1, False, dense_cheaper=False) == "gathered"
        assert backends.choose_local_backend(cuda, needs_grad, 0.1, False, dense_cheaper=True) == "dense"
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, True, dense_cheaper=False) == "gathered"
        assert backends.choose_local_backend(torch.device("cpu"), needs_grad, 0.0, False, dense_cheaper=False) != "flex"


def test_flex_refuses_dropout():
    q, k, v = (torch.randn(1, 2, 5 * 6, 8) for _ in range(3))
    with pytest.raises(ValueError, match="backend 'flex' has no dropout, got dropout_p=0.1"):
        ops.neighborhood_attn(q, k, v, (5, 6), 3, dropout_p=0.1, backend="flex")


TILE_ORDER_CASES = [  # (grid, P, tile_aligned): prefix tokens padded to a block; run apart on a ragged grid
    ((13, 11), 2, False),
    ((13, 21), 1, True),
]


@pytest.mark.parametrize("grid,p,aligned", TILE_ORDER_CASES, ids=["exact-grid13x11-p2", "aligned-grid13x21-p1"])
def test_tokens_in_tile_order_give_the_raster_outputs_in_their_slots(grid, p, aligned):
    rows, cols = neighborhood_plans(grid, 5, 4, (8, 16) if aligned else None, torch.device("cpu"))
    layout = flex_layout(rows, cols, p, False)
    q, k, v = (torch.randn(2, 3, p + grid[0] * grid[1], 8) for _ in range(3))
    options = dict(num_prefix_tokens=p, tile_size=4, tile_aligned=aligned)
    raster = ops.neighborhood_attn(q, k, v, grid, 5, backend="flex", **options)
    in_slots = [t[:, :, layout.slot_token] for t in (q, k, v)]  # (B, heads, S, d)
    tiled = ops.neighborhood_attn(*in_slots, grid, 5, token_order="tile", **options)
    assert tiled.shape[2] == layout.num_slots
    assert_rms_close(tiled[:, :, layout.token_slot], raster, 1e-6, "tile order vs raster order")


def test_tile_order_refuses_other_paths_orders_and_token_counts():
    grid = (9, 7)
    q = torch.randn(1, 2, 9 * 7, 8)
    with pytest.raises(ValueError, match="token_order must be one of raster, tile, got 'tiles'"):
        ops.neighborhood_attn(q, q, q, grid, 3, token_order="tiles")
    with pytest.raises(ValueError, match="tokens in tile order take backend 'flex', got 'gathered'"):
        ops.sparse_attn(q, q, q, grid, 3, 1, token_order="tile", backend="gathered")
    with force_backend("local", "dense"), pytest.raises(ValueError, match="take backend 'flex', got 'dense'"):
        ops.sparse_attn(q, q, q, grid, 3, 1, token_order="tile")
    with pytest.raises(ValueError, match="in tile order q, k, v hold the layout's 128 slots, got 63 tokens"):
        ops.neighborhood_attn(q, q, q, grid, 3, token_order="tile")


@pytest.mark.compile
def test_traces_into_one_graph():
    """Plans and block mask are built inside the graph (no cached fake tensors) without a break."""
    grid, p = (9, 6), 1
    q, k, v = (torch.randn(2, 2, p + grid[0] * grid[1], 8) for _ in range(3))

    def attend(q, k, v):
        return ops.longformer_attn(q, k, v, grid, p, kernel_size=3, tile_size=2, backend="flex")

    compiled = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v)
    assert_rms_close(compiled, naive_longformer_attn(q, k, v, grid, p, kernel_size=3), 1e-5, "compiled flex")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 keeps 8 significant bits: each rounding is off by up to 2^-8 relative. The kernel rounds the
# inputs, the probabilities before P @ V and the output (and in the backward dO, dP and dS as well),
# each an independent error well under 2^-8 in RMS; 4 x 2^-8 for outputs and 8 x 2^-8 for gradients
# leave room for those roundings adding up, and still fail a wrong window (errors of order 1).
BF16_OUT_TOL, BF16_GRAD_TOL = 4 * 2**-8, 8 * 2**-8

CUDA_CASES = [
    (1, 2, (13, 11), 0, False, ("neighborhood", 5, 4), 32),
    (3, 3, (20, 24), 1, False, ("sparse", 8, 3), 32),
    (1, 2, (17, 30), 3, True, ("neighborhood", 7, 8), 64),
]
CUDA_IDS = [f"B{b}-H{h}-grid{g[0]}x{g[1]}-p{p}-{'global' if vis else 'local'}-{w[0]}{w[1]}-d{d}" for b, h, g, p, vis, w, d in CUDA_CASES]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,heads,grid,p,prefix_visible,window,d", CUDA_CASES, ids=CUDA_IDS)
def test_cuda_matches_naive(b, heads, grid, p, prefix_visible, window, d, dtype, monkeypatch):
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: False)  # FlexAttention chosen, as without Triton
    device = torch.device("cuda")
    rows, cols = _plans(window, grid, device)
    q, k, v = (torch.randn(b, heads, p + grid[0] * grid[1], d, device=device).to(dtype) for _ in range(3))
    allowed = _allowed(window, grid, p, prefix_visible, device)
    cotangent = torch.randn(q.shape[:3] + (d,), device=device).to(dtype)

    def run(fn, *inputs):  # grads_of on the GPU: the output and the inputs' gradients under one cotangent
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(cotangent.to(out.dtype))
        return out.detach(), [t.grad for t in leaves]

    expected, expected_grads = run(lambda q, k, v: naive_masked_attn(q, k, v, allowed), *(t.double() for t in (q, k, v)))
    assert backends.choose_local_backend(q.device, True, 0.0, False, dense_cheaper=False) == "flex"
    out, grads = run(lambda q, k, v: tiled_local_attn(q, k, v, rows, cols, p, prefix_visible), q, k, v)
    out_tol, grad_tol = (1e-5, 1e-5) if dtype == torch.float32 else (BF16_OUT_TOL, BF16_GRAD_TOL)
    assert_rms_close(out, expected, out_tol, "out")
    for name, g, g_ref in zip("qkv", grads, expected_grads):
        assert_rms_close(g, g_ref, grad_tol, f"d{name}")
