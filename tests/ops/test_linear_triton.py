"""The Triton kernels of non-causal linear attention (visattn.ops.linear.triton) against the naive twin plus
the locality convolution computed with torch: outputs and gradients (qkv, conv weight and bias).

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py); the cases
marked cuda run the same comparisons compiled on a GPU."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TRITON_DEVICES, TRITON_ON_CPU, assert_rms_close
from visattn.ops.layout import image_to_tokens, merge_heads, split_prefix, split_qkv, tokens_to_image
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.plain import plain_linear_attn
from visattn.ops import backends
from visattn.ops.backends import choose_projected_linear_backend
from visattn.ops.linear.triton import triton_linear_attn, triton_refusal
from visattn.ops.rope import axial_rope, init_mixed_rope_freqs, mixed_rope
from visattn.ops.triton_support import HAS_TRITON

DEVICES = TRITON_DEVICES


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    grid: tuple[int, int]
    prefix: int
    head_dim: int
    dtype: torch.dtype
    kernel: int | None = 3  # the locality convolution's K, or None
    feature_map: str = "elu"
    rope: str | None = None  # "axial" (one table), "mixed" (a table per head) or None
    layout: str = "padded"  # the qkv view: "padded" (rows wider than 3 C) or "batch_inner" (tokens outermost)

    @property
    def n(self) -> int:
        return self.prefix + self.grid[0] * self.grid[1]

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")
        parts = [f"B{self.batch}-H{self.heads}-grid{self.grid[0]}x{self.grid[1]}-p{self.prefix}-d{self.head_dim}", dtype]
        parts += [f"k{self.kernel}" if self.kernel else "noconv", self.feature_map]
        return "-".join(parts + ([f"rope_{self.rope}"] if self.rope else []) + [self.layout])


CASES = [
    Case(2, 3, (13, 11), 2, 16, torch.float32),
    Case(2, 3, (13, 11), 2, 16, torch.float16, layout="batch_inner"),
    Case(2, 3, (13, 11), 2, 16, torch.bfloat16, feature_map="relu"),
    Case(1, 2, (13, 11), 2, 64, torch.float32, layout="batch_inner"),
    Case(1, 2, (13, 11), 2, 64, torch.bfloat16),
    Case(1, 1, (33, 33), 1, 16, torch.float32, kernel=5),  # N = 1,090: many segments, a ragged last block
    Case(2, 2, (7, 5), 0, 24, torch.float16, kernel=None),  # a head padded to 32 columns, no prefix
    Case(1, 3, (9, 7), 1, 32, torch.float32, kernel=1, feature_map="relu"),
    Case(2, 3, (13, 11), 2, 16, torch.float32, rope="axial"),
    Case(1, 2, (13, 11), 2, 64, torch.bfloat16, rope="mixed", layout="batch_inner"),
]


def tolerance(dtype: torch.dtype) -> float:
    """RMS-relative: fp32's sums in another order (and TF32 products on a GPU for 16-bit inputs), then the
    rounding of the result to the input's dtype."""
    return max(2e-5, 4 * torch.finfo(dtype).eps)


def make_inputs(case: Case, device: str, scale: float = 1.0):
    """(storage, qkv view of it, conv weight, conv bias, rope table): qkv a strided (B, N, 3 C) view."""
    c = case.heads * case.head_dim
    if case.layout == "padded":
        storage = torch.randn(case.batch, case.n, 3 * c + 8, device=device) * scale
    else:
        storage = (torch.randn(case.n, case.batch, 3 * c, device=device) * scale).transpose(0, 1)
    storage = storage.to(case.dtype)
    weight = bias = None
    if case.kernel:
        weight = torch.randn(c, 1, case.kernel, case.kernel, device=device) / case.kernel
        bias = torch.randn(c, device=device)
    rope = None
    if case.rope == "axial":
        rope = axial_rope(case.grid, case.head_dim, case.prefix, device=device)
    elif case.rope == "mixed":
        rope = mixed_rope(init_mixed_rope_freqs(case.head_dim, case.heads, device=device), case.grid, case.prefix)
    return storage, weight, bias, rope


def qkv_view(storage: torch.Tensor, case: Case) -> torch.Tensor:
    return storage[..., 4 : 4 + 3 * case.heads * case.head_dim] if case.layout == "padded" else storage


def kernel_output(storage, weight, bias, rope, case: Case) -> torch.Tensor:
    return triton_linear_attn(
        qkv_view(storage, case), case.heads, case.feature_map, conv_weight=weight, conv_bias=bias,
        grid=case.grid, num_prefix_tokens=case.prefix, rope=rope,
    )


def reference_output(storage, weight, bias, rope, case: Case, twin=naive_linear_attn) -> torch.Tensor:
    """The naive twin (or ``twin``) on the fp32 values, heads merged, plus the convolution of the patch values
    (torch)."""
    q, k, v = split_qkv(qkv_view(storage, case).float(), case.heads)
    out = merge_heads(twin(q, k, v, case.feature_map, rope=rope))
    if weight is None:
        return out
    prefix_out, patch_out = split_prefix(out, case.prefix, dim=1)
    _, patch_values = split_prefix(merge_heads(v), case.prefix, dim=1)
    image = tokens_to_image(patch_values, case.grid)
    conv = F.conv2d(image, weight, bias, padding=case.kernel // 2, groups=image.shape[1])
    return torch.cat([prefix_out, patch_out + image_to_tokens(conv)], dim=1)


def outputs_and_grads(fn, inputs, cotangent, dtype=None):
    """fn's output and the gradients of the tensor inputs (None stays None), from leaf copies (cast to dtype)."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(cotangent.to(out.dtype))
    return out.detach(), [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_naive_twin(case, device):
    storage, weight, bias, rope = make_inputs(case, device)
    cotangent = torch.randn(case.batch, case.n, case.heads * case.head_dim, device=device).to(case.dtype)
    out, grads = outputs_and_grads(lambda s, w, b: kernel_output(s, w, b, rope, case), (storage, weight, bias), cotangent)
    ref, ref_grads = outputs_and_grads(
        lambda s, w, b: reference_output(s, w, b, rope, case), (storage, weight, bias), cotangent, torch.float32
    )
    tol = tolerance(case.dtype)
    assert out.dtype == case.dtype
    assert_rms_close(out.float(), ref, tol, "out")
    grad_qkv, ref_grad_qkv = qkv_view(grads[0], case), qkv_view(ref_grads[0], case)
    for name, got, expected in zip("qkv", grad_qkv.float().chunk(3, dim=-1), ref_grad_qkv.chunk(3, dim=-1)):
        assert_rms_close(got, expected, tol, f"d{name}")
    if case.layout == "padded":  # the columns outside the view get no gradient
        assert torch.count_nonzero(grads[0][..., :4]) == 0 and torch.count_nonzero(grads[0][..., -4:]) == 0
    if case.kernel:
        assert_rms_close(grads[1], ref_grads[1], tol, "conv weight")
        assert_rms_close(grads[2], ref_grads[2], tol, "conv bias")


DETERMINISM_CASE = Case(2, 2, (13, 11), 2, 16, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_same_input_same_bits(device):
    """Outputs and all gradients bit for bit the same from run to run (no atomics; segments summed in order)."""
    case = DETERMINISM_CASE
    storage, weight, bias, rope = make_inputs(case, device)
    cotangent = torch.randn(case.batch, case.n, case.heads * case.head_dim, device=device)
    run = lambda: outputs_and_grads(lambda s, w, b: kernel_output(s, w, b, rope, case), (storage, weight, bias), cotangent)  # noqa: E731
    (out, grads), (again, grads_again) = run(), run()
    assert torch.equal(out, again)
    for got, expected in zip(grads, grads_again):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_sums_in_fp32(device):
    """fp16 inputs whose sums over tokens overflow fp16 (S reaches about 1,090 x 30 x 30 = 1e6 > 65,504):
    the output and gradients stay finite and match the fp32 reference."""
    case = Case(1, 1, (33, 33), 1, 16, torch.float16, kernel=None)
    storage, _, _, _ = make_inputs(case, device)
    storage = (storage.float().abs() * 30).to(torch.float16)  # phi(k) = k + 1 and v all large
    _, k, v = split_qkv(qkv_view(storage, case).float(), 1)
    assert ((k + 1).transpose(-2, -1) @ v).amax() > 65504  # S = phi(k)^T v, k > 0
    cotangent = torch.randn(case.batch, case.n, case.head_dim, device=device)
    out, grads = outputs_and_grads(lambda s: kernel_output(s, None, None, None, case), (storage,), cotangent)
    ref, ref_grads = outputs_and_grads(lambda s: reference_output(s, None, None, None, case), (storage,), cotangent, torch.float32)
    assert_rms_close(out.float(), ref, tolerance(torch.float16), "out")
    assert_rms_close(qkv_view(grads[0], case).float(), qkv_view(ref_grads[0], case), tolerance(torch.float16), "dqkv")


@pytest.mark.cuda
def test_fp16_at_65536_tokens_is_finite():
    """A 256 x 256 grid, 6 heads of 64, fp16: the sums over 65,536 tokens overflow fp16, not the kernels."""
    case = Case(1, 6, (256, 256), 0, 64, torch.float16)
    storage, weight, bias, _ = make_inputs(case, "cuda")
    qkv = qkv_view(storage, case)
    out = triton_linear_attn(qkv, case.heads, conv_weight=weight, conv_bias=bias, grid=case.grid)
    assert torch.isfinite(out).all()
    # the plain fp32 matmuls (checked against the naive twin in test_linear.py): its N x N matrices would take 100 GiB
    expected = reference_output(storage, weight, bias, None, case, twin=plain_linear_attn)
    assert_rms_close(out.float(), expected, tolerance(torch.float16), "out at N=65536")


@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_compile_matches_eager(device):
    """torch.compile(fullgraph=True) captures the op and its backward (on the CPU as an opaque op, whose
    interpreted kernels cannot be traced; on a GPU Inductor sees the kernels)."""
    torch._dynamo.reset()
    case = Case(1, 2, (7, 5), 1, 16, torch.float32)
    storage, weight, bias, rope = make_inputs(case, device)
    cotangent = torch.randn(case.batch, case.n, case.heads * case.head_dim, device=device)
    eager = outputs_and_grads(lambda s, w, b: kernel_output(s, w, b, rope, case), (storage, weight, bias), cotangent)
    compiled_fn = torch.compile(lambda s, w, b: kernel_output(s, w, b, rope, case) * 2, fullgraph=True)
    compiled = outputs_and_grads(compiled_fn, (storage, weight, bias), cotangent / 2)
    assert_rms_close(compiled[0], 2 * eager[0], 1e-6, "out")
    for got, expected in zip(compiled[1], eager[1]):
        assert_rms_close(got, expected, 1e-6, "grad")


@TRITON_ON_CPU  # the device is checked first
def test_bad_inputs_raise():
    qkv = torch.randn(1, 7, 3 * 32)
    weight = torch.randn(32, 1, 3, 3)
    with pytest.raises(ValueError, match="num_heads"):
        triton_linear_attn(qkv, 5)
    with pytest.raises(ValueError, match="feature_map"):
        triton_linear_attn(qkv, 2, "softplus")
    with pytest.raises(ValueError, match="head_dim must be at most 128"):
        triton_linear_attn(torch.randn(1, 7, 3 * 256), 1)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        triton_linear_attn(qkv.double(), 2)
    with pytest.raises(ValueError, match="K odd"):
        triton_linear_attn(qkv, 2, conv_weight=torch.randn(32, 1, 2, 2), grid=(2, 3), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="grid"):
        triton_linear_attn(qkv, 2, conv_weight=weight)
    with pytest.raises(ValueError, match="do not match"):
        triton_linear_attn(qkv, 2, conv_weight=weight, grid=(2, 3))
    with pytest.raises(ValueError, match="conv_bias needs"):
        triton_linear_attn(qkv, 2, conv_bias=torch.randn(32))
    with pytest.raises(ValueError, match="rope must be"):
        triton_linear_attn(qkv, 2, rope=torch.randn(7, 16))
    learned = mixed_rope(init_mixed_rope_freqs(16, 2).requires_grad_(), (2, 3), 1)
    with pytest.raises(ValueError, match="needs a gradient"):
        triton_linear_attn(qkv, 2, rope=learned)


APPLIES = dict(causal=False, has_qk_norm=False, qk_map=False, rope_needs_grad=False, head_dim=64, num_tokens=4097,
               dtype=torch.bfloat16)
REFUSED = [
    (dict(causal=True), "causal attention"),
    (dict(has_qk_norm=True), "a q/k norm between the projection and the mixing"),
    (dict(qk_map=True), "a map of q and k between the projection and the mixing (the learned feature map)"),
    (dict(rope_needs_grad=True), "a rope table that needs a gradient (learned frequencies)"),
    (dict(head_dim=256), "head_dim 256 > 128"),
    (dict(num_tokens=2**21), "2097152 tokens > 1048560"),
    (dict(dtype=torch.float64), "torch.float64 activations"),
]


@pytest.mark.skipif(not HAS_TRITON, reason="without the triton package every call is refused")
def test_chosen_on_cuda_where_it_applies_and_the_reason_logged_where_not(caplog, monkeypatch):
    """The linear layer's op takes the kernels on CUDA when nothing refuses them, never on the CPU unless
    forced; a refusal is logged once and the other paths' rules apply."""
    monkeypatch.setattr(backends, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="visattn.ops.backends")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices named only: nothing runs on them
    assert triton_refusal(**APPLIES) is None
    assert choose_projected_linear_backend(cuda, False, False, triton_refusal=None) == "triton"
    assert choose_projected_linear_backend(cpu, False, False, triton_refusal=None) == "packed"
    for change, reason in REFUSED:
        refusal = triton_refusal(**{**APPLIES, **change})
        assert refusal == reason
        assert choose_projected_linear_backend(cuda, False, False, triton_refusal=refusal) == "split"
        assert caplog.messages[-1] == f"projected_linear: triton backend passed over: {reason}"
    choose_projected_linear_backend(cuda, False, False, triton_refusal=REFUSED[0][1])
    assert len(caplog.messages) == len(REFUSED)  # each reason once


def compile_for_sm90() -> None:
    """Compiles each kernel for an H100/H200 (sm_90) without a GPU, with rope, the convolution and bf16 inputs:
    what the interpreter accepts and a GPU compiler refuses (a global that is not constexpr, a dot below 16)
    fails here. Run with TRITON_INTERPRET unset, so that the kernels are Triton's JIT functions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from visattn.ops.linear import triton_kernels

    flags = {"FEATURE_MAP": 0, "ROPE": True, "PRECISION": "tf32", "BLOCK_N": 32, "BLOCK_D": 64}
    constants = {
        "state_kernel": {**flags, "SEGMENT": 1024},
        "output_kernel": {**flags, "KERNEL": 3, "HAS_BIAS": True},
        "grad_query_kernel": {**flags, "SEGMENT": 1024},
        "grad_key_value_kernel": {**flags, "SEGMENT": 1024, "KERNEL": 3, "BLOCK_TAPS": 16},
        "sum_partials_kernel": {"BLOCK_L": 1024},
    }
    activations = ("qkv_ptr", "out_ptr", "grad_out_ptr", "grad_qkv_ptr")
    for name, constexprs in constants.items():
        kernel = getattr(triton_kernels, name)
        signature = {
            arg: "constexpr" if arg in constexprs else "*bf16" if arg in activations else "*fp32"
            if arg.endswith("_ptr") else "fp32" if arg == "eps" else "i32"
            for arg in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = "from tests.ops.test_linear_triton import compile_for_sm90; compile_for_sm90()"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
