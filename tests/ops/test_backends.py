"""Every path of every op with several, forced on CPU tensors (the paths other devices or a compiled graph
take included), against the naive twins: outputs, and gradients where the path is differentiable
(``decayed_linear``'s two paths are in tests/ops/test_linear_decay.py).
Also the choice itself: its defaults on each device, how to force it, its log line and its refusals."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from tests.helpers import TRITON_ON_CPU, assert_rms_close, cpu_paths, grads_of
from visattn import ops
from visattn.layers import get_attention
from visattn.ops import backends, local
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.local import engine
from visattn.ops.backends import BACKENDS, force_backend
from visattn.ops.linear.blocked import token_blocks
from visattn.ops.longformer import naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.sparse import naive_sparse_attn

# (B, heads, grid, prefix tokens, head_dim): batch 1, an odd and an even batch, non-square grids, with
# and without prefix tokens
CASES = [(1, 2, (5, 3), 0, 8), (3, 2, (4, 7), 2, 8), (4, 3, (6, 5), 1, 16)]
IDS = [f"B{b}-H{h}-grid{g[0]}x{g[1]}-p{p}-d{d}" for b, h, g, p, d in CASES]


def _qkv(b, heads, grid, p, d):
    return [torch.randn(b, heads, p + grid[0] * grid[1], d) for _ in range(3)]


def _assert_matches(fn, reference, inputs, differentiable, tol=1e-5):
    expected, expected_grads = grads_of(reference, *inputs)
    if differentiable:
        out, grads = grads_of(fn, *inputs)
        for name, g, g_ref in zip("qkv", grads, expected_grads):
            assert_rms_close(g, g_ref, tol, f"d{name}")
    else:
        with torch.no_grad():
            out = fn(*inputs)
    assert_rms_close(out, expected, tol, "out")


@pytest.mark.parametrize("backend", BACKENDS["linear"])
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_linear_paths_match_naive(b, heads, grid, p, d, backend):
    causal = backend == "chunk"
    _assert_matches(
        lambda q, k, v: ops.linear_attn(q, k, v, causal=causal, chunk_size=5, backend=backend),
        lambda q, k, v: naive_linear_attn(q, k, v, causal=causal),
        _qkv(b, heads, grid, p, d),
        differentiable=True,
    )


@pytest.mark.parametrize("backend", cpu_paths("axial"))
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_axial_paths_match_naive(b, heads, grid, p, d, backend):
    _assert_matches(
        lambda q, k, v: ops.axial_attn(q, k, v, grid, p, backend=backend),
        lambda q, k, v: naive_axial_attn(q, k, v, grid, p),
        _qkv(b, heads, grid, p, d),
        differentiable=True,
    )


@pytest.mark.parametrize("backend", cpu_paths("axial"))
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_packed_axial_paths_match_naive(b, heads, grid, p, d, backend):
    def naive(qkv):
        q, k, v = qkv.unflatten(-1, (3, heads, d)).permute(2, 0, 3, 1, 4).unbind(0)  # timm's layout
        return naive_axial_attn(q, k, v, grid, p).transpose(1, 2).flatten(2)

    qkv = torch.randn(b, p + grid[0] * grid[1], 3 * heads * d)
    out, (grad,) = grads_of(lambda t: ops.packed_axial_attn(t, heads, grid, p, backend=backend), qkv)
    expected, (expected_grad,) = grads_of(naive, qkv)
    assert_rms_close(out, expected, 1e-5, "out")
    assert_rms_close(grad, expected_grad, 1e-5, "dqkv")


LOCAL_OPS = {
    "neighborhood": (
        lambda q, k, v, grid, p, backend: ops.neighborhood_attn(
            q, k, v, grid, 3, num_prefix_tokens=p, tile_size=2, backend=backend
        ),
        lambda q, k, v, grid, p: naive_neighborhood_attn(q, k, v, grid, 3, num_prefix_tokens=p),
    ),
    "sparse": (
        lambda q, k, v, grid, p, backend: ops.sparse_attn(q, k, v, grid, 2, 1, num_prefix_tokens=p, backend=backend),
        lambda q, k, v, grid, p: naive_sparse_attn(q, k, v, grid, 2, 1, num_prefix_tokens=p),
    ),
    "longformer": (
        lambda q, k, v, grid, p, backend: ops.longformer_attn(q, k, v, grid, p, kernel_size=3, tile_size=2, backend=backend),
        lambda q, k, v, grid, p: naive_longformer_attn(q, k, v, grid, p, kernel_size=3),
    ),
}


@pytest.mark.parametrize("backend", cpu_paths("local"))
@pytest.mark.parametrize("op", sorted(LOCAL_OPS))
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_local_paths_match_naive(b, heads, grid, p, d, op, backend):
    fast, naive = LOCAL_OPS[op]
    q, k, v = _qkv(b, heads, grid, p, d)
    _assert_matches(
        lambda q, k, v: fast(q, k, v, grid, p, backend),
        lambda q, k, v: naive(q, k, v, grid, p),
        [q, k, v],
        differentiable=backend not in ("chunked", "flex"),  # FlexAttention has no backward on the CPU
    )


def _linear_layer_expected(layer, x, grid, p):
    """The linear layer spelled out on the naive twin: qkv, naive linear attention, the depthwise
    convolution of the patch values added to the patch outputs, proj."""
    b, n, c = x.shape
    q, k, v = layer.qkv(x).reshape(b, n, 3, layer.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = layer.q_norm(q), layer.k_norm(k)
    mixed = naive_linear_attn(q, k, v).transpose(1, 2).reshape(b, n, c)
    v_img = v[:, :, p:].transpose(2, 3).reshape(b, c, *grid)  # (B, heads * d, H, W)
    local = layer.dwconv(v_img).flatten(2).transpose(1, 2)  # (B, H * W, C)
    return layer.proj(torch.cat([mixed[:, :p], mixed[:, p:] + local], dim=1))


# the packed and triton paths have no q/k norm (the refusals are tested in test_linear_projected.py)
PROJECTION_PATHS = [
    pytest.param(
        name, norm, marks=TRITON_ON_CPU if name == "triton" else (), id=f"{name}-{'qk_norm' if norm else 'plain'}"
    )
    for name in BACKENDS["projected_linear"] for norm in (False, True) if not (norm and name in ("packed", "triton"))
]


@pytest.mark.parametrize("backend,qk_norm", PROJECTION_PATHS)
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_linear_layer_projection_paths_match_naive(b, heads, grid, p, d, backend, qk_norm):
    layer = get_attention("linear")(heads * d, heads, qk_norm=qk_norm, norm_layer=nn.LayerNorm if qk_norm else None)
    layer.set_grid(grid, p)
    x = torch.randn(b, p + grid[0] * grid[1], heads * d)
    params = list(layer.parameters())
    expected = _linear_layer_expected(layer, x, grid, p)
    expected_grads = torch.autograd.grad(expected.square().sum(), params)
    with force_backend("projected_linear", backend):
        if backend == "fused_qkv":  # inference only
            with torch.no_grad():
                assert_rms_close(layer(x), expected, 1e-5, "out")
            return
        out = layer(x)
        grads = torch.autograd.grad(out.square().sum(), params)
    assert_rms_close(out, expected, 1e-5, "out")
    for (name, _), g, g_ref in zip(layer.named_parameters(), grads, expected_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.fixture
def debug_log(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_logged", set())  # every choice is logged afresh
    caplog.set_level(logging.DEBUG, logger="visattn.ops.backends")
    return caplog


def test_choices_are_named_and_logged(debug_log):
    q, k, v = _qkv(1, 2, (3, 4), 1, 8)
    with torch.no_grad():
        ops.axial_attn(q, k, v, (3, 4), 1)
        ops.longformer_attn(q, k, v, (3, 4), 1, kernel_size=3)  # the windows cover the grid: dense
        ops.longformer_attn(*_qkv(1, 2, (12, 12), 1, 8), (12, 12), 1, kernel_size=3, tile_size=2)
    ops.linear_attn(q, k, v)
    ops.linear_attn(q, k, v, causal=True)
    ops.axial_attn(*(t.requires_grad_(True) for t in (q, k, v)), (3, 4), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops.axial_attn(q, k, v, (3, 4), 1)
    assert debug_log.messages == [
        "axial: sdpa backend (chosen)",
        "local: dense backend (chosen)",
        "local: chunked backend (chosen)",
        "linear: blocked backend (chosen)",
        "linear: chunk backend (chosen)",
        "axial: cpu_kernels backend (chosen)",
        "axial: sdpa_checkpoint backend (chosen)",
    ]
    ops.linear_attn(q, k, v)  # a choice already made is not logged again
    assert len(debug_log.messages) == 7


def test_layer_paths_are_chosen_by_name(debug_log):
    layer = get_attention("linear")(16, 2)
    layer.set_grid((3, 4), 1)
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        layer(x)
    layer(x)
    layer.q_norm = nn.LayerNorm(8)
    layer(x)
    projection = [m for m in debug_log.messages if m.startswith("projected_linear")]
    assert projection == [
        "projected_linear: fused_qkv backend (chosen)",
        "projected_linear: packed backend (chosen)",
        "projected_linear: split backend (chosen)",
    ]


def test_force_backend_and_the_argument(debug_log):
    q, k, v = _qkv(1, 2, (3, 4), 0, 8)
    with force_backend("linear", "plain"):
        forced = ops.linear_attn(q, k, v)
        requested = ops.linear_attn(q, k, v, backend="blocked")  # the argument wins
    assert "linear: plain backend (forced)" in debug_log.messages
    assert "linear: blocked backend (requested)" in debug_log.messages
    assert backends._forced == {}
    assert_rms_close(forced, requested, 1e-5, "plain vs blocked")
    with force_backend("axial", "sdpa"), force_backend("axial", "sdpa_checkpoint"):
        assert backends._forced == {"axial": "sdpa_checkpoint"}
    assert backends._forced == {}


def test_bad_backends_raise():
    q, k, v = _qkv(1, 2, (3, 4), 0, 8)
    with pytest.raises(ValueError, match="backend must be one of blocked, plain, plain_checkpoint, chunk, got 'fast'"):
        ops.linear_attn(q, k, v, backend="fast")
    with pytest.raises(ValueError, match="op must be one of"):
        with force_backend("softmax", "sdpa"):
            pass
    with pytest.raises(ValueError, match="causal=True needs chunk"):
        ops.linear_attn(q, k, v, causal=True, backend="blocked")
    with pytest.raises(ValueError, match="causal=False needs blocked, plain or plain_checkpoint"):
        ops.linear_attn(q, k, v, backend="chunk")
    with pytest.raises(ValueError, match="'cpu_kernels' needs a CPU tensor, dropout_p=0"):
        ops.axial_attn(q, k, v, (3, 4), dropout_p=0.1, backend="cpu_kernels")
    with pytest.raises(ValueError, match="'chunked' has no autograd"):
        ops.sparse_attn(*(t.detach().requires_grad_(True) for t in (q, k, v)), (3, 4), 2, 1, backend="chunked")
    layer = get_attention("linear")(16, 2, qk_norm=True, norm_layer=nn.LayerNorm, dwconv_kernel=None)
    with force_backend("projected_linear", "packed"), pytest.raises(ValueError, match="no q/k norm"):
        layer(torch.randn(1, 5, 16))
    with force_backend("projected_linear", "fused_qkv"), pytest.raises(ValueError, match="causal=True needs 'split'"):
        layer(torch.randn(1, 5, 16), is_causal=True)


def test_each_device_gets_its_path():
    """Off the CPU (the meta device stands for any other) each op takes the path that suits it
    there: plain batched matmuls for linear attention, SDPA's own autograd for axial, all tiles in one
    batched SDPA for the local ops; the cache-blocked paths run on the CPU only. The tests above run
    every one of these paths, forced, on CPU tensors."""
    cpu, other = torch.device("cpu"), torch.device("meta")
    assert backends.choose_linear_backend(cpu, causal=False) == "blocked"
    assert backends.choose_linear_backend(other, causal=False) == "plain"
    assert backends.choose_linear_backend(other, causal=True) == "chunk"
    # training off the CPU: the plain matmuls recomputed in the backward; on the CPU never
    assert backends.choose_linear_backend(other, causal=False, needs_grad=True) == "plain_checkpoint"
    assert backends.choose_linear_backend(other, causal=True, needs_grad=True) == "chunk"
    assert backends.choose_linear_backend(cpu, causal=False, needs_grad=True) == "blocked"
    assert backends.choose_linear_backend(cpu, causal=False, rope_needs_grad=True, needs_grad=True) == "plain"
    with torch.no_grad():
        assert backends.choose_projected_linear_backend(cpu, False, has_qk_norm=False) == "fused_qkv"
        assert backends.choose_projected_linear_backend(other, False, has_qk_norm=False) == "split"
    assert backends.choose_projected_linear_backend(cpu, False, has_qk_norm=False) == "packed"
    assert backends.choose_projected_linear_backend(other, False, has_qk_norm=False) == "split"
    assert backends.choose_axial_backend(cpu, 0.0, needs_grad=True) == "cpu_kernels"
    assert backends.choose_axial_backend(cpu, 0.1, needs_grad=True) == "sdpa_checkpoint"
    assert backends.choose_axial_backend(other, 0.0, needs_grad=True) == "sdpa"
    for needs_grad in (False, True):
        expected = "gathered" if needs_grad else "chunked"
        assert backends.choose_local_backend(cpu, needs_grad, 0.0, False, dense_cheaper=False) == expected
        assert backends.choose_local_backend(other, needs_grad, 0.0, False, dense_cheaper=False) == "gathered"
        for t in (cpu, other):
            assert backends.choose_local_backend(t, needs_grad, 0.0, False, dense_cheaper=True) == "dense"
            assert backends.choose_local_backend(t, needs_grad, 0.0, True, dense_cheaper=True) == "gathered"
    # the blocked linear op, forced off the CPU, takes all tokens of all images in one block
    assert len(token_blocks(16, 1025, 6 * 65, other)) == 1
    assert len(token_blocks(16, 1025, 6 * 65, cpu)) > 1


def test_local_ops_go_dense_where_the_windows_cover_the_grid():
    """A 7 x 7 window on 14 x 14 patches: every 8 x 8 tile reads the whole grid, so dense attention
    with the windows as a mask is chosen; on 32 x 32 patches the tiles read a quarter of it, so the
    tiles run."""
    cpu = torch.device("cpu")
    small, large = (local.neighborhood_axis(n, 7, 8, cpu) for n in (14, 32))
    assert engine.dense_is_cheaper(small, small, 1, prefix_visible=False)
    assert not engine.dense_is_cheaper(large, large, 1, prefix_visible=False)
