"""The Triton kernels of axial attention (visattn.ops.axial.triton) against the naive twin: outputs and the
gradients of q, k and v, read in place from strided views of a qkv projection (B, N, 3 C).

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py), in 16-query
blocks, so that a line of 19 walks two blocks with a ragged end; the cases marked cuda run the same
comparisons compiled on a GPU."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.helpers import TRITON_DEVICES, assert_rms_close
from visattn.ops.axial import packed_axial_attn
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.axial.triton import packed_triton_axial_attn, triton_axial_attn, triton_fits
from visattn.ops.backends import choose_axial_backend
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.triton_support import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")

DEVICES = TRITON_DEVICES


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    grid: tuple[int, int]
    prefix: int
    head_dim: int
    dtype: torch.dtype

    @property
    def n(self) -> int:
        return self.prefix + self.grid[0] * self.grid[1]

    @property
    def id(self) -> str:
        dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        h, w = self.grid
        return f"B{self.batch}-H{self.heads}-grid{h}x{w}-p{self.prefix}-d{self.head_dim}-{dtype}"


SHAPES = [  # odd, non-square grids: rows of 11 and 19 (two query blocks), columns of 13 and 7
    (1, 2, (13, 11), 2, 16),
    (2, 1, (7, 19), 0, 16),
    (1, 1, (7, 19), 1, 64),
]
CASES = [Case(*shape, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16) for shape in SHAPES]


def tolerance(dtype: torch.dtype, grad: bool = False) -> float:
    """RMS-relative, against the twin in fp32 on the same rounded inputs: fp32's sums in another order.
    In fp16/bf16 the roundings of what the hops store between them (the row hop's output, its gradient,
    the column hop's dq and dk) and of the result, and on a GPU of the probabilities and score gradients
    that enter the tensor cores: a few units of the dtype's eps for outputs, twice that for gradients,
    whose softmax backward takes a difference (dP - D) that loses bits."""
    if dtype == torch.float32:
        return 1e-5
    return (8 if grad else 4) * torch.finfo(dtype).eps


def projection(case: Case, device: str) -> torch.Tensor:
    """A (B, N, 3 C) qkv projection as a strided view: its rows are wider than 3 C."""
    c = case.heads * case.head_dim
    storage = torch.randn(case.batch, case.n, 3 * c + 8, device=device).to(case.dtype)
    return storage[..., : 3 * c]


def grads_of(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn(*inputs)`` and the inputs' gradients under a fixed random cotangent, on the inputs' device."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    generator = torch.Generator(out.device).manual_seed(0)
    out.backward(torch.randn(out.shape, generator=generator, device=out.device).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def naive_packed(qkv: torch.Tensor, case: Case) -> torch.Tensor:
    """The naive twin on timm's q, k, v of the projection, in fp32: (B, N, C)."""
    return merge_heads(naive_axial_attn(*split_qkv(qkv.float(), case.heads), case.grid, case.prefix))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_packed_matches_naive(case, device):
    """On the projection itself: the output (B, N, C) and the projection's gradient (B, N, 3 C)."""
    qkv = projection(case, device)
    out, (grad,) = grads_of(lambda t: packed_triton_axial_attn(t, case.heads, case.grid, case.prefix), qkv)
    ref, (ref_grad,) = grads_of(lambda t: naive_packed(t, case), qkv)
    assert out.dtype == case.dtype and grad.dtype == case.dtype
    assert out.is_contiguous() and grad.is_contiguous()
    assert_rms_close(out.float(), ref, tolerance(case.dtype), "out")
    for name, g, g_ref in zip("qkv", split_qkv(grad.float(), case.heads), split_qkv(ref_grad, case.heads)):
        assert_rms_close(g, g_ref, tolerance(case.dtype, grad=True), f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    [Case(1, 2, (13, 11), 2, 16, torch.float32), Case(2, 1, (7, 19), 1, 64, torch.bfloat16)],
    ids=lambda c: c.id,
)
def test_views_of_a_projection_match_naive(case, device):
    """On q, k, v given apart as (B, heads, N, d) views of one projection (a scale set, and an output
    gradient laid out (B, heads, N, d), not token-major): the output is token-major."""
    qkv = projection(case, device)
    q, k, v = split_qkv(qkv, case.heads)
    out, grads = grads_of(lambda q, k, v: triton_axial_attn(q, k, v, case.grid, case.prefix, scale=0.3), q, k, v)
    ref, ref_grads = grads_of(
        lambda q, k, v: naive_axial_attn(q, k, v, case.grid, case.prefix, scale=0.3), q.float(), k.float(), v.float()
    )
    assert out.transpose(1, 2).is_contiguous()
    assert_rms_close(out.float(), ref, tolerance(case.dtype), "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g.float(), g_ref, tolerance(case.dtype, grad=True), f"d{name}")


@pytest.mark.parametrize(
    "grid,prefix", [((1, 6), 1), ((6, 1), 0), ((2, 3), 3)], ids=["grid1x6-p1", "grid6x1-p0", "grid2x3-p3"]
)
@pytest.mark.parametrize("device", DEVICES)
def test_lines_of_one_and_more_prefix_than_lines(grid, prefix, device):
    """A single row or column (lines of one token), and more prefix tokens than a line has."""
    case = Case(2, 2, grid, prefix, 16, torch.float32)
    qkv = projection(case, device)
    out, (grad,) = grads_of(lambda t: packed_triton_axial_attn(t, case.heads, case.grid, case.prefix), qkv)
    ref, (ref_grad,) = grads_of(lambda t: naive_packed(t, case), qkv)
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 1e-5, "dqkv")


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    """No atomics: the same inputs give the same output and gradients bit for bit."""
    case = Case(2, 2, (7, 5), 2, 16, torch.bfloat16)
    qkv = projection(case, device)
    first = grads_of(lambda t: packed_triton_axial_attn(t, case.heads, case.grid, case.prefix), qkv)
    second = grads_of(lambda t: packed_triton_axial_attn(t, case.heads, case.grid, case.prefix), qkv)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1][0], second[1][0])


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_its_dtype(device):
    """Under autocast fp32 inputs are taken in autocast's dtype, as SDPA takes them."""
    case = Case(1, 2, (5, 4), 1, 16, torch.float32)
    qkv = projection(case, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = packed_triton_axial_attn(qkv, case.heads, case.grid, case.prefix)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), naive_packed(qkv.bfloat16(), case), tolerance(torch.bfloat16), "out")


@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_compile_matches_eager(device):
    """torch.compile(fullgraph=True) captures the op and its backward (on the CPU as an opaque op, whose
    interpreted kernels cannot be traced; on a GPU Inductor sees the kernels)."""
    torch._dynamo.reset()
    case = Case(1, 2, (5, 3), 1, 16, torch.float32)
    qkv = projection(case, device)

    def mixed(t):
        return packed_triton_axial_attn(t * 2, case.heads, case.grid, case.prefix)

    eager, (eager_grad,) = grads_of(mixed, qkv)
    compiled, (compiled_grad,) = grads_of(torch.compile(mixed, fullgraph=True), qkv)
    assert_rms_close(compiled, eager, 1e-6, "out")
    assert_rms_close(compiled_grad, eager_grad, 1e-6, "dqkv")


@pytest.mark.compile
@pytest.mark.cuda
def test_compile_with_dynamic_shapes():
    """With dynamic shapes the sizes reach the launchers as symbols; a tile size is made concrete, so each
    grid gets its kernels and both match eager."""
    torch._dynamo.reset()
    compiled = torch.compile(packed_triton_axial_attn, fullgraph=True, dynamic=True)
    for grid in ((5, 3), (6, 4)):
        case = Case(2, 2, grid, 1, 16, torch.float32)
        qkv = projection(case, "cuda")
        eager, (eager_grad,) = grads_of(lambda t: packed_triton_axial_attn(t, 2, grid, 1), qkv)
        out, (grad,) = grads_of(lambda t: compiled(t, 2, grid, 1), qkv)
        assert_rms_close(out, eager, 1e-6, f"out {grid}")
        assert_rms_close(grad, eager_grad, 1e-6, f"dqkv {grid}")


@pytest.mark.cuda
def test_op_registration():
    """torch.library's checks of the ops: schema, fake (meta) outputs against the real ones, autograd."""
    case = Case(1, 2, (5, 3), 1, 16, torch.float32)
    qkv = projection(case, "cuda").requires_grad_(True)
    torch.library.opcheck(torch.ops.visattn.packed_axial_attn_triton, (qkv, case.heads, 5, 1, 0.25))
    q, k, v = (t.detach().requires_grad_(True) for t in split_qkv(qkv, case.heads))
    torch.library.opcheck(torch.ops.visattn.axial_attn_triton, (q, k, v, 5, 1, 0.25))


@pytest.mark.cuda
def test_longest_lines_at_bf16():
    """Columns of 256 (the longest one program holds) and rows of 255, d = 64, bf16."""
    for grid in ((256, 9), (7, 255)):
        case = Case(1, 1, grid, 1, 64, torch.bfloat16)
        qkv = projection(case, "cuda")
        out, (grad,) = grads_of(lambda t: packed_triton_axial_attn(t, case.heads, case.grid, case.prefix), qkv)
        ref, (ref_grad,) = grads_of(lambda t: naive_packed(t, case), qkv)
        assert_rms_close(out.float(), ref, tolerance(case.dtype), f"out {grid}")
        assert_rms_close(grad.float(), ref_grad, tolerance(case.dtype, grad=True), f"dqkv {grid}")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise(device):
    qkv = torch.randn(1, 13, 3 * 32, device=device)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        packed_triton_axial_attn(qkv.double(), 2, (3, 4), 1)
    wide = torch.randn(1, 257, 3 * 32, device=device)
    with pytest.raises(ValueError, match="grid width 257"):
        packed_triton_axial_attn(wide, 2, (1, 257))
    q = torch.randn(1, 1, 13, 300, device=device)
    with pytest.raises(ValueError, match="head_dim 300"):
        triton_axial_attn(q, q, q, (3, 4), 1)


def test_chosen_on_cuda_without_dropout():
    """The path of choice on CUDA (with or without autograd) where the kernels fit; never on the CPU
    unless forced; never with dropout, which the kernels do not apply."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device is only named here: nothing runs on CUDA
    assert choose_axial_backend(cuda, 0.0, needs_grad=True) == "triton"
    assert choose_axial_backend(cuda, 0.0, needs_grad=False) == "triton"
    assert choose_axial_backend(cuda, 0.1, needs_grad=True) == "sdpa"
    assert choose_axial_backend(cuda, 0.0, needs_grad=True, triton_fits=False) == "sdpa"
    assert choose_axial_backend(cpu, 0.0, needs_grad=True) == "cpu_kernels"
    assert choose_axial_backend(cpu, 0.0, needs_grad=False) == "sdpa"
    assert not triton_fits((257, 3), 1, 64) and triton_fits((256, 256), 1, 64)
    qkv = torch.randn(1, 13, 3 * 16)
    with pytest.raises(ValueError, match="'triton' has no dropout"):
        packed_axial_attn(qkv, 1, (3, 4), 1, dropout_p=0.1, backend="triton")
