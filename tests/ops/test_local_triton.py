"""The local windows' fused Triton kernels (visattn.ops.local.triton) against the naive twins of neighborhood,
sparse and longformer: outputs and the gradient of the qkv projection they read q, k and v from in place,
in fp32, fp16 and bf16, on odd non-square grids with prefix tokens, windows clamped at every border, grids
smaller than a query tile, head dims 16 and 64; the same bits from run to run; results independent of the
tile shapes; a compiled graph around the op.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py); the ``cuda``
cases run them compiled, with one fixed launch configuration so that no test autotunes."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close
from visattn.ops.layout import split_qkv
from visattn.ops.local import blocked_axis, neighborhood_axis
from visattn.ops.local import triton as local_triton
from visattn.ops.local.triton import TileConfig, triton_local_attn
from visattn.ops.longformer import naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.sparse import naive_sparse_attn
from visattn.ops.triton_support import HAS_TRITON, INTERPRETED

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton runs on the CPU only interpreted")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Outputs 4 u, gradients 8 u (u: the dtype's unit roundoff): the twin sees the same rounded inputs and
# cotangent, the kernels sum in fp32, and a 16-bit output passes through two roundings (the weights for
# the product with v, the output), a gradient through about three. fp32: the suite's 1e-5 and 4 x that.
TOLERANCES = {
    torch.float32: (1e-5, 4e-5), torch.float16: (4 * 2**-11, 8 * 2**-11), torch.bfloat16: (4 * 2**-8, 8 * 2**-8)
}

# (type, B, heads, grid, P, window, head_dim, dtype); window: neighborhood k, sparse (block, halo),
# longformer (local, k or (block, halo)) with the prefix tokens global
CASES = [
    ("neighborhood", 1, 2, (13, 11), 2, 7, 16, "fp32"),
    ("neighborhood", 2, 1, (9, 17), 1, 5, 64, "bf16"),
    ("neighborhood", 1, 2, (3, 2), 0, 5, 16, "fp16"),  # smaller than a tile, k clamped to both sides
    ("neighborhood", 1, 1, (1, 6), 1, 3, 16, "fp32"),  # a single row
    ("neighborhood", 1, 2, (10, 9), 0, 3, 64, "fp16"),
    ("sparse", 1, 2, (13, 11), 2, (4, 1), 16, "fp32"),
    ("sparse", 2, 1, (9, 17), 1, (8, 3), 64, "bf16"),
    ("sparse", 1, 2, (7, 5), 0, (3, 0), 16, "fp16"),  # blocks without a halo, partial at both ends
    ("longformer", 1, 2, (13, 11), 2, ("neighborhood", 7), 16, "bf16"),
    ("longformer", 1, 1, (9, 17), 1, ("sparse", (3, 2)), 64, "fp32"),
    ("longformer", 1, 2, (5, 4), 3, ("neighborhood", 5), 16, "fp16"),
]


def _case_id(case) -> str:
    kind, b, heads, (gh, gw), p, window, d, dtype = case
    if kind == "longformer":
        local, window = window
        kind = f"longformer-{local}"
    shape = f"k{window}" if isinstance(window, int) else f"b{window[0]}h{window[1]}"
    return f"{kind}-B{b}-H{heads}-grid{gh}x{gw}-p{p}-{shape}-d{d}-{dtype}"


def _ops(kind, grid, p, window, device):
    """(the Triton op, the naive twin), each (q, k, v) -> (B, heads, N, d)."""
    local, prefix_visible = kind, kind == "longformer"
    if prefix_visible:
        local, window = window
    if local == "neighborhood":
        plans = [neighborhood_axis(length, window, 8, device) for length in grid]
        size = {"kernel_size": window}
    else:
        plans = [blocked_axis(length, *window, device) for length in grid]
        size = {"block_size": window[0], "halo": window[1]}

    def fast(q, k, v):
        return triton_local_attn(q, k, v, *plans, num_prefix_tokens=p, prefix_visible=prefix_visible)

    def naive(q, k, v):
        if prefix_visible:
            return naive_longformer_attn(q, k, v, grid, p, local, **size)
        if local == "neighborhood":
            return naive_neighborhood_attn(q, k, v, grid, window, num_prefix_tokens=p)
        return naive_sparse_attn(q, k, v, grid, window[0], window[1], num_prefix_tokens=p)

    return fast, naive


def _run(fn, qkv: torch.Tensor, heads: int, cotangent: torch.Tensor):
    """fn on q, k, v as views of the projection (B, N, 3 C), as the layers pass them: the output and the
    gradient of the projection."""
    leaf = qkv.detach().clone().requires_grad_(True)
    out = fn(*split_qkv(leaf, heads))
    out.backward(cotangent)
    return out.detach(), leaf.grad


def _inputs(b, heads, grid, p, d, dtype, device):
    n = p + grid[0] * grid[1]
    qkv = torch.randn(b, n, 3 * heads * d).to(device=device, dtype=dtype)
    cotangent = torch.randn(b, heads, n, d).to(device=device, dtype=dtype)
    return qkv, cotangent


@pytest.fixture(autouse=True)
def _one_gpu_configuration(monkeypatch):
    """On a GPU, one configuration per kernel from the table instead of autotuning every test's shapes."""
    for name in local_triton.INTERPRETED_CONFIGS:
        for block_d in (16, 64):
            for dtype in DTYPES.values():
                key = (name, block_d, str(dtype).removeprefix("torch."))
                monkeypatch.setitem(local_triton.TUNED_CONFIGS, key, TileConfig(8, 8, 8, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_naive_twin(case, device):
    kind, b, heads, grid, p, window, d, dtype_name = case
    dtype = DTYPES[dtype_name]
    fast, naive = _ops(kind, grid, p, window, torch.device(device))
    qkv, cotangent = _inputs(b, heads, grid, p, d, dtype, device)
    out, grad = _run(fast, qkv, heads, cotangent)
    ref, ref_grad = _run(naive, qkv.double(), heads, cotangent.double())
    out_tol, grad_tol = TOLERANCES[dtype]
    assert out.dtype == dtype and grad.dtype == dtype
    assert out.transpose(1, 2).is_contiguous(), "the output is token-major (B, N, heads, d)"
    assert_rms_close(out, ref, out_tol, "out")
    for name, g, g_ref in zip("qkv", grad.chunk(3, dim=-1), ref_grad.chunk(3, dim=-1)):
        assert_rms_close(g, g_ref, grad_tol, f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
def test_contiguous_heads_layout(device):
    """q, k, v in the (B, heads, N, d) layout of their own, not views of one projection."""
    grid, p = (6, 7), 1
    fast, naive = _ops("longformer", grid, p, ("neighborhood", 3), torch.device(device))
    q, k, v = (torch.randn(2, 2, p + 42, 16, device=device) for _ in range(3))
    assert_rms_close(fast(q, k, v), naive(q, k, v), 1e-5, "out")


@pytest.mark.parametrize("device", DEVICES)
def test_more_prefix_tokens_than_a_tile(device, monkeypatch):
    """18 global tokens in tiles of 16: two prefix key tiles, query tiles and row blocks of the prefix rows."""
    monkeypatch.setattr(local_triton, "MAX_BLOCK_P", 16)
    grid, p, heads = (5, 6), 18, 2
    fast, naive = _ops("longformer", grid, p, ("neighborhood", 3), torch.device(device))
    qkv, cotangent = _inputs(1, heads, grid, p, 16, torch.float32, device)
    out, grad = _run(fast, qkv, heads, cotangent)
    ref, ref_grad = _run(naive, qkv.double(), heads, cotangent.double())
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 4e-5, "dqkv")


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_every_run(device):
    fast, _ = _ops("longformer", (13, 11), 2, ("sparse", (4, 2)), torch.device(device))
    qkv, cotangent = _inputs(1, 2, (13, 11), 2, 16, torch.bfloat16, device)
    out, grad = _run(fast, qkv, 2, cotangent)
    again, grad_again = _run(fast, qkv, 2, cotangent)
    assert torch.equal(out, again) and torch.equal(grad, grad_again)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "forward,dq,dkdv",
    [((4, 8, 8, 4), (8, 4, 4, 8), (4, 8, 8, 4)), ((16, 4, 4, 16), (4, 16, 16, 4), (8, 16, 4, 8))],
    ids=["tiles4x8-8x4", "tiles16x4-4x16"],
)
def test_result_does_not_depend_on_tiles(forward, dq, dkdv, device, monkeypatch):
    """Other query and key tile shapes (non-square, across the blocks of the sparse windows) give the
    same result; the dq kernel's shares of the prefix keys' gradients follow the tile count."""
    fast, _ = _ops("longformer", (13, 11), 2, ("sparse", (3, 1)), torch.device(device))
    qkv, cotangent = _inputs(1, 1, (13, 11), 2, 16, torch.float32, device)
    out, grad = _run(fast, qkv, 1, cotangent)
    for name, tiles in zip(local_triton.INTERPRETED_CONFIGS, (forward, dq, dkdv)):
        monkeypatch.setitem(local_triton.INTERPRETED_CONFIGS, name, TileConfig(*tiles))
        for key in [key for key in local_triton.TUNED_CONFIGS if key[0] == name]:
            monkeypatch.setitem(local_triton.TUNED_CONFIGS, key, TileConfig(*tiles))
    other, other_grad = _run(fast, qkv, 1, cotangent)
    assert_rms_close(other, out, 1e-6, "out")
    assert_rms_close(other_grad, grad, 1e-6, "dqkv")


@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_graph(device):
    """torch.compile(fullgraph=True) captures the op and its backward."""
    torch._dynamo.reset()
    grid, p, heads = (6, 5), 1, 2
    fast, _ = _ops("neighborhood", grid, p, 3, torch.device(device))
    qkv, cotangent = _inputs(1, heads, grid, p, 16, torch.float32, device)
    out, grad = _run(fast, qkv, heads, cotangent)
    compiled, compiled_grad = _run(torch.compile(fast, fullgraph=True), qkv, heads, cotangent)
    assert_rms_close(compiled, out, 1e-6, "out")
    assert_rms_close(compiled_grad, grad, 1e-6, "dqkv")
