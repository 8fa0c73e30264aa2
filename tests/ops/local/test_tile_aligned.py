"""The tile-aligned windows (``tile_aligned=True`` of neighborhood and sparse): their plain definitions, every
path of the engine against the naive twins (outputs, and gradients where the path has them) on odd non-square
grids with prefix tokens, and FlexAttention's block mask: every kept block full, as many as the cost formula
counts, on the CPU; on a GPU, the compiled kernel against the twins."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tests.helpers import TRITON_ON_CPU, assert_rms_close, grads_of
from visattn.layers.registry import attention_options, get_attention
from visattn.ops import backends, neighborhood_attn, sparse_attn
from visattn.ops.local import flex as local_flex
from visattn.ops.local import tile_neighborhood_axis
from visattn.ops.local.flex import flex_layout, flex_slots, full_block_tile
from visattn.ops.neighborhood import naive_neighborhood_attn, neighborhood_mask, neighborhood_plans
from visattn.ops.sparse import naive_sparse_attn, sparse_mask, sparse_plans

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU = torch.device("cpu")

# op: (the op with tile-aligned windows, its naive twin, the window plans of a grid and a tile); kernel 5, halo 3
OPS = {
    "neighborhood": (
        lambda *a, **kw: neighborhood_attn(*a, 5, tile_aligned=True, **kw),
        lambda *a, **kw: naive_neighborhood_attn(*a, 5, tile_aligned=True, **kw),
        lambda grid, tile, device=CPU: neighborhood_plans(grid, 5, 8, tile, device),
    ),
    "sparse": (
        lambda *a, **kw: sparse_attn(*a, 8, 3, tile_aligned=True, **kw),
        lambda *a, **kw: naive_sparse_attn(*a, 8, 3, tile_aligned=True, **kw),
        lambda grid, tile, device=CPU: sparse_plans(grid, 8, 3, tile, device),
    ),
}
# (grid, prefix tokens, tile): ragged last tiles on both axes; a tile wider than the grid; the default tile
CASES = [((13, 11), 2, (4, 3)), ((7, 17), 1, (2, 5)), ((5, 9), 3, (8, 16)), ((19, 35), 1, (8, 16))]
CASE_IDS = [f"grid{g[0]}x{g[1]}-p{p}-tile{t[0]}x{t[1]}" for g, p, t in CASES]


@pytest.mark.parametrize(
    "length,tile,k,windows",
    [
        (10, 3, 5, [[0, 9]] * 6 + [[3, 10]] * 4),  # 4 tiles, the last ragged; 3 tiles each, shifted inward
        (10, 3, 1, [[0, 3]] * 3 + [[3, 6]] * 3 + [[6, 9]] * 3 + [[9, 10]]),  # k = 1: each tile itself
        (5, 2, 9, [[0, 5]] * 5),  # 3 tiles, 2 either side wanted: the whole axis
        (4, 8, 3, [[0, 4]] * 4),  # a tile longer than the axis
    ],
    ids=["L10-t3-k5", "L10-t3-k1", "L5-t2-k9", "L4-t8-k3"],
)
def test_neighborhood_windows_by_hand(length, tile, k, windows):
    """Each query's window [lo, hi) along one axis, written out: the twin's mask and the plan's."""
    for grid, aligned in (((1, length), (1, tile)), ((length, 1), (tile, 1))):
        allowed = neighborhood_mask(grid, k, aligned_tile=aligned)
        assert [[row.nonzero().min().item(), row.nonzero().max().item() + 1] for row in allowed] == windows
    plan = tile_neighborhood_axis(length, tile, -(-(k // 2) // tile), CPU)
    assert torch.equal(plan.axis_mask(), neighborhood_mask((1, length), k, aligned_tile=(1, tile)))


@pytest.mark.parametrize(
    "length,tile,halo,windows",
    [
        (10, 3, 2, [[0, 6]] * 3 + [[0, 9]] * 3 + [[3, 10]] * 3 + [[6, 10]]),  # halo 2 -> 1 tile, cut at the border
        (10, 3, 0, [[0, 3]] * 3 + [[3, 6]] * 3 + [[6, 9]] * 3 + [[9, 10]]),  # Swin's windows, no shift
        (10, 3, 4, [[0, 9]] * 3 + [[0, 10]] * 6 + [[3, 10]]),  # halo 4 -> 2 tiles
    ],
    ids=["L10-t3-halo2", "L10-t3-halo0", "L10-t3-halo4"],
)
def test_sparse_windows_by_hand(length, tile, halo, windows):
    for grid, aligned in (((1, length), (1, tile)), ((length, 1), (tile, 1))):
        allowed = sparse_mask(grid, 8, halo, aligned_tile=aligned)
        assert [[row.nonzero().min().item(), row.nonzero().max().item() + 1] for row in allowed] == windows


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grid,p,tile", CASES, ids=CASE_IDS)
def test_plans_are_the_twins_windows(op, grid, p, tile):
    rows, cols = OPS[op][2](grid, tile)
    if op == "neighborhood":
        twin = neighborhood_mask(grid, 5, aligned_tile=tile)
    else:
        twin = sparse_mask(grid, 8, 3, aligned_tile=tile)
    assert torch.equal(rows.axis_mask()[:, None, :, None] & cols.axis_mask()[None, :, None, :], twin.view(*grid, *grid))
    assert rows.whole_tiles and cols.whole_tiles


@pytest.mark.parametrize(
    "grid,k", [((13, 11), 5), ((19, 35), 7), ((6, 40), 9)], ids=["grid13x11-k5", "grid19x35-k7", "grid6x40-k9"]
)
@pytest.mark.parametrize("tile", [(4, 3), (8, 16)], ids=["tile4x3", "tile8x16"])
def test_a_tile_window_holds_each_querys_neighbourhood(grid, k, tile):
    exact, aligned = neighborhood_mask(grid, k), neighborhood_mask(grid, k, aligned_tile=tile)
    assert bool((aligned | ~exact).all())
    assert not torch.equal(aligned, exact)


# every path on three grids, but the Triton kernels (interpreted on the CPU: tens of seconds a case) on the first
PATHS = [(case, case_id, backend) for case, case_id in zip(CASES[:3], CASE_IDS) for backend in backends.BACKENDS["local"]
         if backend != "triton" or case == CASES[0]]
PATH_CASES = [
    pytest.param(*case, backend, marks=TRITON_ON_CPU if backend == "triton" else (), id=f"{case_id}-{backend}")
    for case, case_id, backend in PATHS
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grid,p,tile,backend", PATH_CASES)
def test_every_path_matches_the_naive_twin(op, grid, p, tile, backend):
    """Outputs, and on the differentiable paths gradients, against the explicit-mask twin. chunked: inference
    only; flex: FlexAttention has no backward on the CPU; triton: sparse's windows only."""
    attn, naive_attn, _ = OPS[op]
    q, k, v = (torch.randn(2, 3, p + grid[0] * grid[1], 8) for _ in range(3))
    fast = lambda q, k, v: attn(q, k, v, grid, num_prefix_tokens=p, aligned_tile=tile, backend=backend)
    naive = lambda q, k, v: naive_attn(q, k, v, grid, num_prefix_tokens=p, aligned_tile=tile)
    if backend == "triton" and op == "neighborhood":
        with pytest.raises(ValueError, match="compute 'neighborhood' and 'blocked' windows, got 'tile_neighborhood'"):
            fast(q, k, v)
        return
    if backend in ("chunked", "flex"):
        with torch.no_grad():
            assert_rms_close(fast(q, k, v), naive(q, k, v), 1e-5, "out")
        return
    out, grads = grads_of(fast, q, k, v)
    ref, ref_grads = grads_of(naive, q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


def _dense_blocks(num_blocks, indices, count):
    """(Qb, KVb) bool from FlexAttention's ordered (1, 1, Qb) counts and (1, 1, Qb, KVb) indices."""
    dense = torch.zeros(count, count, dtype=torch.bool)
    for row in range(count):
        dense[row, indices[0, 0, row, : num_blocks[0, 0, row]].long()] = True
    return dense


LAYER_OPTIONS = {"neighborhood": {"tile_aligned": True}, "sparse": {"tile_aligned": True}}


@pytest.mark.parametrize("halo", [0, 3], ids=["halo0", "halo3"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "grid,p", [((32, 48), 0), ((40, 80), 1), ((16, 64), 5)], ids=["grid32x48-p0", "grid40x80-p1", "grid16x64-p5"]
)
def test_every_kept_block_is_full_and_counted_by_the_cost_formula(op, grid, p, halo):
    """On grids of whole 8 x 16 tiles: no partial block (FlexAttention never evaluates the mask), the prefix
    rows apart; the kept blocks are the (query, key) pairs of the layer's cost formula over 128 x 128, and the
    tables are those FlexAttention derives from the mask itself."""
    window = {"halo": halo} if op == "sparse" else {"kernel_size": 2 * halo + 1}
    options = attention_options(op, LAYER_OPTIONS[op] | window, grid)
    tile = options["aligned_tile"]
    rows, cols = (
        neighborhood_plans(grid, options["kernel_size"], 8, tile, CPU) if op == "neighborhood"
        else sparse_plans(grid, 8, halo, tile, CPU)
    )
    assert full_block_tile(rows, cols) == tile == (8, 16)
    layout = flex_layout(rows, cols, p, False)
    mask = layout.block_mask
    assert int(mask.kv_num_blocks.sum()) == 0
    assert layout.attended == grid[0] * grid[1] == layout.slot_token.shape[0] - p
    tilings = get_attention(op).window_tilings(grid, options)
    assert int(mask.full_kv_num_blocks.sum()) * local_flex.BLOCK**2 == tilings[0].keys_seen * tilings[1].keys_seen
    assert flex_slots(*tilings, p, False) == layout.slot_token.shape[0]
    slots = layout.attended
    reference = create_block_mask(mask.mask_mod, 1, 1, slots, slots, device="cpu")
    count = slots // local_flex.BLOCK
    assert int(reference.kv_num_blocks.sum()) == 0
    assert torch.equal(_dense_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, count),
                       _dense_blocks(reference.full_kv_num_blocks, reference.full_kv_indices, count))


def test_ragged_tiles_are_the_only_partial_blocks():
    """19 x 35 patches in 8 x 16 tiles: 3 x 3 tiles, the last row and column of them ragged. A block pair is
    partial exactly where one of its tiles is ragged and it is kept; the tables match FlexAttention's own."""
    grid, tile = (19, 35), (8, 16)
    rows, cols = sparse_plans(grid, 8, 0, tile, CPU)
    mask = flex_layout(rows, cols, 1, False).block_mask
    slots = mask.seq_lengths[0]
    count = slots // local_flex.BLOCK
    partial = _dense_blocks(mask.kv_num_blocks, mask.kv_indices, count)
    ragged = torch.tensor([i == 2 or j == 2 for i in range(3) for j in range(3)])
    assert torch.equal(partial, torch.diag(ragged))  # halo 0: each tile with itself
    reference = create_block_mask(mask.mask_mod, 1, 1, slots, slots, device="cpu")
    for table in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        ours = _dense_blocks(*(getattr(mask, name) for name in table), count)
        assert torch.equal(ours, _dense_blocks(*(getattr(reference, name) for name in table), count)), table[0]


def test_a_tile_of_two_blocks_keeps_its_blocks_full():
    """16 x 16 tiles (two blocks each, its upper and lower 8 rows) on a 32 x 32 grid: full blocks only."""
    rows, cols = neighborhood_plans((32, 32), 3, 8, (16, 16), CPU)
    mask = flex_layout(rows, cols, 0, False).block_mask
    assert int(mask.kv_num_blocks.sum()) == 0
    assert int(mask.full_kv_num_blocks.sum()) == 8 * 8  # every tile sees both tiles of each axis


def test_flex_is_chosen_on_cuda_even_where_triton_runs(monkeypatch):
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    cuda = torch.device("cuda")
    for needs_grad in (False, True):
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, False, full_blocks=True) == "flex"
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, False, full_blocks=False) == "triton"
        assert backends.choose_local_backend(cuda, needs_grad, 0.1, False, False, full_blocks=True) == "gathered"
        assert backends.choose_local_backend(CPU, needs_grad, 0.0, False, False, full_blocks=True) != "flex"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tile_aligned": 1}, "tile_aligned must be True or False, got 1"),
        ({"tile_aligned": True, "aligned_tile": (8, 0)}, "aligned_tile must be"),
        ({"tile_aligned": True, "aligned_tile": (8, 16, 2)}, "aligned_tile must be"),
        ({"tile_aligned": True, "aligned_tile": "8x16"}, "aligned_tile must be"),
    ],
    ids=["flag-int", "tile-zero", "tile-three", "tile-text"],
)
@pytest.mark.parametrize("op", ["neighborhood", "sparse"])
def test_bad_options_raise(op, kwargs, match):
    q, k, v = (torch.randn(1, 1, 4 * 4, 8) for _ in range(3))
    if op == "neighborhood":
        attn = lambda *a, **kw: neighborhood_attn(*a, 3, **kw)
    else:
        attn = lambda *a, **kw: sparse_attn(*a, 2, 1, **kw)
    with pytest.raises(ValueError, match=match):
        attn(q, k, v, (4, 4), **kwargs)


@pytest.mark.compile
@pytest.mark.parametrize("grid", [(16, 32), (19, 35)], ids=["grid16x32", "grid19x35-ragged"])
def test_flex_traces_into_one_graph(grid):
    """Plans, block mask and the prefix rows' SDPA apart, built inside the graph without a break."""
    p = 2
    q, k, v = (torch.randn(1, 2, p + grid[0] * grid[1], 8) for _ in range(3))

    def attend(q, k, v):
        return neighborhood_attn(q, k, v, grid, 7, num_prefix_tokens=p, tile_aligned=True, backend="flex")

    compiled = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v)
    naive = naive_neighborhood_attn(q, k, v, grid, 7, num_prefix_tokens=p, tile_aligned=True)
    assert_rms_close(compiled, naive, 1e-5, "compiled flex")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_OUT_TOL, BF16_GRAD_TOL = 4 * 2**-8, 8 * 2**-8  # as the flex path's GPU tests (tests/ops/local/test_flex.py)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grid,p", [((32, 48), 1), ((19, 35), 2)], ids=["grid32x48-p1", "grid19x35-p2"])
def test_cuda_flex_matches_naive(op, grid, p, dtype):
    """FlexAttention compiled, chosen on CUDA: outputs and gradients against the twin in fp64."""
    attn, naive_attn, _ = OPS[op]
    device = torch.device("cuda")
    q, k, v = (torch.randn(2, 2, p + grid[0] * grid[1], 64, device=device).to(dtype) for _ in range(3))
    cotangent = torch.randn(q.shape, device=device).to(dtype)

    def run(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(cotangent.to(out.dtype))
        return out.detach(), [t.grad for t in leaves]

    naive = lambda q, k, v: naive_attn(q, k, v, grid, num_prefix_tokens=p)
    expected, expected_grads = run(naive, *(t.double() for t in (q, k, v)))
    with backends.force_backend("local", "flex"):
        out, grads = run(lambda q, k, v: attn(q, k, v, grid, num_prefix_tokens=p), q, k, v)
    out_tol, grad_tol = (1e-5, 1e-5) if dtype == torch.float32 else (BF16_OUT_TOL, BF16_GRAD_TOL)
    assert_rms_close(out, expected, out_tol, "out")
    for name, g, g_ref in zip("qkv", grads, expected_grads):
        assert_rms_close(g, g_ref, grad_tol, f"d{name}")
