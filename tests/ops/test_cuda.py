"""Every op on a GPU, on every path it can take there, against its naive twin: outputs and the gradients
of q, k and v (outputs alone for a path taken only without autograd), in fp32 (batch 1) and bf16
(batch 3), on an odd, non-square grid with prefix tokens.

The twin runs in fp64 on the same GPU, fed the same rounded inputs. The local ops' chosen path, their
Triton kernels (FlexAttention's kernel where Triton is missing, compiled per shape), runs in bf16 here and
in every dtype in ``tests/ops/test_local_triton.py`` (FlexAttention's in ``tests/ops/local/test_flex.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import assert_rms_close
from visattn import ops
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.naive_decay import naive_decayed_linear_attn
from visattn.ops.linear.plain import KV_CHUNK
from visattn.ops.linformer import naive_linformer_attn, resample_projection
from visattn.ops.longformer import naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.softmax import naive_softmax_attn
from visattn.ops.sparse import naive_sparse_attn

pytestmark = pytest.mark.cuda

GRID = (13, 11)  # odd and non-square: 143 patch tokens
PREFIX = 2
HEADS, HEAD_DIM = 2, 32

# bf16 keeps 8 significant bits (unit roundoff u = 2^-8). An output passes through at most four roundings
# to bf16 (inputs, scores or features, probabilities or sums, the output; the sums accumulate in fp32),
# each within u, and a score error of u |s| moves its probability by as much, with |s| of a few units for
# unit-normal inputs: 8 u for outputs. Gradients pass through as many roundings again in the backward:
# 4 x that. fp32: 1e-5, the tolerance of every fp32 comparison in the suite; gradients 4 x.
TOLERANCES = {torch.float32: (1e-5, 4e-5), torch.bfloat16: (8 * 2**-8, 32 * 2**-8)}
BATCH = {torch.float32: 1, torch.bfloat16: 3}


@dataclass(frozen=True)
class OpCase:
    name: str
    fast: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    naive: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    grad: bool = True  # False: the output alone, computed without autograd (paths taken only then)
    tokens: int | None = None  # N of an op that reads no grid, if not the grid's


def _gamma() -> torch.Tensor:
    return torch.tensor([0.7, 0.95], dtype=torch.float64, device="cuda")


def _projections() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ref = (7, 5)
    return tuple(resample_projection(torch.rand(16, *ref, generator=gen) / 35, ref, GRID).cuda() for _ in range(2))


P = PREFIX
LOCAL = [
    ("neighborhood", lambda b: lambda q, k, v: ops.neighborhood_attn(q, k, v, GRID, 5, num_prefix_tokens=P, tile_size=4, backend=b),
     lambda q, k, v: naive_neighborhood_attn(q, k, v, GRID, 5, num_prefix_tokens=P)),
    ("sparse", lambda b: lambda q, k, v: ops.sparse_attn(q, k, v, GRID, 4, 1, num_prefix_tokens=P, backend=b),
     lambda q, k, v: naive_sparse_attn(q, k, v, GRID, 4, 1, num_prefix_tokens=P)),
    ("longformer", lambda b: lambda q, k, v: ops.longformer_attn(q, k, v, GRID, P, kernel_size=5, tile_size=4, backend=b),
     lambda q, k, v: naive_longformer_attn(q, k, v, GRID, P, kernel_size=5)),
]


def _cases() -> list[OpCase]:
    cases = [
        OpCase("softmax", lambda q, k, v: ops.softmax_attn(q, k, v), lambda q, k, v: naive_softmax_attn(q, k, v)),
        OpCase("softmax-causal", lambda q, k, v: ops.softmax_attn(q, k, v, is_causal=True),
               lambda q, k, v: naive_softmax_attn(q, k, v, is_causal=True)),
        OpCase("linear-chunk-causal", lambda q, k, v: ops.linear_attn(q, k, v, causal=True, chunk_size=40, backend="chunk"),
               lambda q, k, v: naive_linear_attn(q, k, v, causal=True)),
        OpCase("linformer", lambda q, k, v: ops.linformer_attn(q, k, v, *_projections(), num_prefix_tokens=P),
               lambda q, k, v: naive_linformer_attn(q, k, v, *(t.double() for t in _projections()), num_prefix_tokens=P)),
    ]
    for backend in (None, "plain", "plain_checkpoint"):
        cases.append(OpCase(f"linear-{backend or 'chosen'}", lambda q, k, v, b=backend: ops.linear_attn(q, k, v, backend=b),
                            lambda q, k, v: naive_linear_attn(q, k, v)))
    for tokens in (None, 2 * KV_CHUNK + 37):  # a tail only; whole chunks and a tail
        cases.append(OpCase(f"linear-plain-inference-N{tokens or 'grid'}", lambda q, k, v: ops.linear_attn(q, k, v, backend="plain"),
                            lambda q, k, v: naive_linear_attn(q, k, v), dtypes=(torch.bfloat16,), grad=False, tokens=tokens))
    for backend in (None, "rerun", "autograd"):
        cases.append(OpCase(
            f"decayed_linear-{backend or 'chosen'}",
            lambda q, k, v, b=backend: ops.decayed_linear_attn(q, k, v, _gamma().float(), GRID, P, tile_size=4, backend=b),
            lambda q, k, v: naive_decayed_linear_attn(q, k, v, _gamma(), GRID, P),
        ))
    for backend in (None, "sdpa", "sdpa_checkpoint"):
        cases.append(OpCase(f"axial-{backend or 'chosen'}", lambda q, k, v, b=backend: ops.axial_attn(q, k, v, GRID, P, backend=b),
                            lambda q, k, v: naive_axial_attn(q, k, v, GRID, P)))
    for name, fast, naive in LOCAL:
        for backend in ("gathered", "dense"):
            cases.append(OpCase(f"{name}-{backend}", fast(backend), naive))
        # chosen on a GPU under autograd: the Triton kernels, or FlexAttention (compiled per shape, hence one dtype here)
        cases.append(OpCase(f"{name}-chosen", fast(None), naive, dtypes=(torch.bfloat16,)))
    return cases


CASES = _cases()
PARAMS = [pytest.param(case, dtype, id=f"{case.name}-{str(dtype)[6:]}") for case in CASES for dtype in case.dtypes]


def _run(fn, inputs, cotangent, grad=True):
    if not grad:
        with torch.no_grad():
            return fn(*inputs), []
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(cotangent.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case, dtype", PARAMS)
def test_op_on_cuda_matches_its_naive_twin(case, dtype):
    n = case.tokens or PREFIX + GRID[0] * GRID[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(BATCH[dtype], HEADS, n, HEAD_DIM, device="cuda", generator=gen).to(dtype) for _ in range(3))
    cotangent = torch.randn(q.shape, device="cuda", generator=gen, dtype=torch.float64)
    expected, expected_grads = _run(case.naive, [t.double() for t in (q, k, v)], cotangent)
    out, grads = _run(case.fast, [q, k, v], cotangent, case.grad)
    assert out.dtype == dtype and out.is_cuda
    out_tol, grad_tol = TOLERANCES[dtype]
    assert_rms_close(out, expected, out_tol, "out")
    for name, g, g_ref in zip("qkv", grads, expected_grads if case.grad else []):
        assert_rms_close(g, g_ref, grad_tol, f"d{name}")
