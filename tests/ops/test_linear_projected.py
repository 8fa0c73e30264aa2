"""projected_linear_attn, the linear layer's op from the qkv projection's input to the output projection's
input, against its naive twin (the projection, naive_linear_attn and the locality term as explicit sums):
outputs, and gradients of the input, the projection, the convolution and the norms, on every path, with
prefix tokens on non-square grids; what only the split path takes (rope, a q/k map, causal); the refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.helpers import TRITON_ON_CPU, assert_rms_close, cpu_paths
from visattn.ops import projected_linear_attn
from visattn.ops.backends import BACKENDS
from visattn.ops.linear import blocked
from visattn.ops.linear.naive import naive_projected_linear_attn
from visattn.ops.rope import axial_rope

# (B, heads, grid, prefix tokens, head_dim): non-square grids, with and without prefix tokens
CASES = [(2, 2, (3, 5), 0, 8), (3, 3, (4, 3), 2, 4), (1, 2, (1, 6), 1, 8)]
IDS = [f"B{b}-H{h}-grid{g[0]}x{g[1]}-p{p}-d{d}" for b, h, g, p, d in CASES]
C_IN = 12


def _inputs(b, heads, grid, p, d, kernel=3, bias=True):
    """x, qkv weight and bias, and the convolution's weight and bias (None without a ``kernel``)."""
    torch.manual_seed(b * 100 + heads * 10 + p)
    c = heads * d
    x = torch.randn(b, p + grid[0] * grid[1], C_IN)
    weight, qkv_bias = torch.randn(3 * c, C_IN) / C_IN**0.5, torch.randn(3 * c) if bias else None
    conv = (torch.randn(c, 1, kernel, kernel) / kernel, torch.randn(c)) if kernel else (None, None)
    return x, weight, qkv_bias, *conv


def _out_and_grads(fn, tensors, modules=()):
    """fn's output and the gradients of ``tensors`` (None entries skipped) and of the modules' parameters,
    under a fixed random cotangent; the output alone without autograd."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    params = [t for t in leaves if t is not None] + [p for m in modules for p in m.parameters()]
    return out.detach(), torch.autograd.grad(out, params, cotangent)


def _assert_matches(fast, naive, tensors, modules=(), differentiable=True):
    if not differentiable:
        with torch.no_grad():
            out, expected = fast(*tensors), naive(*tensors)
        assert_rms_close(out, expected, 1e-5, "out")
        return
    out, grads = _out_and_grads(fast, tensors, modules)
    expected, expected_grads = _out_and_grads(naive, tensors, modules)
    assert_rms_close(out, expected, 1e-5, "out")
    for i, (g, g_ref) in enumerate(zip(grads, expected_grads)):
        assert_rms_close(g, g_ref, 1e-5, f"grad {i}")


@pytest.fixture(params=[False, True], ids=["one-block", "small-blocks"])
def blocks(request, monkeypatch):
    """The CPU's token blocks as they come, or small enough that every case is cut into several."""
    if request.param:
        monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 64)


# the packed and triton paths have no q/k norm (their refusals are tested below)
PATHS = [
    pytest.param(
        name, norm, marks=TRITON_ON_CPU if name == "triton" else (), id=f"{name}-{'qk_norm' if norm else 'plain'}"
    )
    for name in BACKENDS["projected_linear"] for norm in (False, True) if not (norm and name in ("packed", "triton"))
]


@pytest.mark.parametrize("kernel", [3, None], ids=["conv3", "no-conv"])
@pytest.mark.parametrize("backend,qk_norm", PATHS)
@pytest.mark.parametrize("b,heads,grid,p,d", CASES, ids=IDS)
def test_every_path_matches_the_naive_twin(b, heads, grid, p, d, backend, qk_norm, kernel, blocks):
    """Outputs and the gradients of x, the qkv weight and bias, the convolution's weight and bias and the
    norms' parameters; the fused path is inference only."""
    torch.manual_seed(7)
    norms = (nn.LayerNorm(d), nn.LayerNorm(d)) if qk_norm else (None, None)
    for norm in norms:
        if norm is not None:
            nn.init.normal_(norm.weight, 1.0, 0.2)  # not the identity, so that a skipped norm shows

    def call(op, **path):
        def run(x, weight, bias, conv_weight, conv_bias):
            return op(
                x, weight, bias, heads, grid=grid, num_prefix_tokens=p, conv_weight=conv_weight, conv_bias=conv_bias,
                q_norm=norms[0], k_norm=norms[1], **path,
            )
        return run

    _assert_matches(
        call(projected_linear_attn, backend=backend), call(naive_projected_linear_attn),
        _inputs(b, heads, grid, p, d, kernel), modules=[n for n in norms if n is not None],
        differentiable=backend != "fused_qkv",
    )


@pytest.mark.parametrize("backend", cpu_paths("projected_linear"))
def test_every_path_without_a_qkv_bias_and_with_the_relu_map(backend):
    x, weight, _, conv_weight, conv_bias = _inputs(2, 2, (3, 4), 1, 8, kernel=5, bias=False)

    def call(op, **path):
        return lambda *t: op(*t[:2], None, 2, "relu", grid=(3, 4), num_prefix_tokens=1, conv_weight=t[2],
                             conv_bias=t[3], **path)

    _assert_matches(call(projected_linear_attn, backend=backend), call(naive_projected_linear_attn),
                    [x, weight, conv_weight, conv_bias], differentiable=backend != "fused_qkv")


def test_split_path_rotates_maps_q_and_k_and_runs_causal():
    """What only the split path takes: a rope table, a map of q and k (the learned feature map's shape:
    a d x d matrix per head), and causal attention (without the locality term)."""
    b, heads, grid, p, d = 2, 2, (3, 5), 1, 8
    x, weight, bias, conv_weight, conv_bias = _inputs(b, heads, grid, p, d)
    table = axial_rope(grid, d, p)
    maps = nn.ParameterList([nn.Parameter(torch.eye(d) + 0.1 * torch.randn(heads, d, d)) for _ in range(2)])

    def qk_map(q, k):
        return q @ maps[0], k @ maps[1]

    def rotated(op):
        return lambda *t: op(*t[:3], heads, rope=table, grid=grid, num_prefix_tokens=p, conv_weight=t[3],
                             conv_bias=t[4], qk_map=qk_map)

    _assert_matches(rotated(projected_linear_attn), rotated(naive_projected_linear_attn),
                    [x, weight, bias, conv_weight, conv_bias], modules=[maps])

    _assert_matches(
        lambda *t: projected_linear_attn(*t, heads, causal=True, chunk_size=4),  # chunks of the causal form
        lambda *t: naive_projected_linear_attn(*t, heads, causal=True),
        [x, weight, bias],
    )


def test_paths_are_chosen_as_the_chooser_says():
    """Without autograd the projection fuses with the mixing; with it, the packed projection, or the split
    heads with a q/k norm; rope, a q/k map and causal attention take the split heads."""
    x, weight, bias, conv_weight, conv_bias = _inputs(1, 2, (3, 4), 1, 8)
    kwargs = dict(grid=(3, 4), num_prefix_tokens=1, conv_weight=conv_weight, conv_bias=conv_bias)
    with torch.no_grad():
        expected = projected_linear_attn(x, weight, bias, 2, backend="fused_qkv", **kwargs)
        assert torch.equal(projected_linear_attn(x, weight, bias, 2, **kwargs), expected)
    weight.requires_grad_(True)
    for backend, extra in (("packed", {}), ("split", {"q_norm": nn.LayerNorm(8)})):
        expected = projected_linear_attn(x, weight, bias, 2, backend=backend, **extra, **kwargs)
        assert torch.equal(projected_linear_attn(x, weight, bias, 2, **extra, **kwargs), expected)


def test_refusals_name_the_problem():
    x, weight, bias, conv_weight, conv_bias = _inputs(1, 2, (3, 4), 1, 8)
    table = axial_rope((3, 4), 8, 1)
    conv = dict(grid=(3, 4), num_prefix_tokens=1, conv_weight=conv_weight, conv_bias=conv_bias)
    refused = [
        (dict(backend="fused_qkv", causal=True), "the 'fused_qkv' path is non-causal; causal=True needs 'split'"),
        (dict(backend="packed", rope=table), "the 'packed' path does not rotate; rope needs 'split'"),
        (dict(backend="packed", qk_map=lambda q, k: (q, k)), "feature_map='learned' needs 'split'"),
        (dict(backend="packed", k_norm=nn.LayerNorm(8)), "the 'packed' path has no q/k norm"),
        (dict(causal=True, **conv), "causal=True cannot be combined with a locality term"),
        (dict(conv_weight=conv_weight), "needs the patch grid; pass grid=\\(H, W\\)"),
        (dict(conv, grid=(4, 4)), "N=13 tokens do not match num_prefix_tokens=1 \\+ grid 4x4 = 17"),
        (dict(conv, conv_weight=conv_weight[:, :, :2, :2]), "conv_weight must be \\(C, 1, K, K\\) with C=16 and K odd"),
        (dict(conv, conv_bias=conv_bias[:3]), "conv_bias must be None or \\(16,\\)"),
        (dict(conv_bias=conv_bias), "conv_bias needs a conv_weight"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
        (dict(feature_map="softplus"), "softplus"),
        (dict(backend="triton", q_norm=nn.LayerNorm(8)), "the 'triton' path reads q and k straight from the projection"),
        (dict(backend="triton", causal=True), "the 'triton' path is non-causal"),
        (dict(backend="blocked"), "backend must be one of fused_qkv, packed, split, triton, got 'blocked'"),
    ]
    for kwargs, match in refused:
        with torch.no_grad(), pytest.raises(ValueError, match=match) as error:
            projected_linear_attn(x, weight, bias, 2, **kwargs)
        assert str(error.value).startswith(("projected_linear_attn: ", "projected_linear: ", "unknown feature_map"))
    with pytest.raises(ValueError, match="qkv_weight must be \\(3 C, C_in\\) with C_in=12"):
        projected_linear_attn(x, weight[:, :5], bias, 2)
    with pytest.raises(ValueError, match="num_heads=5 must divide C=16"):
        projected_linear_attn(x, weight, bias, 5)
