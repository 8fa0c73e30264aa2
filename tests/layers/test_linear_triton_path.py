"""The linear layer on its op's ``triton`` path (visattn.ops.linear.triton, interpreted on CPU tensors here):
the same outputs and gradients as its other paths, and what the cost model counts for it on CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TRITON_ON_CPU, assert_rms_close
from visattn.layers import attention_options, get_attention
from visattn.layers.cost import CostCase, MixingMemory, TokenLayout
from visattn.ops.backends import force_backend
from visattn.ops.linear.triton import CUDA_SEGMENT, triton_linear_attn

CUDA = torch.device("cuda")  # a device is only named here: nothing runs on CUDA
DIM, HEADS = 48, 3


def _outputs_and_grads(layer, x, path, cotangent):
    """The layer's output on ``path`` and the gradients of x and of every parameter."""
    xg = x.clone().requires_grad_(True)
    with force_backend("projected_linear", path):
        out = layer(xg)
    grads = torch.autograd.grad(out, [xg, *layer.parameters()], cotangent.to(out.dtype))
    return out.detach(), grads


@TRITON_ON_CPU
@pytest.mark.parametrize(
    "rope, prefix, other", [(None, 2, "packed"), (None, 0, "split"), ("axial", 1, "split")],
    ids=["p2-vs-packed", "p0-vs-split", "rope_axial-p1-vs-split"],
)
def test_forced_triton_path_matches_the_other_paths(rope, prefix, other):
    """A 7 x 5 grid, 3 heads of 16, the 3 x 3 locality term: outputs and the gradients of the input and of
    every parameter (qkv, the convolution, proj)."""
    grid = (7, 5)
    layer = get_attention("linear")(DIM, HEADS, qkv_bias=True, rope=rope)
    layer.set_grid(grid, prefix)
    x = torch.randn(2, prefix + grid[0] * grid[1], DIM)
    cotangent = torch.randn(x.shape)
    out, grads = _outputs_and_grads(layer, x, "triton", cotangent)
    expected, expected_grads = _outputs_and_grads(layer, x, other, cotangent)
    assert_rms_close(out, expected, 1e-5, "out")
    names = ["x", *(name for name, _ in layer.named_parameters())]
    for name, got, want in zip(names, grads, expected_grads):
        assert_rms_close(got, want, 1e-5, f"d{name}")


@TRITON_ON_CPU
def test_forced_triton_path_under_bf16_autocast():
    """As a GPU trains: the projection in bf16, the kernels' sums in fp32, the output in bf16."""
    grid, prefix = (5, 6), 1
    layer = get_attention("linear")(DIM, HEADS)
    layer.set_grid(grid, prefix)
    x = torch.randn(2, prefix + grid[0] * grid[1], DIM)
    cotangent = torch.randn(x.shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _outputs_and_grads(layer, x, "triton", cotangent)
    expected, expected_grads = _outputs_and_grads(layer, x, "split", cotangent)  # fp32
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), expected, 3e-2, "out")
    for got, want in zip(grads, expected_grads):
        assert_rms_close(got.float(), want, 3e-2, "grad")


@pytest.mark.parametrize("grid", [(14, 14), (64, 64)], ids=["14x14-one-segment", "64x64-five-segments"])
def test_cuda_memory_counts_the_triton_path(grid):
    """6 heads of 64, bf16, a prefix token, the 3 x 3 locality term (inside the kernels: nothing more). The
    forward holds the output, the fp32 state (4 x 64 x 65 bytes a head) and, for 4,097 tokens, a partial
    state per segment of 1,024 tokens; the backward keeps q, k, v and the state."""
    layout = TokenLayout(grid, 1)
    n, c, state = layout.num_tokens, 6 * 64, 6 * 4 * 64 * 65
    segments = -(-n // CUDA_SEGMENT)
    partials = state * segments if segments > 1 else 0
    layer = get_attention("linear")
    options = attention_options("linear", {}, grid)
    cuda = layer.mixing_memory(CostCase(layout, 6, 64, options, 2, CUDA))
    assert cuda == MixingMemory(infer=n * c * 2 + state + partials, train=3 * n * c * 2 + state)
    cpu = layer.mixing_memory(CostCase(layout, 6, 64, options, 2))
    assert cpu.infer - cuda.infer == 3 * layout.num_patches * c * 2 - state - partials  # the convolution's copies
    # learned RoPE-Mixed frequencies need a gradient: training takes another path, inference the kernels
    mixed = layer.mixing_memory(CostCase(layout, 6, 64, dict(options, rope="mixed"), 2, CUDA))
    assert mixed.infer == cuda.infer and mixed.train == cpu.train
    # the learned feature map and the decay never run on the kernels
    for extra in ({"feature_map": "learned"}, {"decay": True}):
        opts = attention_options("linear", extra, grid)
        assert layer.mixing_memory(CostCase(layout, 6, 64, opts, 2, CUDA)) == layer.mixing_memory(
            CostCase(layout, 6, 64, opts, 2)
        )


@TRITON_ON_CPU
def test_the_triton_path_keeps_the_projection_and_the_state():
    """What autograd keeps for the kernels' backward, to the byte: the projection (here a leaf, fp32) and the
    fp32 state, the train figure per image (one segment, no convolution)."""
    batch, heads, d, grid = 2, 2, 16, (4, 5)
    qkv = torch.randn(batch, 1 + grid[0] * grid[1], 3 * heads * d, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        triton_linear_attn(qkv, heads)
    options = attention_options("linear", {"dwconv_kernel": None}, grid)
    memory = get_attention("linear").mixing_memory(CostCase(TokenLayout(grid, 1), heads, d, options, 4, CUDA))
    assert sum(storages.values()) == batch * memory.train
