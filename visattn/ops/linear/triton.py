"""Non-causal linear attention as Triton kernels on timm's qkv projection, token-major in and out.

:func:`triton_linear_attn` reads q, k and v in place from the projection (B, N, 3 C) (any strides: no
copy, no head split) and writes ``phi(q) S / max(phi(q) z, eps)``, heads merged, straight into the
(B, N, C) tensor the output projection reads, with the layer's depthwise K x K locality convolution of v
over the patch grid fused in (each output block loads its taps' shifted v blocks). The passes over N x C
activations: the state kernel reads k and v, the output kernel q and v (the taps' halo from cache) and
writes the output; the backward reads q and the output gradient and writes dq, then reads k, v and the
output gradient (its taps' halo from cache) and writes dk and dv. Autograd keeps the projection and the
fp32 state [S | z] (B, heads, d, d + 1) and recomputes the feature maps.

Kernels (:mod:`visattn.ops.linear.triton_kernels`) and their launch grids, image x head first, then
the tokens: segments of SEGMENT tokens (1,024; 128 interpreted), each walked in blocks of BLOCK_N, or blocks:
    state_kernel           (B heads, segments)      partial [S | z] per segment
    sum_partials_kernel    (B heads, L / 1024)      the segments added in order (skipped for one segment)
    output_kernel          (B heads, N / BLOCK_N)   the output, locality term included
    grad_query_kernel      (B heads, segments)      dq and partial d[S | z]
    sum_partials_kernel                             d[S | z]
    grad_key_value_kernel  (B heads, segments)      dk, dv and partial conv weight/bias gradients
    sum_partials_kernel    (1, C (K K + 1) / 1024)  the conv gradients, over images and segments
Sums over tokens are fp32 and reduced in a fixed order, so a result is the same bit for bit from run to
run (on a GPU: once the launch configuration is fixed, from :data:`TUNED_CONFIGS` or the process's
autotuning).

A rope table (constant: (N, 2 d) or (heads, N, 2 d)) turns phi(q) and phi(k) of the numerator inside the
kernels. Not here: a table that needs a gradient (learned RoPE-Mixed frequencies while training), the
learned feature map and q/k norms (both between the projection and the mixing), causal attention and the
spatial decay; the layer's path choice sends those elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from visattn.ops.checks import check_grid, check_packed_qkv
from visattn.ops.layout import split_qkv
from visattn.ops.rope import check_rope_table
from visattn.ops.triton_support import AUTOTUNE, HAS_TRITON, INTERPRETED, check_triton_runs_on, register_triton_op

if HAS_TRITON:
    import triton
    from torch.library import wrap_triton

    from visattn.ops.linear import triton_kernels as kernels

OP = "triton_linear_attn"
FEATURE_MAP_CODES = {"elu": 0, "relu": 1}  # kernels.ELU, kernels.RELU
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUM_BLOCK = 1024  # values per program of sum_partials_kernel


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    num_warps: int
    num_stages: int


# Tokens per partial sum. A partial state is 4 d (d + 1) bytes a head, 16 bytes a token at 1,024 tokens and d = 64
# (an eighth of the bf16 output); 65,536 tokens still give 64 programs a head. Interpreted, small enough that the
# tests' shapes span several segments of two blocks.
CUDA_SEGMENT = 1024
SEGMENT = 128 if INTERPRETED else CUDA_SEGMENT
INTERPRETED_CONFIG = LaunchConfig(64, 4, 1)
# Autotuning candidates on a GPU per kernel (block sizes dividing SEGMENT), for heads up to 64 wide: compiled for
# sm_90 (ptxas -v, bf16 inputs, TF32 products) they spill no registers, or a few hundred bytes in the backward with
# rope; 4-warp blocks of 64 or more tokens spill kilobytes. A head of 128 keeps a 128 x 128 fp32 state (64 KiB)
# per program and takes WIDE_HEAD_CONFIGS, the only ones that fit in shared memory with rope.
AUTOTUNE_CONFIGS = {
    "state_kernel": (
        LaunchConfig(32, 8, 2), LaunchConfig(64, 8, 2), LaunchConfig(64, 8, 3), LaunchConfig(64, 16, 2),
        LaunchConfig(128, 8, 2),
    ),
    "output_kernel": (LaunchConfig(32, 8, 2), LaunchConfig(64, 8, 2), LaunchConfig(64, 8, 3), LaunchConfig(64, 16, 2)),
    "grad_query_kernel": (
        LaunchConfig(32, 4, 2), LaunchConfig(32, 8, 2), LaunchConfig(64, 8, 2), LaunchConfig(64, 8, 3),
    ),
    "grad_key_value_kernel": (LaunchConfig(32, 8, 2), LaunchConfig(64, 8, 2), LaunchConfig(64, 16, 2)),
}
WIDE_HEAD_CONFIGS = (LaunchConfig(16, 4, 1), LaunchConfig(32, 8, 1), LaunchConfig(32, 8, 2))
MAX_HEAD_DIM = 128
MAX_TOKENS = 65535 * 16  # CUDA's limit of a grid's second axis, in blocks of at least 16 tokens
# (kernel name, BLOCK_D, dtype name, feature map, rope, locality kernel side or 0) -> the configuration a GPU's
# autotuning chose (:func:`autotuned_configs`), so that no later run spends time autotuning: keyed as the autotuning
# is (AUTOTUNE_KEYS), so a choice made for one feature map, rope or kernel size serves only that one. The locality
# kernel side is 0 for the kernels that do not take it. Filled in from GPU runs.
TUNED_CONFIGS: dict[tuple[str, int, str, str, bool, int], LaunchConfig] = {}
AUTOTUNE_KEYS = {
    "state_kernel": ["BLOCK_D", "FEATURE_MAP", "ROPE"],
    "output_kernel": ["BLOCK_D", "FEATURE_MAP", "ROPE", "KERNEL"],
    "grad_query_kernel": ["BLOCK_D", "FEATURE_MAP", "ROPE"],
    "grad_key_value_kernel": ["BLOCK_D", "FEATURE_MAP", "ROPE", "KERNEL"],
}


def _autotuned(name: str, configs: tuple[LaunchConfig, ...]):
    candidates = [
        triton.Config({"BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs
    ]
    return triton.autotune(candidates, key=AUTOTUNE_KEYS[name])(getattr(kernels, name))


if HAS_TRITON and not INTERPRETED:
    # (kernel name, whether the head is wider than 64) -> the autotuned kernel
    _AUTOTUNED = {
        (name, wide): _autotuned(name, WIDE_HEAD_CONFIGS if wide else configs)
        for name, configs in AUTOTUNE_CONFIGS.items()
        for wide in (False, True)
    }


def _table_key(name: str, flags: dict, dtype_name: str, kernel_size: int) -> tuple[str, int, str, str, bool, int]:
    """The :data:`TUNED_CONFIGS` key of a launch of ``name`` with the constants ``flags`` (:func:`_flags`)."""
    feature_map = next(map_name for map_name, code in FEATURE_MAP_CODES.items() if code == flags["FEATURE_MAP"])
    return name, flags["BLOCK_D"], dtype_name, feature_map, bool(flags["ROPE"]), kernel_size


def _kernel(name: str, flags: dict, dtype: torch.dtype, kernel_size: int = 0):
    """The kernel ``name`` and its launch keywords: the fixed configuration when interpreted, the table's
    entry if any, else the autotuned kernel (which picks BLOCK_N, warps and stages itself), or its first
    candidate where autotuning is off (:mod:`visattn.ops.triton_support`)."""
    block_d, dtype_name = flags["BLOCK_D"], str(dtype).removeprefix("torch.")
    config = INTERPRETED_CONFIG if INTERPRETED else TUNED_CONFIGS.get(_table_key(name, flags, dtype_name, kernel_size))
    if config is None and not AUTOTUNE:  # the first candidate (triton_support says when)
        config = (WIDE_HEAD_CONFIGS if block_d > 64 else AUTOTUNE_CONFIGS[name])[0]
    if config is None:
        return wrap_triton(_AUTOTUNED[(name, block_d > 64)]), {}
    if SEGMENT % config.block_n or config.block_n < 16:
        raise ValueError(f"{OP}: BLOCK_N={config.block_n} must be >= 16 (tl.dot) and divide SEGMENT={SEGMENT}")
    launch = {"BLOCK_N": config.block_n, "num_warps": config.num_warps, "num_stages": config.num_stages}
    return wrap_triton(getattr(kernels, name)), launch


def autotuned_configs() -> dict[tuple[str, int, str, str, bool, int], LaunchConfig]:
    """What this process's autotuning chose, as :data:`TUNED_CONFIGS` entries (to print after a GPU run)."""
    chosen = {}
    for (name, _), tuner in (_AUTOTUNED.items() if HAS_TRITON and not INTERPRETED else ()):
        for key, config in tuner.cache.items():
            # the autotuning key: the values of AUTOTUNE_KEYS[name], then the tensor arguments' dtypes
            values = dict(zip(AUTOTUNE_KEYS[name], key))
            dtype = next(k for k in key[len(values):] if isinstance(k, str) and k.startswith("torch."))
            table_key = _table_key(name, values, dtype.removeprefix("torch."), values.get("KERNEL", 0))
            chosen[table_key] = LaunchConfig(config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return chosen


def _flags(feature_map: str, rope: torch.Tensor | None, dtype: torch.dtype, d: int) -> dict:
    """The constants every kernel but the sum takes. tl.dot's operands: TF32 (fp32's range, 10 mantissa
    bits, more than fp16 and bf16 inputs carry) for 16-bit inputs and where torch allows TF32 for fp32
    matmuls, else full fp32. A head padded to a power of two of at least 16 columns."""
    tf32 = dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"
    return {
        "FEATURE_MAP": FEATURE_MAP_CODES[feature_map], "ROPE": rope is not None,
        "PRECISION": "tf32" if tf32 else "ieee", "BLOCK_D": max(16, triton.next_power_of_2(d)),
    }


def _partials(total: torch.Tensor, rows: int, segments: int) -> torch.Tensor:
    """Where a kernel writes its per-segment partial sums of ``total`` (rows x L values): ``total`` itself
    for one segment, else an fp32 buffer (rows, segments, L) that :func:`_sum_partials` adds into it."""
    return total if segments == 1 else total.new_empty(rows, segments, total.numel() // rows)


def _sum_partials(partials: torch.Tensor, total: torch.Tensor) -> None:
    if partials is total:
        return
    rows, segments, length = partials.shape
    wrap_triton(kernels.sum_partials_kernel)[(rows, triton.cdiv(length, SUM_BLOCK))](
        partials, total, segments, length, BLOCK_L=SUM_BLOCK
    )


def _rope_args(rope: torch.Tensor | None, fallback: torch.Tensor) -> tuple:
    """The table (any tensor when there is none: never read) and its (head, token, column) strides."""
    if rope is None:
        return fallback, 0, 0, 0
    return (rope, 0 if rope.ndim == 2 else rope.stride(0), rope.stride(-2), rope.stride(-1))


def _conv_args(weight: torch.Tensor | None, bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple:
    """(weight, bias, stride over channels, rows, columns, kernel size K; 0 without a convolution); any
    tensor stands in for one that is absent (never read)."""
    if weight is None:
        return fallback, fallback, 0, 0, 0, 0
    bias = fallback if bias is None else bias
    return (weight, bias, weight.stride(0), weight.stride(2), weight.stride(3), weight.shape[-1])


def _forward_outputs(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, N, C) in qkv's dtype and the state [S | z] (B, heads, d, d + 1) fp32, empty."""
    batch, n, three_c = qkv.shape
    c = three_c // 3
    d = c // num_heads
    state = qkv.new_empty(batch, num_heads, d, d + 1, dtype=torch.float32)
    return qkv.new_empty(batch, n, c), state


def _forward(
    qkv: torch.Tensor, num_heads: int, feature_map: str, eps: float, conv_weight: torch.Tensor | None,
    conv_bias: torch.Tensor | None, num_prefix_tokens: int, grid_h: int, grid_w: int, rope: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, N, C), state (B, heads, d, d + 1) fp32): the state kernel, the segments' sum, the output kernel."""
    out, state = _forward_outputs(qkv, num_heads)
    batch, n, c = out.shape
    d = c // num_heads
    programs = (batch * num_heads, triton.cdiv(n, SEGMENT))
    flags = _flags(feature_map, rope, qkv.dtype, d)
    rope_args = _rope_args(rope, state)
    partials = _partials(state, batch * num_heads, programs[1])
    kernel, launch = _kernel("state_kernel", flags, qkv.dtype)
    kernel[programs](
        qkv, rope_args[0], partials, n, c, d, num_heads, *qkv.stride(), *rope_args[1:], SEGMENT=SEGMENT, **flags,
        **launch,
    )
    _sum_partials(partials, state)
    weight, bias, *weight_strides, size = _conv_args(conv_weight, conv_bias, state)
    kernel, launch = _kernel("output_kernel", flags, qkv.dtype, size)
    kernel[lambda meta: (batch * num_heads, triton.cdiv(n, meta["BLOCK_N"]))](
        qkv, state, rope_args[0], weight, bias, out, n, c, d, num_heads, eps, *qkv.stride(), *rope_args[1:],
        *out.stride(), *weight_strides, num_prefix_tokens, grid_h, grid_w, KERNEL=size,
        HAS_BIAS=conv_bias is not None, **flags, **launch,
    )
    return out, state


def _backward_outputs(qkv: torch.Tensor, conv_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_qkv (B, N, 3 C) in qkv's dtype; the conv gradients (C, K * K + 1) fp32, weight taps then
    bias, or (0, 0) without a convolution."""
    grad_conv = qkv.new_empty(0, 0, dtype=torch.float32)
    if conv_weight is not None:
        grad_conv = qkv.new_empty(conv_weight.shape[0], conv_weight.shape[-1] ** 2 + 1, dtype=torch.float32)
    return qkv.new_empty(qkv.shape), grad_conv


def _backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, state: torch.Tensor, conv_weight: torch.Tensor | None,
    rope: torch.Tensor | None, num_heads: int, feature_map: str, eps: float, num_prefix_tokens: int, grid_h: int,
    grid_w: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_qkv, grad_conv): dq and the segments' d[S | z], their sum, then dk, dv and the conv gradients."""
    grad_qkv, grad_conv = _backward_outputs(qkv, conv_weight)
    batch, n, three_c = qkv.shape
    c = three_c // 3
    d = c // num_heads
    programs = (batch * num_heads, triton.cdiv(n, SEGMENT))
    flags = {**_flags(feature_map, rope, qkv.dtype, d), "SEGMENT": SEGMENT}
    rope_args = _rope_args(rope, state)
    grad_state = torch.empty_like(state)
    partials = _partials(grad_state, batch * num_heads, programs[1])
    kernel, launch = _kernel("grad_query_kernel", flags, qkv.dtype)
    kernel[programs](
        qkv, state, rope_args[0], grad_out, grad_qkv, partials, n, c, d, num_heads, eps, *qkv.stride(),
        *rope_args[1:], *grad_out.stride(), *grad_qkv.stride(), **flags, **launch,
    )
    _sum_partials(partials, grad_state)
    weight, _, *weight_strides, size = _conv_args(conv_weight, None, state)
    conv_partials = state.new_empty(batch * programs[1], *grad_conv.shape) if size else state
    kernel, launch = _kernel("grad_key_value_kernel", flags, qkv.dtype, size)
    kernel[programs](
        qkv, grad_state, rope_args[0], weight, grad_out, grad_qkv, conv_partials, n, c, d, num_heads, *qkv.stride(),
        *rope_args[1:], *grad_out.stride(), *grad_qkv.stride(), *weight_strides, num_prefix_tokens, grid_h, grid_w,
        KERNEL=size, BLOCK_TAPS=max(1, triton.next_power_of_2(size * size)), **flags, **launch,
    )
    if size:
        _sum_partials(conv_partials.view(1, batch * programs[1], -1), grad_conv)
    return grad_qkv, grad_conv


def _setup_context(ctx, inputs, output) -> None:
    qkv, num_heads, feature_map, eps, conv_weight, conv_bias, num_prefix_tokens, grid_h, grid_w, rope = inputs
    ctx.save_for_backward(qkv, output[1], conv_weight, rope)
    ctx.mark_non_differentiable(output[1])
    ctx.arguments = (num_heads, feature_map, eps, num_prefix_tokens, grid_h, grid_w)
    ctx.bias_dtype = None if conv_bias is None else conv_bias.dtype


def _autograd_backward(ctx, grad_out, _grad_state):
    qkv, state, conv_weight, rope = ctx.saved_tensors
    grad_qkv, grad_conv = _backward_op(grad_out, qkv, state, conv_weight, rope, *ctx.arguments)
    grad_weight = grad_bias = None
    if conv_weight is not None:
        grad_weight = grad_conv[:, :-1].reshape(conv_weight.shape).to(conv_weight.dtype)
        grad_bias = None if ctx.bias_dtype is None else grad_conv[:, -1].to(ctx.bias_dtype)
    return grad_qkv, None, None, None, grad_weight, grad_bias, None, None, None, None


if HAS_TRITON:
    _forward_op = register_triton_op(
        "triton_linear_attn", _forward, lambda qkv, num_heads, *_: _forward_outputs(qkv, num_heads)
    )
    _backward_op = register_triton_op(
        "triton_linear_attn_backward", _backward,
        lambda grad_out, qkv, state, weight, *_: _backward_outputs(qkv, weight),
    )
    _forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_linear_attn(
    qkv: torch.Tensor,
    num_heads: int,
    feature_map: str = "elu",
    eps: float = 1e-6,
    *,
    conv_weight: torch.Tensor | None = None,
    conv_bias: torch.Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal linear attention on a qkv projection, as Triton kernels (CUDA, or CPU interpreted).

    The same values as splitting ``qkv`` into heads, :func:`visattn.ops.linear_attn` and merging the heads,
    plus the locality term: ``conv_weight``'s depthwise K x K convolution of the values over the patch
    grid (zero-padded, as the linear layer's ``dwconv``) added to the patch tokens' outputs.

    Args:
        qkv: (B, N, 3 C) laid out as timm's projection (q, k, v, then heads of d = C / num_heads), fp32,
            fp16 or bf16, any strides.
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
        conv_weight: (C, 1, K, K), K odd, or None (no locality term); conv_bias: (C,) or None.
        grid: (H, W) patch grid, needed with ``conv_weight``: N = num_prefix_tokens + H W.
        rope: a constant rotation table, (N, 2 d) or (heads, N, 2 d) (:mod:`visattn.ops.rope`): phi(q) and
            phi(k) are turned in the numerator only, as :func:`visattn.ops.linear_attn` says.
    Returns:
        (B, N, C) in qkv's dtype, heads merged; computed in fp32. With autograd, gradients for qkv (one
        (B, N, 3 C) tensor) and the convolution's weight and bias.
    """
    _check_arguments(qkv, num_heads, feature_map, conv_weight, conv_bias, grid, num_prefix_tokens, rope)
    grid_h, grid_w = (0, 0) if grid is None else grid
    out, _ = _forward_op(
        qkv, num_heads, feature_map, eps, conv_weight, conv_bias, num_prefix_tokens, grid_h, grid_w, rope
    )
    return out


def triton_refusal(
    *, causal: bool, has_qk_norm: bool, qk_map: bool, rope_needs_grad: bool, head_dim: int, num_tokens: int,
    dtype: torch.dtype,
) -> str | None:
    """Why the linear layer's op cannot run on :func:`triton_linear_attn`, or None when it can (the device
    aside: :func:`visattn.ops.backends.choose_projected_linear_backend` takes this path on CUDA only)."""
    refusals = (
        (not HAS_TRITON, "the triton package is missing"),
        (causal, "causal attention"),
        (has_qk_norm, "a q/k norm between the projection and the mixing"),
        (qk_map, "a map of q and k between the projection and the mixing (the learned feature map)"),
        (rope_needs_grad, "a rope table that needs a gradient (learned frequencies)"),
        (head_dim > MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}"),
        (num_tokens > MAX_TOKENS, f"{num_tokens} tokens > {MAX_TOKENS}"),
        (dtype not in DTYPES, f"{dtype} activations"),
    )
    return next((reason for refused, reason in refusals if refused), None)


def _check_arguments(qkv, num_heads, feature_map, conv_weight, conv_bias, grid, num_prefix_tokens, rope) -> None:
    """A one-line ValueError for each input :func:`triton_linear_attn` cannot take."""
    check_triton_runs_on(OP, qkv.device)
    check_packed_qkv(qkv, num_heads, OP)
    if qkv.dtype not in DTYPES:
        raise ValueError(f"{OP}: qkv must be float32, float16 or bfloat16, got {qkv.dtype}")
    if feature_map not in FEATURE_MAP_CODES:
        raise ValueError(f"{OP}: feature_map must be one of {', '.join(FEATURE_MAP_CODES)}, got {feature_map!r}")
    c = qkv.shape[-1] // 3
    if c // num_heads > MAX_HEAD_DIM:
        raise ValueError(f"{OP}: head_dim must be at most {MAX_HEAD_DIM}, got {c // num_heads}")
    if qkv.shape[1] > MAX_TOKENS:
        raise ValueError(f"{OP}: at most {MAX_TOKENS} tokens per image, got {qkv.shape[1]}")
    if conv_weight is None and conv_bias is not None:
        raise ValueError(f"{OP}: conv_bias needs conv_weight")
    if conv_weight is not None:
        size = conv_weight.shape[-1]
        if conv_weight.shape != (c, 1, size, size) or size % 2 == 0:
            raise ValueError(f"{OP}: conv_weight must be ({c}, 1, K, K) with K odd, got {tuple(conv_weight.shape)}")
        if conv_bias is not None and conv_bias.shape != (c,):
            raise ValueError(f"{OP}: conv_bias must be ({c},), got {tuple(conv_bias.shape)}")
        if grid is None:
            raise ValueError(f"{OP}: conv_weight needs the patch grid (H, W)")
        check_grid(grid, qkv.shape[1], num_prefix_tokens, OP)
    if rope is not None:
        check_rope_table(split_qkv(qkv, num_heads)[0], rope, OP)
        if (c // num_heads) % 2:
            raise ValueError(f"{OP}: rope turns pairs of channels; head_dim={c // num_heads} must be even")
        if rope.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{OP}: the rope table needs a gradient (learned frequencies); this path takes a constant one"
            )
    for name, t in (("conv_weight", conv_weight), ("conv_bias", conv_bias), ("rope", rope)):
        if t is not None and t.device != qkv.device:
            raise ValueError(f"{OP}: {name} must be on qkv's device {qkv.device}, got {t.device}")
