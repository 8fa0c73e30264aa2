"""Every registered attention layer on a GPU under bf16 autocast, as training runs it, against the same
layer in fp64 on the CPU: its output, the input's gradient and the parameters' gradients, batch 2, on an
odd, non-square grid with prefix tokens. Each layer takes the path it chooses on a GPU in training (the
local types: FlexAttention), so this checks the layers' own CUDA code (projections, the linear layer's
depthwise convolution and decay, the Linformer projections) around the ops of ``tests/ops/test_cuda.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import assert_rms_close
from visattn.layers import get_attention, list_attentions

pytestmark = pytest.mark.cuda

GRID = (13, 11)
PREFIX = 2
DIM, HEADS = 64, 2

OPTIONS = {
    "linformer": {"k": 16, "ref_grid": (7, 5)},
    "neighborhood": {"kernel_size": 5, "tile_size": 4},
    "sparse": {"block_size": 4, "halo": 1},
    "longformer": {"kernel_size": 5, "tile_size": 4},
}
CASES = [(name, OPTIONS.get(name, {})) for name in list_attentions()] + [("linear", {"decay": True})]
IDS = [name + ("-decay" if opts.get("decay") else "") for name, opts in CASES]

# bf16 autocast rounds to 8 significant bits (u = 2^-8): the attention op's output is within 8 u
# (tests/ops/test_cuda.py); around it the input, the two weight matrices and the two projections' outputs
# are each rounded once more, 5 u: 16 u for the output. Gradients pass through as many roundings again in
# the backward: 4 x that. A parameter's gradient sums a term from every token, so all of them are compared
# as one vector, against its RMS.
OUT_TOL, GRAD_TOL = 16 * 2**-8, 64 * 2**-8


def _run(layer, x, cotangent):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    out.backward(cotangent.to(out.dtype))
    params = torch.cat([p.grad.double().flatten() for p in layer.parameters() if p.grad is not None])
    return out.detach(), x.grad, params


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, options", CASES, ids=IDS)
def test_layer_on_cuda_in_bf16_matches_fp64(name, options):
    torch.manual_seed(0)
    reference = get_attention(name)(DIM, HEADS, **options).double().train()
    reference.set_grid(GRID, PREFIX)
    layer = copy.deepcopy(reference).float().cuda()
    x = torch.randn(2, PREFIX + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    cotangent = torch.randn(x.shape, dtype=torch.float64)
    expected, expected_dx, expected_params = _run(reference, x, cotangent)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, dx, params = _run(layer, x.float().cuda(), cotangent.cuda())
    assert out.is_cuda
    assert_rms_close(out.cpu(), expected, OUT_TOL, "out")
    assert_rms_close(dx.cpu(), expected_dx, GRAD_TOL, "dx")
    assert_rms_close(params.cpu(), expected_params, GRAD_TOL, "parameter gradients")
