"""Property-based tests: every op and every registered attention layer, on drawn shapes, dtypes and memory
layouts, either matches its naive twin or raises a ValueError naming the bad argument.

Hypothesis draws batch, heads, head width, grid height and width (1 to 40, non-square), prefix tokens
(0 to 5), the dtype, the memory layout of the inputs, the op's options and path, whether gradients are
compared, and in one call of four a fault (a bad shape, dtype, grid, option or path) with the argument it
is in. A valid call must match the naive twin (explicit N x N scores, a mask, fp64) run on the same
rounded inputs, outputs and gradients; a faulty call must raise a ValueError whose message names the
argument. Anything else (another exception, a non-finite or wrong result, a call past the deadline)
fails. The draws are derandomized, so every run tries the same cases; the number tried is printed at the
end of the module.
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import visattn
from visattn import ops
from visattn.layers import GridAttention, get_attention
from visattn.layers.longformer import LongformerAttention
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.naive_decay import naive_decayed_linear_attn
from visattn.ops.linformer import naive_linformer_attn, resample_projection
from visattn.ops.local.naive import naive_masked_attn
from visattn.ops.longformer import longformer_mask, naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn, neighborhood_mask
from visattn.ops.softmax import naive_softmax_attn
from visattn.ops.sparse import naive_sparse_attn, sparse_mask


def _runs_in(dtype: torch.dtype) -> bool:
    """Whether torch runs attention, matmuls and a depthwise convolution in ``dtype`` on the CPU."""
    x = torch.ones(1, 1, 4, 4, dtype=dtype)
    try:
        F.scaled_dot_product_attention(x, x, x)
        F.conv2d(x, torch.ones(1, 1, 3, 3, dtype=dtype), padding=1)
    except RuntimeError:
        return False
    return True


DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if _runs_in(torch.float16) else [])


def tolerance(dtype: torch.dtype) -> float:
    """RMS-relative tolerance against the fp64 twin fed the same rounded inputs.

    fp32: 1e-5, the tolerance of every fp32 comparison in the suite (about 170 unit roundoffs u = 2^-24;
    the sums here run over at most 1,605 tokens, whose rounding error grows like sqrt(N) u, 40 u).
    bf16 (8-bit significand, u = 2^-8) and fp16 (11-bit, u = 2^-11): 8 u. An output passes through at
    most four roundings to the half type (the projection, the scores, the probabilities, the output;
    sums are accumulated in fp32), each within u, and a score error of u |s| changes its probability by
    the same factor, with |s| of a few units for these inputs: 4 x 2 = 8 u.
    """
    if dtype == torch.float32:
        return 1e-5
    return 8 * torch.finfo(dtype).eps / 2


# Gradients pass through the forward's roundings and as many again in the backward (the softmax's
# backward subtracts numbers of similar size), so they get 4 x the output's tolerance; what they are
# measured against is in :func:`check`.
GRADIENT_FACTOR = 4


SETTINGS = settings(
    max_examples=10,  # 16 tests x 10: about a minute on two cores
    # one example takes well under a second; ten seconds means a hang or a blow-up, not a slow machine
    deadline=60_000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CASES_RUN: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_cases(request):
    yield
    total = sum(CASES_RUN.values())
    line = f"fuzz: {total} cases run ({CASES_RUN['matched']} matched the naive twin, {CASES_RUN['refused']} raised ValueError)"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and total:
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)


# ---------------------------------------------------------------------------------------------------------
# Drawing shapes and tensors


@dataclass
class Shape:
    batch: int
    heads: int
    head_dim: int
    grid: tuple[int, int]
    prefix: int

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def tokens(self) -> int:
        return self.prefix + self.patches


# the naive twin forms batch x heads x N^2 fp64 scores; 2^22 of them keep one example well under a second
SCORE_BUDGET = 1 << 22


@st.composite
def shapes(draw, max_prefix: int = 5) -> Shape:
    grid = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    prefix = draw(st.integers(0, max_prefix))
    n = prefix + grid[0] * grid[1]
    room = max(1, SCORE_BUDGET // (n * n))
    batch = draw(st.integers(1, min(3, room)))
    heads = draw(st.integers(1, max(1, min(3, room // batch))))
    head_dim = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    return Shape(batch, heads, head_dim, grid, prefix)


LAYOUTS = ["contiguous", "token_major", "strided", "broadcast_batch"]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A random tensor of ``shape`` (B, heads, tokens..., d) in ``dtype``, laid out in memory as ``layout``:
    contiguous; token-major (heads next to d, as views of a qkv projection); every other element of the
    last axis; or one batch element broadcast over the batch (stride 0)."""
    if layout == "token_major":
        base = torch.randn(shape[0], *shape[2:-1], shape[1], shape[-1], generator=gen).to(dtype)
        return base.movedim(-2, 1)
    if layout == "strided":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., ::2]
    if layout == "broadcast_batch":
        return torch.randn(1, *shape[1:], generator=gen).to(dtype).expand(shape)
    return torch.randn(shape, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Running a call against its twin


@dataclass
class Call:
    """One drawn call: ``fast(*inputs)`` against ``naive(*inputs in fp64)``; ``bad`` is the argument a fault
    was put in (the ValueError must name it), None for a valid call."""

    fast: Callable[..., torch.Tensor]
    naive: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]
    dtype: torch.dtype
    grad: bool
    bad: str | None = None
    params: list[nn.Parameter] = field(default_factory=list)
    twin_params: list[nn.Parameter] = field(default_factory=list)


def check(call: Call) -> None:
    """The call matches its twin (output and, if drawn, gradients) or, when faulty, raises a ValueError
    naming the bad argument."""
    inputs = [t.detach().requires_grad_(call.grad) if t.is_floating_point() else t for t in call.inputs]
    if call.bad is not None:
        with pytest.raises(ValueError) as raised:
            out = call.fast(*inputs)
            if call.grad:
                out.float().square().sum().backward()
        message = str(raised.value)
        assert "\n" not in message, f"a multi-line message: {message!r}"
        assert re.search(rf"\b{re.escape(call.bad)}\b", message), f"{message!r} does not name {call.bad!r}"
        CASES_RUN["refused"] += 1
        return
    twin_inputs = [t.detach().double().requires_grad_(call.grad) for t in call.inputs]
    out = call.fast(*inputs)
    expected = call.naive(*twin_inputs)
    tol = tolerance(call.dtype)
    assert out.dtype == call.dtype, f"output dtype {out.dtype}, expected {call.dtype}"
    _assert_close(out, expected, tol, "output")
    if call.grad:
        cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        out.backward(cotangent.to(out.dtype))
        expected.backward(cotangent)
        # A gradient's rounding error scales with the terms it sums, not with the sum: where they cancel
        # (softmax ignores a shift shared by all keys, so a key-norm bias has the exact gradient 0), the
        # rounding of terms as large as the largest gradient remains. An input's gradient sums few terms
        # and is measured against 1% of the largest gradient at least; a parameter's sums a term from every
        # token, and is measured against the largest gradient.
        largest = max(_rms(ref.grad) for ref in twin_inputs + call.twin_params if ref.grad is not None)
        pairs = [(t, ref, 0.01) for t, ref in zip(inputs, twin_inputs)] + [
            (t, ref, 1.0) for t, ref in zip(call.params, call.twin_params)
        ]
        for i, (t, ref, floor) in enumerate(pairs):
            if ref.grad is None:
                continue
            assert t.grad is not None, f"input {i}: no gradient"
            _assert_close(t.grad, ref.grad, GRADIENT_FACTOR * tol, f"gradient of input {i}", floor * largest)
    CASES_RUN["matched"] += 1


def _rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, floor: float = 0.0) -> None:
    """RMS of the error <= tol x max(RMS of the expected value, floor)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = _rms(actual.double() - expected.double()) / max(_rms(expected), floor, 1e-30)
    assert err <= tol, f"{what}: RMS-relative error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------------------------------------
# Faults shared by the ops on q, k, v


QKV_FAULTS = ["q_rank", "k_tokens", "k_head_dim", "v_dtype", "integer_dtype"]


def apply_qkv_fault(fault: str, q, k, v, dtype):
    """q, k, v with ``fault`` put in, and the argument the error must name."""
    if fault == "q_rank":
        return q[0], k, v, "q"
    if fault == "k_tokens":
        return q, k.narrow(-2, 0, k.shape[-2] - 1), v, "k"
    if fault == "k_head_dim":
        return q, torch.cat([k, k], dim=-1), v, "head_dim"
    if fault == "v_dtype":
        other = torch.float64 if dtype != torch.float64 else torch.float32
        return q, k, v.to(other), "v"
    if fault == "integer_dtype":
        return q.long(), k.long(), v.long(), "q"
    raise AssertionError(fault)


@st.composite
def faults(draw, choices: list[str]) -> str | None:
    """None in three calls of four, else one of ``choices``."""
    if draw(st.integers(0, 3)):
        return None
    return draw(st.sampled_from(choices))


def qkv(draw, shape: Shape, tokens: tuple[int, ...], gen) -> tuple[list[torch.Tensor], torch.dtype]:
    dtype = draw(st.sampled_from(DTYPES))
    full = (shape.batch, shape.heads, *tokens, shape.head_dim)
    return [make_tensor(full, dtype, draw(st.sampled_from(LAYOUTS)), gen) for _ in range(3)], dtype


def generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------------------------------------
# The ops: each strategy draws one Call


def _token_op(draw, shape, extra_faults, build):
    """A call of an op on (B, heads, N, d) tensors. ``build(fault)`` -> (fast, naive, bad) for the drawn
    fault among ``QKV_FAULTS + extra_faults`` (None: valid)."""
    gen = generator(draw)
    (q, k, v), dtype = qkv(draw, shape, (shape.tokens,), gen)
    grad = draw(st.booleans())
    fault = draw(faults(QKV_FAULTS + extra_faults))
    bad = None
    if fault in QKV_FAULTS:
        q, k, v, bad = apply_qkv_fault(fault, q, k, v, dtype)
        fault = None
    fast, naive, op_bad = build(fault, grad)
    return Call(fast, naive, [q, k, v], dtype, grad, bad or op_bad)


@st.composite
def softmax_calls(draw):
    shape = draw(shapes())
    causal = draw(st.booleans())

    def build(fault, grad):
        dropout_p = 1.5 if fault == "dropout_p" else 0.0
        return (
            lambda q, k, v: ops.softmax_attn(q, k, v, is_causal=causal, dropout_p=dropout_p),
            lambda q, k, v: naive_softmax_attn(q, k, v, is_causal=causal),
            fault,
        )

    return _token_op(draw, shape, ["dropout_p"], build)


@st.composite
def linear_calls(draw):
    shape = draw(shapes())
    causal = draw(st.booleans())
    feature_map = draw(st.sampled_from(["elu", "relu"]))
    backend = draw(st.sampled_from([None, "chunk"] if causal else [None, "blocked", "plain"]))
    chunk_size = draw(st.integers(1, 80))

    def build(fault, grad):
        kwargs = {"feature_map": feature_map, "causal": causal, "chunk_size": chunk_size, "backend": backend}
        bad = fault
        if fault == "chunk_size":
            kwargs["chunk_size"] = 0
        elif fault == "feature_map":
            kwargs["feature_map"] = "gelu"
        elif fault == "backend":
            kwargs["backend"] = "blocked" if causal else "chunk"
        return (
            lambda q, k, v: ops.linear_attn(q, k, v, **kwargs),
            lambda q, k, v: naive_linear_attn(q, k, v, feature_map, causal),
            bad,
        )

    return _token_op(draw, shape, ["chunk_size", "feature_map", "backend"], build)


@st.composite
def axial_calls(draw):
    shape = draw(shapes())
    backend = draw(st.sampled_from([None, "cpu_kernels", "sdpa", "sdpa_checkpoint"]))
    p, grid = shape.prefix, shape.grid

    def build(fault, grad):
        kwargs = {"grid": grid, "num_prefix_tokens": p, "backend": backend}
        bad = {"grid_float": "grid", "grid_zero": "grid", "grid_other": "grid"}.get(fault, fault)
        if fault == "grid_float":
            kwargs["grid"] = (grid[0] + 0.5, grid[1])
        elif fault == "grid_zero":
            kwargs["grid"] = (0, grid[1])
        elif fault == "grid_other":
            kwargs["grid"] = (grid[0] + 1, grid[1])
        elif fault == "num_prefix_tokens":
            kwargs["num_prefix_tokens"] = -1
        elif fault == "dropout_p":
            kwargs.update(dropout_p=-0.5, backend="sdpa")
        elif fault == "backend":
            kwargs["backend"] = "flash"
        return (
            lambda q, k, v: ops.axial_attn(q, k, v, **kwargs),
            lambda q, k, v: naive_axial_attn(q, k, v, grid, p),
            bad,
        )

    return _token_op(draw, shape, ["grid_float", "grid_zero", "grid_other", "num_prefix_tokens", "dropout_p", "backend"], build)


@st.composite
def linformer_calls(draw):
    shape = draw(shapes())
    p, grid = shape.prefix, shape.grid
    num_proj = draw(st.integers(1, 20))
    ref_grid = (draw(st.integers(1, 10)), draw(st.integers(1, 10)))
    gen = generator(draw)
    proj_k, proj_v = (
        resample_projection(torch.rand(num_proj, *ref_grid, generator=gen) / (ref_grid[0] * ref_grid[1]), ref_grid, grid)
        for _ in range(2)
    )

    def build(fault, grad):
        kwargs = {"proj_k": proj_k, "proj_v": proj_v, "num_prefix_tokens": p}
        bad = fault
        if fault == "proj_k":
            kwargs["proj_k"] = torch.cat([proj_k, proj_k[:, :1]], dim=1)
        elif fault == "proj_v":
            kwargs["proj_v"] = proj_v[:, :, None]
        elif fault == "num_prefix_tokens":
            kwargs["num_prefix_tokens"] = p + shape.patches
        return (
            lambda q, k, v: ops.linformer_attn(q, k, v, **kwargs),
            lambda q, k, v: naive_linformer_attn(q, k, v, proj_k.double(), proj_v.double(), p),
            bad,
        )

    return _token_op(draw, shape, ["proj_k", "proj_v", "num_prefix_tokens"], build)


@st.composite
def longformer_calls(draw):
    shape = draw(shapes())
    p, grid = shape.prefix, shape.grid
    local = draw(st.sampled_from(["neighborhood", "sparse"]))
    options = {
        "kernel_size": draw(st.sampled_from([1, 3, 5, 7, 9])),
        "tile_size": draw(st.integers(1, 10)),
        "block_size": draw(st.integers(1, 10)),
        "halo": draw(st.integers(0, 4)),
    }
    backend = draw(st.sampled_from([None, "chunked", "gathered"]))

    def build(fault, grad):
        kwargs = {"local": local, **options, "backend": "gathered" if grad and backend == "chunked" else backend}
        bad = {"grid_other": "grid", "kernel_size_even": "kernel_size", "halo_negative": "halo"}.get(fault, fault)
        if fault == "grid_other":
            kwargs["grid"] = (grid[1] + 1, grid[0])
        elif fault == "num_global_tokens":
            kwargs["num_global_tokens"] = -1
        elif fault == "local":
            kwargs["local"] = "axial"
        elif fault == "kernel_size_even":
            kwargs.update(local="neighborhood", kernel_size=4)
        elif fault == "block_size":
            kwargs.update(local="sparse", block_size=0)
        elif fault == "halo_negative":
            kwargs.update(local="sparse", halo=-1)
        elif fault == "backend":
            kwargs["backend"] = "chunked" if grad else "tiled"
        call_kwargs = {"grid": grid, "num_global_tokens": p, **kwargs}
        naive_kwargs = {key: call_kwargs[key] for key in ("local", "kernel_size", "block_size", "halo")}
        return (
            lambda q, k, v: ops.longformer_attn(q, k, v, **call_kwargs),
            lambda q, k, v: naive_longformer_attn(q, k, v, grid, p, **naive_kwargs),
            bad,
        )

    faults_here = ["grid_other", "num_global_tokens", "local", "kernel_size_even", "block_size", "halo_negative", "backend"]
    return _token_op(draw, shape, faults_here, build)


@st.composite
def grid_local_calls(draw):
    """neighborhood_attn and sparse_attn on (B, heads, P + H * W, d), prefix tokens first."""
    shape = draw(shapes())
    op = draw(st.sampled_from(["neighborhood", "sparse"]))
    gen = generator(draw)
    (q, k, v), dtype = qkv(draw, shape, (shape.tokens,), gen)
    grad = draw(st.booleans())
    backend = draw(st.sampled_from([None, "gathered"] if grad else [None, "chunked", "gathered"]))
    kernel_size, tile_size = draw(st.sampled_from([1, 3, 5, 7, 9])), draw(st.integers(1, 10))
    block_size, halo = draw(st.integers(1, 10)), draw(st.integers(0, 4))
    fault = draw(faults(QKV_FAULTS + ["option", "dropout_p"]))
    bad = None
    if fault in QKV_FAULTS:
        q, k, v, bad = apply_qkv_fault(fault, q, k, v, dtype)
    dropout_p = 2.0 if fault == "dropout_p" else 0.0
    if op == "neighborhood":
        if fault == "option":
            kernel_size, bad = 2 * kernel_size, "kernel_size"
        fast = lambda q, k, v: ops.neighborhood_attn(
            q, k, v, shape.grid, kernel_size, num_prefix_tokens=shape.prefix, tile_size=tile_size,
            dropout_p=dropout_p, backend=backend,
        )
        naive = lambda q, k, v: naive_neighborhood_attn(q, k, v, shape.grid, kernel_size, num_prefix_tokens=shape.prefix)
    else:
        if fault == "option":
            halo, bad = -1 - halo, "halo"
        fast = lambda q, k, v: ops.sparse_attn(
            q, k, v, shape.grid, block_size, halo, num_prefix_tokens=shape.prefix, dropout_p=dropout_p, backend=backend
        )
        naive = lambda q, k, v: naive_sparse_attn(
            q, k, v, shape.grid, block_size, halo, num_prefix_tokens=shape.prefix
        )
    if fault == "dropout_p":
        bad = "dropout_p"
    return Call(fast, naive, [q, k, v], dtype, grad, bad)


@st.composite
def packed_calls(draw):
    """The ops on timm's packed qkv projection (B, N, 3 C): packed_axial_attn, packed_linear_attn and (no
    autograd) fused_qkv_linear_attn, which also takes the projection's weight and bias."""
    shape = draw(shapes())
    op = draw(st.sampled_from(["packed_axial", "packed_linear", "fused_qkv_linear"]))
    gen = generator(draw)
    dtype = draw(st.sampled_from(DTYPES))
    heads, p, grid = shape.heads, shape.prefix, shape.grid
    c = heads * shape.head_dim
    grad = draw(st.booleans()) and op != "fused_qkv_linear"
    fault = draw(faults(["num_heads", "qkv_rank"]))
    num_heads = {"num_heads": heads + 1 if c % (heads + 1) else 0}.get(fault, heads)

    def split(qkv):  # (B, N, 3 C) -> q, k, v (B, heads, N, d)
        return [split_heads(t, heads) for t in qkv.chunk(3, dim=-1)]

    if op == "fused_qkv_linear":
        x = make_tensor((shape.batch, 1, shape.tokens, c), dtype, draw(st.sampled_from(LAYOUTS)), gen)[:, 0]
        weight = (torch.randn(3 * c, c, generator=gen) * c**-0.5).to(dtype)
        bias = draw(st.sampled_from([None, torch.randn(3 * c, generator=gen).to(dtype)]))
        if fault == "qkv_rank":
            x = x[0]
        fast = lambda x: ops.fused_qkv_linear_attn(x, weight, bias, num_heads)
        naive = lambda x: merge_heads(naive_linear_attn(*split(F.linear(x, weight.double(), None if bias is None else bias.double()))))
        bad = {"num_heads": "num_heads", "qkv_rank": "x"}.get(fault)
        return Call(fast, naive, [x], dtype, False, bad)
    qkv_proj = make_tensor((shape.batch, 1, shape.tokens, 3 * c), dtype, draw(st.sampled_from(LAYOUTS)), gen)[:, 0]
    if fault == "qkv_rank":
        qkv_proj = qkv_proj[0]
    if op == "packed_axial":
        fast = lambda t: ops.packed_axial_attn(t, num_heads, grid, p)
        naive = lambda t: merge_heads(naive_axial_attn(*split(t), grid, p))
    else:
        fast = lambda t: ops.packed_linear_attn(t, num_heads)[0]
        naive = lambda t: merge_heads(naive_linear_attn(*split(t)))
    bad = {"num_heads": "num_heads", "qkv_rank": "qkv"}.get(fault)
    return Call(fast, naive, [qkv_proj], dtype, grad, bad)


@st.composite
def linear_step_calls(draw):
    """linear_attn_step walked over the first tokens, against the causal naive twin."""
    shape = draw(shapes(max_prefix=0))
    steps = min(shape.tokens, 12)
    gen = generator(draw)
    (q, k, v), dtype = qkv(draw, shape, (steps,), gen)
    feature_map = draw(st.sampled_from(["elu", "relu"]))
    fault = draw(faults(["q_rank", "k_head_dim", "v_dtype", "state"]))

    def walk(q, k, v):
        state, outs = None, []
        for i in range(steps):
            qi, ki, vi = q[:, :, i], k[:, :, i], v[:, :, i]
            if fault == "q_rank":
                qi = qi[0]
            elif fault == "k_head_dim":
                ki = torch.cat([ki, ki], dim=-1)
            elif fault == "v_dtype":
                vi = vi.double() if vi.dtype != torch.float64 else vi.float()
            if fault == "state" and state is not None:
                state = (state[0][:, :, :1], state[1])
            out, state = ops.linear_attn_step(qi, ki, vi, state, feature_map)
            outs.append(out)
        return torch.stack(outs, dim=2)

    bad = {"q_rank": "q", "k_head_dim": "head_dim", "v_dtype": "v", "state": "state"}.get(fault)
    if fault == "state" and steps == 1:
        bad = None
    naive = lambda q, k, v: naive_linear_attn(q, k, v, feature_map, causal=True)
    return Call(walk, naive, [q, k, v], dtype, draw(st.booleans()), bad)


OP_CALLS = {
    "softmax_attn": softmax_calls(),
    "linear_attn": linear_calls(),
    "linear_attn_step": linear_step_calls(),
    "axial_attn": axial_calls(),
    "linformer_attn": linformer_calls(),
    "longformer_attn": longformer_calls(),
    "neighborhood_sparse_attn": grid_local_calls(),
    "packed_and_fused": packed_calls(),
}


@pytest.mark.parametrize("op", OP_CALLS)
def test_op_matches_naive_twin_or_names_the_bad_argument(op):
    @SETTINGS
    @given(call=OP_CALLS[op])
    def run(call):
        check(call)

    run()


# ---------------------------------------------------------------------------------------------------------
# The layers: every registered type, its naive twin built from its own weights in fp64


def _naive_mix(layer: GridAttention) -> Callable[..., torch.Tensor]:
    """The layer's token mixing spelled out with explicit masks, for its fp64 twin; q, k, v (B, h, N, d)."""
    name = layer.name

    def mix(q, k, v, grid, attn_mask, is_causal):
        p = layer.num_prefix_tokens
        if name == "softmax":
            return naive_softmax_attn(q, k, v, is_causal=is_causal)
        if name == "floor":
            return v
        if name == "linear":
            if layer.spatial_decay is None:
                out = naive_linear_attn(q, k, v, layer.feature_map, causal=is_causal)
            else:
                out = naive_decayed_linear_attn(q, k, v, layer.spatial_decay(), grid, p, layer.feature_map)
            if layer.dwconv is None:
                return out
            b, h = v.shape[:2]
            image = merge_heads(v)[:, p:].transpose(1, 2).reshape(b, -1, *grid)  # (B, C, H, W)
            local = layer.dwconv(image).flatten(2).transpose(1, 2)  # (B, H * W, C)
            merged = merge_heads(out)
            return split_heads(torch.cat([merged[:, :p], merged[:, p:] + local], dim=1), h)
        if name == "axial":
            return naive_axial_attn(q, k, v, grid, p)
        if name == "linformer":
            proj_k, proj_v = (resample_projection(w, layer.ref_grid, grid) for w in (layer.proj_k, layer.proj_v))
            return naive_linformer_attn(q, k, v, proj_k, proj_v, p)
        if isinstance(layer, LongformerAttention):
            extra = layer.num_extra_global_tokens
            if extra:
                eq, ek, ev = layer.extra_qkv(q.shape[0])
                q, k, v = (torch.cat([t[:, :, :p], e, t[:, :, p:]], dim=2) for t, e in zip((q, k, v), (eq, ek, ev)))
            allowed = longformer_mask(grid, p + extra, layer.local, layer.kernel_size, layer.block_size, layer.halo)
            out = naive_masked_attn(q, k, v, allowed)
            return torch.cat([out[:, :, :p], out[:, :, p + extra :]], dim=2)
        n = p + grid[0] * grid[1]
        allowed = torch.zeros(n, n, dtype=torch.bool)
        allowed[:p] = True  # prefix queries see every token, patches only their window
        if name == "neighborhood":
            allowed[p:, p:] = neighborhood_mask(grid, layer.kernel_size)
        else:
            allowed[p:, p:] = sparse_mask(grid, layer.block_size, layer.halo)
        return naive_masked_attn(q, k, v, allowed)

    return mix


def twin_of(layer: GridAttention, rounded_to: torch.dtype | None = None) -> GridAttention:
    """An fp64 copy of ``layer`` that projects with the generic path and mixes with :func:`_naive_mix`; its
    weights first rounded to ``rounded_to`` if given (what autocast feeds the projections)."""
    twin = copy.deepcopy(layer)
    if rounded_to is not None:
        twin.to(rounded_to)
    twin.double()
    twin.mix = _naive_mix(twin)
    twin.project_and_mix = lambda *args: GridAttention.project_and_mix(twin, *args)
    return twin


LAYER_OPTIONS = {
    "linear": lambda draw: {
        "feature_map": draw(st.sampled_from(["elu", "relu"])),
        "dwconv_kernel": draw(st.sampled_from([None, 1, 3, 5])),
        "chunk_size": draw(st.integers(1, 80)),
    },
    "linformer": lambda draw: {
        "k": draw(st.integers(1, 20)),
        "ref_grid": (draw(st.integers(1, 10)), draw(st.integers(1, 10))),
    },
    "neighborhood": lambda draw: {
        "kernel_size": draw(st.sampled_from([1, 3, 5, 7, 9])),
        "tile_size": draw(st.integers(1, 10)),
    },
    "sparse": lambda draw: {"block_size": draw(st.integers(1, 10)), "halo": draw(st.integers(0, 4))},
    "longformer": lambda draw: {
        "local": draw(st.sampled_from(["neighborhood", "sparse"])),
        "kernel_size": draw(st.sampled_from([1, 3, 5, 7, 9])),
        "block_size": draw(st.integers(1, 10)),
        "halo": draw(st.integers(0, 4)),
        "num_extra_global_tokens": draw(st.integers(0, 2)),
    },
}
LAYER_FAULTS = ["x_rank", "x_channels", "x_tokens", "x_dtype", "grid_zero", "grid_float", "prefix_negative", "prefix_float"]
# how the layer computes: its own dtype, or fp32 weights under CPU autocast (the training path)
PRECISIONS = [*DTYPES, "autocast_bf16"]


@dataclass
class LayerCall:
    name: str
    shape: Shape
    options: dict
    precision: object
    layout: str
    grad: bool
    causal: bool
    qk_norm: bool
    fault: str | None
    seed: int


@st.composite
def layer_calls(draw, name: str) -> LayerCall:
    shape = draw(shapes())
    options = LAYER_OPTIONS.get(name, lambda draw: {})(draw)
    causal_ok = name == "softmax" or (name == "linear" and options["dwconv_kernel"] is None)
    call = LayerCall(
        name,
        shape,
        options,
        draw(st.sampled_from(PRECISIONS)),
        draw(st.sampled_from(["contiguous", "token_major", "strided", "broadcast_batch"])),
        draw(st.booleans()),
        causal_ok and draw(st.booleans()),
        draw(st.booleans()),
        draw(faults(LAYER_FAULTS)),
        draw(st.integers(0, 2**16)),
    )
    if name == "linear" and not call.causal:  # the spatial decay is not causal
        options["decay"] = draw(st.sampled_from([None, True, [0.2, 0.99]]))
    return call


def _layer_call(c: LayerCall) -> Call:
    gen = torch.Generator().manual_seed(c.seed)
    torch.manual_seed(c.seed)
    shape = c.shape
    dim = shape.heads * shape.head_dim
    autocast = c.precision == "autocast_bf16"
    dtype = torch.float32 if autocast else c.precision
    norm = {"qk_norm": True, "norm_layer": nn.LayerNorm} if c.qk_norm else {}
    layer = get_attention(c.name)(dim, num_heads=shape.heads, qkv_bias=True, **norm, **c.options).to(dtype)
    grid, prefix = shape.grid, shape.prefix
    bad, tokens, channels = None, shape.tokens, dim
    if c.fault == "grid_zero":
        grid, bad = (0, grid[1]), "grid"
    elif c.fault == "grid_float":
        grid, bad = (grid[0], grid[1] - 0.5), "grid"
    elif c.fault == "prefix_negative":
        prefix, bad = -1, "num_prefix_tokens"
    elif c.fault == "prefix_float":
        prefix, bad = prefix + 0.5, "num_prefix_tokens"
    elif c.fault == "x_channels":
        channels, bad = dim + 1, "x"
    elif c.fault == "x_tokens" and layer.needs_grid:
        tokens, bad = tokens + 1, "grid"  # a layer that needs no grid takes any token count
    x = make_tensor((shape.batch, 1, tokens, channels), dtype, c.layout, gen)[:, 0]  # (B, N, C)
    if c.fault == "x_rank":
        x, bad = x[0], "x"
    elif c.fault == "x_dtype":
        x, bad = x.double(), "x"
    # under autocast the projections read x and their weights rounded to bf16: so does the twin, whose
    # result then differs by the roundings inside the layer only (the relu feature map has a kink at 0,
    # where a rounded input could otherwise move a query across it)
    twin = twin_of(layer, torch.bfloat16 if autocast else None)

    def fast(x):
        layer.set_grid(grid, prefix)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return layer(x, is_causal=c.causal)

    def naive(x):
        if autocast:
            x = x.to(torch.bfloat16).double()
        twin.set_grid(grid, prefix)
        return twin(x, is_causal=c.causal)

    result_dtype = torch.bfloat16 if autocast else dtype
    call = Call(fast, naive, [x], result_dtype, c.grad, bad)
    if c.grad and bad is None:
        call.params, call.twin_params = list(layer.parameters()), list(twin.parameters())
    return call


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_layer_matches_naive_twin_or_names_the_bad_argument(name):
    @SETTINGS
    @given(c=layer_calls(name))
    def run(c):
        check(_layer_call(c))

    run()
