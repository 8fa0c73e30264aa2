"""Which path an op with several runs: a named choice, overridable, logged.

Each op with several paths (:data:`BACKENDS`) picks one with a ``choose_<op>_backend`` function below,
from the shapes, the device and the autograd / compile state. The device is an argument, not read off a
tensor, so that the cost model (:mod:`visattn.layers.cost`) asks the same function which path an op would
take on a device it does not run on. A caller overrides the choice with the op's ``backend=`` argument, or
for every call inside a block (a model's layers included) with::

    with visattn.ops.backends.force_backend("axial", "sdpa"):
        model(images)

The first time an op runs on a given path, the logger ``visattn.ops.backends`` says so at DEBUG
level, with whether the path was chosen, forced or requested.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from visattn.ops.triton_support import triton_runs_on

_log = logging.getLogger(__name__)

BACKENDS: dict[str, tuple[str, ...]] = {
    # visattn.ops.linear_attn: the blocked autograd function (non-causal, CPU), plain batched matmuls
    # (non-causal; other devices, and what a compiler fuses), the plain matmuls recomputed in the backward
    # (non-causal training off the CPU: keeps q, k, v instead of their fp32 feature maps), the chunked
    # causal product (causal)
    "linear": ("blocked", "plain", "plain_checkpoint", "chunk"),
    # visattn.ops.decayed_linear_attn: gradients by running the tiled product again (each gradient is one
    # such product; training keeps only its inputs), or by autograd through the tiled product (faster; on a
    # grid of several tiles it keeps about as much as a d x d state per token and head)
    "decayed_linear": ("rerun", "autograd"),
    # visattn.ops.linear.projected_linear_attn, the linear layer's qkv projection + mixing: fused block by
    # block (inference), the blocked op on the packed projection (training), the projection split into
    # heads, then linear_attn, or Triton kernels on the projection with the locality term inside
    # (visattn.ops.linear.triton; CUDA, or the CPU interpreted)
    "projected_linear": ("fused_qkv", "packed", "split", "triton"),
    # visattn.ops.axial_attn: the CPU's fused SDPA kernels with a hand-written backward, plain SDPA
    # (autograd through it), plain SDPA recomputed in the backward (activation checkpointing), or Triton
    # kernels on strided views of the qkv projection, copying nothing (visattn.ops.axial.triton; CUDA, or
    # the CPU interpreted)
    "axial": ("cpu_kernels", "sdpa", "sdpa_checkpoint", "triton"),
    # the tiled engine of the local ops: tiles a chunk at a time into cache-sized buffers (no autograd),
    # all tiles gathered at once (differentiable), attention over all tokens with the windows as a mask,
    # FlexAttention's block-sparse kernel over the tokens in tile order (visattn.ops.local.flex; CUDA), or
    # fused Triton kernels on 2D query tiles computing each window from its position (visattn.ops.local.triton;
    # CUDA, or the CPU interpreted)
    "local": ("chunked", "gathered", "dense", "flex", "triton"),
}

_forced: dict[str, str] = {}
_logged: set[tuple[str, str, str]] = set()


def _check_name(op: str, name: str) -> None:
    if name not in BACKENDS[op]:
        raise ValueError(f"{op}: backend must be one of {', '.join(BACKENDS[op])}, got {name!r}")


@contextmanager
def force_backend(op: str, name: str) -> Iterator[None]:
    """Runs every call of ``op`` inside the block on the path ``name`` (an explicit ``backend=``
    argument still wins). Not thread-local: meant for tests, benchmarks and debugging."""
    if op not in BACKENDS:
        raise ValueError(f"force_backend: op must be one of {', '.join(BACKENDS)}, got {op!r}")
    _check_name(op, name)
    previous = _forced.get(op)
    _forced[op] = name
    try:
        yield
    finally:
        if previous is None:
            del _forced[op]
        else:
            _forced[op] = previous


def select_backend(op: str, backend: str | None, choose: Callable[[], str]) -> str:
    """The path ``op`` runs: ``backend`` if given, else the one forced by :func:`force_backend`, else
    ``choose()``. Logged at DEBUG the first time each (op, path, how) occurs."""
    if backend is not None:
        name, how = backend, "requested"
    elif op in _forced:
        name, how = _forced[op], "forced"
    else:
        name, how = choose(), "chosen"
    _check_name(op, name)
    if not torch.compiler.is_compiling() and (op, name, how) not in _logged:  # a compiled graph logs nothing
        _logged.add((op, name, how))
        _log.debug("%s: %s backend (%s)", op, name, how)
    return name


def planned_backend(op: str, choose: Callable[[], str]) -> str:
    """The path ``op`` would take, for the cost model: the one forced by :func:`force_backend`, else
    ``choose()``. Unlike :func:`select_backend` it logs nothing, since nothing runs."""
    return _forced.get(op) or choose()


def _log_passed_over(op: str, name: str, reason: str) -> None:
    """Logs at DEBUG, once per (op, path, reason), why a chooser passed over a path it prefers."""
    key = (op, name, reason)
    if not torch.compiler.is_compiling() and key not in _logged:
        _logged.add(key)
        _log.debug("%s: %s backend passed over: %s", op, name, reason)


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a result computed from ``tensors`` will be differentiated."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _eager_on_cpu(device: torch.device) -> bool:
    """Whether an op on ``device`` runs on the CPU outside a compiled graph: where the cache-blocked CPU paths run."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def choose_linear_backend(
    device: torch.device, causal: bool, rope_needs_grad: bool = False, needs_grad: bool = False
) -> str:
    """Causal: the chunked product. Non-causal on the CPU: the blocked autograd function, whose
    cache-sized blocks pay on a CPU and whose backward recomputes the feature maps (and their turns by a
    rope table) instead of keeping them. Elsewhere, inside a compiled graph and with a rope table that
    needs a gradient (``rope_needs_grad``: learned frequencies while training, which the blocked function
    treats as constant): the plain batched matmuls, which GPU kernels run whole and a compiler fuses with
    the feature maps; in eager training off the CPU (``needs_grad``) recomputed in the backward, since
    autograd would keep about six fp32 copies of (B, heads, N, d) per layer for it (at 2048 px in bf16,
    ViT-S batch 16: more than an 80 GB GPU holds) and the recomputation costs one more forward of the op,
    a few percent of a block."""
    if causal:
        return "chunk"
    if needs_grad and device.type != "cpu" and not torch.compiler.is_compiling():
        return "plain_checkpoint"
    return "plain" if rope_needs_grad or not _eager_on_cpu(device) else "blocked"


def choose_decayed_linear_backend(single_tile: bool) -> str:
    """Autograd through the tiled product where what it keeps is small, on a grid of a single tile (its
    N x N scores, N at most the tile's area), and inside a compiled graph (the compiler does not trace the
    rerun's forward-mode derivative); elsewhere the product run again in the backward, which keeps no
    d x d state per token."""
    return "autograd" if single_tile or torch.compiler.is_compiling() else "rerun"


def choose_projected_linear_backend(
    device: torch.device,
    causal: bool,
    has_qk_norm: bool,
    rotated: bool = False,
    learned_map: bool = False,
    *,
    triton_refusal: str | None = "not checked by the caller",
) -> str:
    """The path of :func:`visattn.ops.linear.projected_linear_attn`. On CUDA, the Triton kernels, which read
    q, k, v in place from the projection, write the output token-major and add the locality term inside,
    unless ``triton_refusal`` says why they cannot run the call (:func:`visattn.ops.linear.triton.triton_refusal`:
    causal, a q/k norm or map, a rope table that needs a gradient, ...); the reason is logged at DEBUG and
    the rules below apply. Causal, compiled, off the CPU (the fused and packed paths walk the CPU's
    cache-sized blocks), ``rotated`` (rope, which linear_attn applies from a table of the split heads) or
    ``learned_map`` (a learned feature map, a per-head matrix applied to the split q and k): split the
    projection and call linear_attn. Without autograd, fuse the projection with
    the mixing. With autograd and no q/k norm, run on the packed projection (its gradient comes back in
    one piece); a q/k norm sits between projection and mixing, so then split."""
    if device.type == "cuda":
        if triton_refusal is None:
            return "triton"
        _log_passed_over("projected_linear", "triton", triton_refusal)
    if causal or rotated or learned_map or not _eager_on_cpu(device):
        return "split"
    if not torch.is_grad_enabled():
        return "fused_qkv"
    return "split" if has_qk_norm else "packed"


def cpu_kernels_apply(device: torch.device, dropout_p: float) -> bool:
    """Whether axial's hand-written backward on the CPU's fused kernels can run: on the CPU, no
    dropout (the kernels drop nothing) and no autocast (they would run in fp32)."""
    return device.type == "cpu" and not dropout_p and not torch.is_autocast_enabled("cpu")


def choose_axial_backend(
    device: torch.device, dropout_p: float, needs_grad: bool, triton_fits: bool = True
) -> str:
    """On CUDA without dropout, where Triton is installed and the grid, prefix tokens and head dim fit
    its kernels' tiles (``triton_fits``: :func:`visattn.ops.axial.triton.triton_fits`): the Triton
    kernels, which read q, k, v in place from the qkv projection and write the output token-major, where
    SDPA's path copies the prefix keys in front of every row and column, the columns themselves and the
    output; with or without autograd, compiled or not (provisional until a GPU run has timed it against
    SDPA). Else without autograd, in a compiled graph (the compiler fuses the plain formulation) or off
    the CPU (the device's fused kernels keep their log-sum-exps for their own backward): plain SDPA. On
    the CPU with autograd: the CPU kernels where they apply and SDPA's fused (flash) backend is enabled
    (``torch.nn.attention.sdpa_kernel`` can select another), else SDPA recomputed in the backward, which
    keeps only q, k and v."""
    if device.type == "cuda" and not dropout_p and triton_fits and triton_runs_on(device):
        return "triton"
    if not needs_grad or not _eager_on_cpu(device):
        return "sdpa"
    if cpu_kernels_apply(device, dropout_p) and torch.backends.cuda.flash_sdp_enabled():  # read on every device
        return "cpu_kernels"
    return "sdpa_checkpoint"


def choose_local_backend(
    device: torch.device,
    needs_grad: bool,
    dropout_p: float,
    self_only: bool,
    dense_cheaper: bool,
    full_blocks: bool = False,
) -> str:
    """A window of one key: gathered (exact there). Where the windows cover enough of the grid that
    attention over all tokens costs no more than the tiles (short sequences: a 7 x 7 window on 14 x 14
    patches), dense, on any device: a block-sparse kernel has no empty block to skip there and would
    compile for every shape. Else on CUDA without dropout, triton: fused kernels that read q, k, v in
    place, score each query tile's key region and mask it by the windows computed from the cells'
    positions, with no permutation of the tokens and no mask table; where Triton is missing, flex:
    FlexAttention's compiled block-sparse kernel, which computes only the blocks the windows reach (but
    evaluates a table-driven mask in each) where the gathered tiles send SDPA to its masked kernels; with
    dropout (neither has it), gathered. On the CPU when no autograd, dropout or compiled graph needs the
    whole computation at once, chunk by chunk; elsewhere gathered: one batched SDPA over all tiles, the
    shape GPU kernels and the compiler want. (FlexAttention ships with every torch this package accepts,
    so it needs no availability check.) Provisional on CUDA until the GPU benchmark has measured triton
    against flex and dense. Windows that are whole FlexAttention blocks (``full_blocks``, the tile-aligned
    options: :func:`visattn.ops.local.flex.full_block_tile`) take flex on CUDA without dropout even where
    Triton runs: every block it keeps is full, computed without a mask."""
    if self_only:
        return "gathered"
    if dense_cheaper:
        return "dense"
    if device.type == "cuda" and not dropout_p:
        return "triton" if triton_runs_on(device) and not full_blocks else "flex"
    if needs_grad or dropout_p or not _eager_on_cpu(device):
        return "gathered"
    return "chunked"
