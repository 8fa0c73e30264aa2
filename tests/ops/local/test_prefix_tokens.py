"""The local ops' contract with prefix tokens (the layers' class and register tokens), on odd non-square grids,
on every path: P prefix tokens first, prefix queries over all tokens, patch queries over their window only."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close, cpu_paths, grads_of
from visattn.ops import neighborhood_attn, sparse_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.sparse import naive_sparse_attn

# the flex path runs FlexAttention eagerly on the CPU, which says it is unfused
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# op: (the op with its window options, its naive twin with the same)
OPS = {
    "neighborhood": (lambda *a, **kw: neighborhood_attn(*a, 3, tile_size=2, **kw), lambda *a, **kw: naive_neighborhood_attn(*a, 3, **kw)),
    "sparse": (lambda *a, **kw: sparse_attn(*a, 2, 1, **kw), lambda *a, **kw: naive_sparse_attn(*a, 2, 1, **kw)),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", cpu_paths("local"))
@pytest.mark.parametrize("grid,p", [((5, 7), 2), ((7, 5), 1), ((3, 11), 3)], ids=["grid5x7-p2", "grid7x5-p1", "grid3x11-p3"])
def test_prefix_tokens_on_odd_grids_match_the_naive_twin(op, grid, p, backend):
    """Outputs and, on the differentiable paths, gradients against the naive twin; and the twin itself: prefix
    rows are full softmax attention, patch rows never see a prefix key."""
    attn, naive_attn = OPS[op]
    q, k, v = (torch.randn(2, 3, p + grid[0] * grid[1], 8) for _ in range(3))
    fast = lambda q, k, v: attn(q, k, v, grid, num_prefix_tokens=p, backend=backend)
    naive = lambda q, k, v: naive_attn(q, k, v, grid, num_prefix_tokens=p)
    if backend in ("chunked", "flex"):  # chunked: inference only; flex: FlexAttention has no backward on the CPU
        assert_rms_close(fast(q, k, v), naive(q, k, v), 1e-5, "out")
    else:
        out, grads = grads_of(fast, q, k, v)
        ref, ref_grads = grads_of(naive, q, k, v)
        assert_rms_close(out, ref, 1e-5, "out")
        for name, g, g_ref in zip("qkv", grads, ref_grads):
            assert_rms_close(g, g_ref, 1e-5, f"d{name}")
    ref = naive(q, k, v)
    assert_rms_close(ref[:, :, :p], torch.nn.functional.scaled_dot_product_attention(q[:, :, :p], k, v), 1e-5, "prefix")
    v_moved = v.clone()
    v_moved[:, :, :p] += 100.0
    torch.testing.assert_close(naive(q, k, v_moved)[:, :, p:], ref[:, :, p:])
