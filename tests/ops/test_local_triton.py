"""The local windows' fused Triton kernels (visattn.ops.local.triton) against the naive twins of neighborhood,
sparse and longformer: outputs and the gradient of the qkv projection they read q, k and v from in place,
in fp32, fp16 and bf16, on odd non-square grids with prefix tokens, windows clamped at every border, grids
smaller than a query tile, head dims 16 and 64; the same bits from run to run; results independent of the
tile shapes; a compiled graph around the op.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py); the ``cuda``
cases run them compiled, with one fixed launch configuration so that no test autotunes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import TRITON_DEVICES, TRITON_ON_CPU, assert_rms_close
from visattn import ops
from visattn.layers import get_attention
from visattn.ops import backends
from visattn.ops.backends import force_backend
from visattn.ops.layout import split_qkv
from visattn.ops.local import triton as local_triton
from visattn.ops.local.triton import TileConfig
from visattn.ops.longformer import naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.sparse import naive_sparse_attn
from visattn.ops.triton_support import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")

DEVICES = TRITON_DEVICES
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


def _ops(kind, grid, p, window):
    """(the op on its ``"triton"`` path, the naive twin), each (q, k, v) -> (B, heads, N, d)."""
    local, prefix_visible = kind, kind == "longformer"
    if prefix_visible:
        local, window = window
    size = {"kernel_size": window} if local == "neighborhood" else {"block_size": window[0], "halo": window[1]}

    def fast(q, k, v):
        if prefix_visible:
            return ops.longformer_attn(q, k, v, grid, p, local, **size, backend="triton")
        if local == "neighborhood":
            return ops.neighborhood_attn(q, k, v, grid, window, num_prefix_tokens=p, backend="triton")
        return ops.sparse_attn(q, k, v, grid, *window, num_prefix_tokens=p, backend="triton")

    def naive(q, k, v):
        if prefix_visible:
            return naive_longformer_attn(q, k, v, grid, p, local, **size)
        if local == "neighborhood":
            return naive_neighborhood_attn(q, k, v, grid, window, num_prefix_tokens=p)
        return naive_sparse_attn(q, k, v, grid, *window, num_prefix_tokens=p)

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
    fast, naive = _ops(kind, grid, p, window)
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
    fast, naive = _ops("longformer", grid, p, ("neighborhood", 3))
    q, k, v = (torch.randn(2, 2, p + 42, 16, device=device) for _ in range(3))
    assert_rms_close(fast(q, k, v), naive(q, k, v), 1e-5, "out")


@pytest.mark.parametrize("device", DEVICES)
def test_more_prefix_tokens_than_a_tile(device, monkeypatch):
    """18 global tokens in tiles of 16: two prefix key tiles, query tiles and row blocks of the prefix rows."""
    monkeypatch.setattr(local_triton, "MAX_BLOCK_P", 16)
    grid, p, heads = (5, 6), 18, 2
    fast, naive = _ops("longformer", grid, p, ("neighborhood", 3))
    qkv, cotangent = _inputs(1, heads, grid, p, 16, torch.float32, device)
    out, grad = _run(fast, qkv, heads, cotangent)
    ref, ref_grad = _run(naive, qkv.double(), heads, cotangent.double())
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 4e-5, "dqkv")


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_every_run(device):
    fast, _ = _ops("longformer", (13, 11), 2, ("sparse", (4, 2)))
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
    fast, _ = _ops("longformer", (13, 11), 2, ("sparse", (3, 1)))
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
    fast, _ = _ops("neighborhood", grid, p, 3)
    qkv, cotangent = _inputs(1, heads, grid, p, 16, torch.float32, device)
    out, grad = _run(fast, qkv, heads, cotangent)
    compiled, compiled_grad = _run(torch.compile(fast, fullgraph=True), qkv, heads, cotangent)
    assert_rms_close(compiled, out, 1e-6, "out")
    assert_rms_close(compiled_grad, grad, 1e-6, "dqkv")


def test_triton_is_chosen_on_cuda_without_dropout():
    """Where its windows leave most of the grid out; FlexAttention stays the CUDA path without Triton, and
    the CPU takes its own paths unless the kernels are forced."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for needs_grad in (False, True):
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, dense_cheaper=False) == "triton"
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, False, dense_cheaper=True) == "dense"
        assert backends.choose_local_backend(cuda, needs_grad, 0.1, False, dense_cheaper=False) == "gathered"
        assert backends.choose_local_backend(cuda, needs_grad, 0.0, True, dense_cheaper=False) == "gathered"
        assert backends.choose_local_backend(cpu, needs_grad, 0.0, False, dense_cheaper=False) != "triton"


@TRITON_ON_CPU  # the batch x heads check comes after the device's
def test_triton_refuses_dropout_and_too_many_images_and_heads():
    q, k, v = (torch.randn(1, 2, 5 * 6, 16) for _ in range(3))
    with pytest.raises(ValueError, match="backend 'triton' has no dropout, got dropout_p=0.1"):
        ops.neighborhood_attn(q, k, v, (5, 6), 3, dropout_p=0.1, backend="triton")
    q, k, v = (torch.zeros(16385, 4, 1, 16) for _ in range(3))
    with pytest.raises(ValueError, match="batch x heads must be at most 65,535 .* got 16385 x 4"):
        ops.neighborhood_attn(q, k, v, (1, 1), 3, backend="triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name,opts,p",
    [("neighborhood", {"kernel_size": 5}, 1), ("sparse", {"block_size": 4, "halo": 1}, 0),
     ("longformer", {"kernel_size": 3, "num_extra_global_tokens": 2}, 1)],
    ids=["neighborhood-p1", "sparse-p0", "longformer-extra2-p1"],
)
def test_forced_triton_runs_a_layer_like_gathered(name, opts, p, device):
    """A layer on the kernels, its q, k, v the views of its qkv projection: output and parameter gradients
    as on the gathered tiles."""
    layer = get_attention(name)(32, 2, qkv_bias=True, **opts).to(device)
    layer.set_grid((9, 7), p)
    x = torch.randn(2, p + 9 * 7, 32, device=device)
    results = {}
    for backend in ("triton", "gathered"):
        layer.zero_grad()
        with force_backend("local", backend):
            out = layer(x)
        out.square().sum().backward()
        results[backend] = (out.detach(), [param.grad.clone() for param in layer.parameters()])
    (out, grads), (ref, ref_grads) = results["triton"], results["gathered"]
    assert_rms_close(out, ref, 1e-5, f"{name}: triton vs gathered")
    for (param_name, _), g, g_ref in zip(layer.named_parameters(), grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"{name}: d{param_name}")


def compile_for_sm90() -> None:
    """Compiles each kernel for an H100/H200 (sm_90) without a GPU, bf16, head dim 64, with its first
    autotuning candidate, visible prefix keys and blocked (sparse) windows on one axis: what the
    interpreter accepts and a GPU compiler refuses (a global that is not constexpr, a dot below 16) fails
    here. Run with TRITON_INTERPRET unset, so that the kernels are Triton's JIT functions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from visattn.ops.local import triton_kernels

    flags = {"DIM": 64, "DIM_V": 64, "BLOCK_D": 64, "BLOCK_DV": 64, "ROW_BLOCK": 0, "COL_BLOCK": 8, "BLOCK_P": 16,
             "UPCAST": False, "PRECISION": "tf32", "PREFIX_VISIBLE": True}
    launches = [(name, {"QH": c.qh, "QW": c.qw, "KH": c.kh, "KW": c.kw}, c.num_warps, c.num_stages)
                for name, (c, *_) in local_triton.AUTOTUNE_CONFIGS.items()]
    launches += [("prefix_rows_kernel", {"BLOCK_N": 64, "SEGMENT": 1024, "BACKWARD": backward}, 4, 2)
                 for backward in (False, True)]
    activations = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
    for name, tiles, num_warps, num_stages in launches:
        kernel = getattr(triton_kernels, name)
        constexprs = {arg: value for arg, value in {**flags, **tiles}.items() if arg in kernel.arg_names}
        signature = {
            arg: "constexpr" if arg in constexprs else "*bf16" if arg in activations else "*fp32"
            if arg.endswith("_ptr") else "fp32" if arg in ("qk_scale", "scale") else "i32"
            for arg in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constexprs)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def test_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = "from tests.ops.test_local_triton import compile_for_sm90; compile_for_sm90()"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
