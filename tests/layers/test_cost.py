"""The memory each type's token mixing keeps on the paths its op takes on a device
(:meth:`visattn.layers.GridAttention.mixing_memory` of a case on that device): the CPU's figures unchanged,
the Triton kernels' tensors (FlexAttention's without Triton) for the local types on CUDA, the Triton
kernels' for axial (SDPA's where forced)."""
from __future__ import annotations

import pytest
import torch

import visattn
from tests.helpers import TRITON_ON_CPU
from visattn.layers import attention_options, get_attention
from visattn.layers.axial import AxialAttention, sdpa_train_memory, triton_train_memory
from visattn import ops
from visattn.layers.cost import CostCase, MixingMemory, TokenLayout, triton_memory
from visattn.ops.axial import packed_axial_attn
from visattn.ops.backends import force_backend
from visattn.ops.layout import split_qkv
from visattn.ops.triton_support import HAS_TRITON

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device is only named here: nothing runs on CUDA


@pytest.mark.parametrize("attn", visattn.list_attentions())
@pytest.mark.parametrize("grid, p", [((14, 14), 1), ((20, 24), 2), ((64, 64), 1)], ids=["14x14-p1", "20x24-p2", "64x64-p1"])
def test_on_the_cpu_every_type_states_its_cpu_figures(attn, grid, p):
    layer, layout = get_attention(attn), TokenLayout(grid, p)
    options = attention_options(attn, {}, grid)
    cpu = layer.mixing_memory(CostCase(layout, 6, 64, options, 2, CPU))
    assert cpu == layer.mixing_memory(CostCase(layout, 6, 64, options, 2))


# Windows small enough on a 20 x 24 grid that FlexAttention is chosen (not the dense path of short sequences)
LOCAL = [
    ("neighborhood", {"kernel_size": 3, "tile_size": 2}),
    ("sparse", {"block_size": 4, "halo": 1}),
    ("longformer", {"kernel_size": 3, "tile_size": 2}),
    ("longformer", {"local": "sparse", "block_size": 4, "halo": 1, "num_extra_global_tokens": 127}),
]
LOCAL_IDS = [name + "".join(f"-{key}{value}" for key, value in opts.items()) for name, opts in LOCAL]


@pytest.mark.parametrize("attn, opts", LOCAL, ids=LOCAL_IDS)
def test_a_local_type_on_cuda_counts_flex_attention_and_no_gathered_copies(attn, opts, monkeypatch):
    """Where Triton is missing (FlexAttention is then the CUDA path), 20 x 24 patches after 2 prefix tokens,
    2 heads of 8, 2-byte activations. FlexAttention runs over the
    tokens in tile order: the global tokens (the 2 prefix tokens, plus 127 learned ones for the last
    longformer) padded to whole blocks of 128 slots, then the grid in tiles of 8 x 16 (128 slots; 16 wide
    since the grid is at least 16 wide), padded to 24 x 32 = 768 slots. It keeps q, k, v in that order and
    its output (4 x slots x 16 channels x 2 bytes) and an fp32 log-sum-exp per slot and head (2 x 4 bytes);
    nothing per tile, and no mask."""
    monkeypatch.setattr("visattn.ops.backends.triton_runs_on", lambda device: False)
    layout = TokenLayout((20, 24), 2)
    options = attention_options(attn, opts, layout.grid)
    global_tokens = 2 + options.get("num_extra_global_tokens", 0)
    slots = (128 if global_tokens <= 128 else 256) + 24 * 32
    kept = 4 * slots * 16 * 2 + 2 * 4 * slots
    cuda = get_attention(attn).mixing_memory(CostCase(layout, 2, 8, options, 2, CUDA))
    assert cuda == MixingMemory(infer=kept, train=kept, shared=0)
    cpu = get_attention(attn).mixing_memory(CostCase(layout, 2, 8, options, 2, CPU))
    assert cpu.train > cuda.train and cpu.shared > 0  # the gathered tiles and their mask


@pytest.mark.skipif(not HAS_TRITON, reason="without Triton the local types take FlexAttention on CUDA")
@pytest.mark.parametrize("attn, opts", LOCAL, ids=LOCAL_IDS)
def test_a_local_type_on_cuda_counts_the_triton_kernels(attn, opts):
    """The same cases where Triton is installed, as here: the kernels read q, k and v in place over the
    N' = 2 + 480 tokens of the op (plus 127 learned global tokens for the last longformer) and keep, for
    the backward, the qkv projection those are views of (3 N' x 16 channels x 2 bytes), the output (N' x 32
    bytes) and an fp32 log-sum-exp per token and head (N' x 2 x 4 bytes); inference the last two."""
    layout = TokenLayout((20, 24), 2)
    options = attention_options(attn, opts, layout.grid)
    tokens = 2 + options.get("num_extra_global_tokens", 0) + 20 * 24
    out = tokens * 16 * 2 + 2 * 4 * tokens
    cuda = get_attention(attn).mixing_memory(CostCase(layout, 2, 8, options, 2, CUDA))
    assert cuda == MixingMemory(infer=out, train=out + 3 * tokens * 16 * 2, shared=0)


@TRITON_ON_CPU
@pytest.mark.parametrize("prefix_visible", [False, True], ids=["local", "global"])
def test_triton_memory_is_what_autograd_keeps(prefix_visible):
    """The ``"triton"`` path forced on the CPU (interpreted), on views of one qkv projection as the layers
    pass them: the storages saved for the backward, batch 2, fp32, are the formula's to the byte."""
    batch, heads, d, grid, p = 2, 2, 8, (5, 7), 2
    qkv = torch.randn(batch, p + grid[0] * grid[1], 3 * heads * d, requires_grad=True)

    def attend(t):
        q, k, v = split_qkv(t, heads)
        if prefix_visible:
            return ops.longformer_attn(q, k, v, grid, p, kernel_size=3)
        return ops.neighborhood_attn(q, k, v, grid, 3, num_prefix_tokens=p)

    with force_backend("local", "triton"):
        saved = _saved_bytes(attend, qkv)
    assert saved == batch * triton_memory(CostCase(TokenLayout(grid, p), heads, d, act_bytes=4), p + 35).train


def test_a_forced_local_path_is_the_one_the_estimate_counts(monkeypatch):
    """ViT-S/16 at 1024 px (64 x 64 patches, a class token, 6 heads of 64, bf16) with a 7 x 7 neighbourhood on
    CUDA: the Triton kernels' tensors by default; forced onto FlexAttention (as the benchmark's ``--backend
    local=flex`` does), FlexAttention's over its 128 + 4,096 slots (the class token padded to a block)."""
    monkeypatch.setattr("visattn.ops.backends.triton_runs_on", lambda device: True)
    layout, c = TokenLayout((64, 64), 1), 384
    case = CostCase(layout, 6, 64, attention_options("neighborhood", {}, (64, 64)), 2, CUDA)
    layer = get_attention("neighborhood")
    assert layer.mixing_memory(case) == triton_memory(case, 4097)
    with force_backend("local", "flex"):
        flex = layer.mixing_memory(case)
    kept = 4 * (128 + 4096) * c * 2 + 4 * 6 * (128 + 4096)
    assert flex == MixingMemory(infer=kept, train=kept)


def test_a_local_type_on_cuda_keeps_the_tiles_where_the_dense_path_runs():
    """7 x 7 windows on 14 x 14 patches: the engine takes the dense path on every device, for which the
    estimate counts the tiles' figures, as on the CPU: an approximation, since the dense path keeps an
    N x N additive mask instead of the gathered tiles and their mask."""
    layout, options = TokenLayout((14, 14), 1), attention_options("neighborhood", {}, (14, 14))
    layer = get_attention("neighborhood")
    cuda, cpu = (layer.mixing_memory(CostCase(layout, 6, 64, options, 2, device)) for device in (CUDA, CPU))
    assert cuda == cpu


def test_axial_on_sdpa_counts_what_sdpa_keeps_in_each_hop():
    """The ``"sdpa"`` path forced on CUDA (its path without Triton): 5 x 7 patches (M = 35) after P = 2
    prefix tokens (N = 37), 2 heads of 8, 2-byte activations; in elements of C = 16 channels:

    * the qkv projection, 3 N = 111 (the prefix queries' SDPA keeps k and v, views of it);
    * the row hop: q's rows copied (M = 35), k's and v's rows with the prefix keys in front, 2 H (P + W) =
      90, and its output, M = 35;
    * the column hop: q's columns copied (35), k's columns and the row output's with the prefix in front,
      2 W (P + H) = 98, and its output, 35;
    * the prefix queries' output, P = 2;

    441 x 16 x 2 bytes, plus fp32 log-sum-exps for the 35 + 35 + 2 query rows of the three SDPAs, 2 heads."""
    layout = TokenLayout((5, 7), 2)
    expected = (111 + 35 + 90 + 35 + 35 + 98 + 35 + 2) * 16 * 2 + 4 * 2 * (35 + 35 + 2)
    with force_backend("axial", "sdpa"):
        cuda = AxialAttention.mixing_memory(CostCase(layout, 2, 8, {}, 2, CUDA))
    cpu = AxialAttention.mixing_memory(CostCase(layout, 2, 8, {}, 2))
    assert cuda == cpu._replace(train=expected)  # inference takes plain SDPA on every device


def _saved_tensors(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd keeps for the backward of ``fn(*inputs)``."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return saved


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _saved_bytes(fn, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages that autograd keeps for the backward of ``fn(*inputs)``."""
    return _storage_bytes(_saved_tensors(fn, *inputs))


@pytest.mark.parametrize("grid, p", [((5, 7), 2), ((4, 6), 0)], ids=["grid5x7-p2", "grid4x6-p0"])
def test_axial_sdpa_memory_is_what_autograd_keeps(grid, p):
    """The ``"sdpa"`` path forced on the CPU, whose fused SDPA keeps what CUDA's does (q, k, v, output and
    an fp32 log-sum-exp per query row): the storages saved for the backward, batch 2, fp32, are the
    formula's to the byte."""
    batch, heads, d = 2, 2, 8
    qkv = torch.randn(batch, p + grid[0] * grid[1], 3 * heads * d, requires_grad=True)
    with force_backend("axial", "sdpa"):
        saved = _saved_bytes(lambda t: packed_axial_attn(t, heads, grid, p), qkv)
    assert saved == batch * sdpa_train_memory(CostCase(TokenLayout(grid, p), heads, d, act_bytes=4))


@pytest.mark.skipif(not HAS_TRITON, reason="without Triton axial takes SDPA on CUDA")
def test_axial_on_cuda_counts_what_the_triton_kernels_keep():
    """5 x 7 patches (M = 35) after P = 2 prefix tokens (N = 37), 2 heads of 8, 2-byte activations: the
    qkv projection (3 N) and the row hop's output (N), 4 x 37 x 16 channels x 2 bytes, plus fp32
    log-sum-exps of the 35 row and 35 column queries and the 2 prefix queries, 2 heads; no copy. A
    column longer than a program holds (257) takes SDPA."""
    layout = TokenLayout((5, 7), 2)
    expected = 4 * 37 * 16 * 2 + 4 * 2 * (35 + 35 + 2)
    cuda = AxialAttention.mixing_memory(CostCase(layout, 2, 8, {}, 2, CUDA))
    cpu = AxialAttention.mixing_memory(CostCase(layout, 2, 8, {}, 2))
    assert cuda == cpu._replace(train=expected)
    tall = CostCase(TokenLayout((257, 3), 1), 2, 8, {}, 2, CUDA)
    assert AxialAttention.mixing_memory(tall).train == sdpa_train_memory(tall)


@TRITON_ON_CPU
@pytest.mark.parametrize("grid, p", [((5, 7), 2), ((4, 6), 0)], ids=["grid5x7-p2", "grid4x6-p0"])
def test_axial_triton_memory_is_what_autograd_keeps(grid, p):
    """The ``"triton"`` path forced on the CPU (interpreted): the storages saved for the backward, batch
    2, fp32, are the formula's to the byte, plus the op's output, which the formula leaves to the block."""
    batch, heads, d = 2, 2, 8
    n = p + grid[0] * grid[1]
    qkv = torch.randn(batch, n, 3 * heads * d, requires_grad=True)
    with force_backend("axial", "triton"):
        saved = _saved_bytes(lambda t: packed_axial_attn(t, heads, grid, p), qkv)
    output = batch * n * heads * d * 4
    assert saved == batch * triton_train_memory(CostCase(TokenLayout(grid, p), heads, d, act_bytes=4)) + output


@pytest.mark.parametrize("name", ["neighborhood", "sparse"])
def test_tile_aligned_windows_count_their_tiles(name, monkeypatch):
    """40 x 80 patches, one class token, 6 heads of 64, the default 8 x 16 tiles (5 x 5 of them) and windows
    of 3 tiles per axis: the tile-aligned neighbourhood's stay 3 tiles at the borders (shifted inward), the
    sparse halo's are cut there (2 tiles). FLOPs: 4 C per (query, key) pair, the class token's N pairs
    included. Memory on CUDA: FlexAttention's tensors over the grid's 3,200 slots and the class token's row
    apart (:func:`visattn.layers.cost.flex_memory`), even where Triton runs."""
    layout, c = TokenLayout((40, 80), 1), 6 * 64
    options = attention_options(name, {"tile_aligned": True}, layout.grid)
    layer = get_attention(name)
    row_windows = [3] * 5 if name == "neighborhood" else [2, 3, 3, 3, 2]  # tiles seen by each row of tiles
    keys_seen = (8 * sum(row_windows) * 8) * (16 * sum(row_windows) * 16)
    assert layer.mixing_flops(CostCase(layout, 6, 64, options)) == 4 * c * (keys_seen + layout.num_tokens)
    monkeypatch.setattr("visattn.ops.backends.triton_runs_on", lambda device: True)
    cuda = layer.mixing_memory(CostCase(layout, 6, 64, options, 2, CUDA))
    assert cuda == MixingMemory(infer=4 * 3201 * c * 2 + 4 * 6 * 3201, train=4 * 3201 * c * 2 + 4 * 6 * 3201)


LINFORMER_MEMORY_CASES = [  # (grid, P, k, autocast): the tokens projected first (k < H W), then the keys
    ((8, 10), 1, 16, False), ((8, 10), 0, 16, False), ((8, 10), 1, 16, True), ((4, 5), 1, 24, False),
]


@pytest.mark.parametrize(
    "grid, p, k, autocast", LINFORMER_MEMORY_CASES, ids=["first-p1", "first-p0", "first-p1-bf16", "keys-p1"]
)
def test_linformer_memory_is_what_autograd_keeps(grid, p, k, autocast):
    """Batch 2, fp32 or under bf16 autocast on the CPU: the storages saved for the backward besides the layer's
    input and its parameters (the block counts those), and under autocast the bf16 casts of both (any layer's
    qkv projection keeps those; the model's estimate leaves the weights' out), are the formula's to the byte:
    the batch's share of the training figure and, once, the two projections with their prefix rows. (With a
    qkv bias the 2 (P + k) row sums that scale it are kept too, a few bytes the formula leaves out.)"""
    batch, dim, heads = 2, 32, 2
    layer = get_attention("linformer")(dim, heads, k=k, ref_grid=grid)
    layer.set_grid(grid, p)
    x = torch.randn(batch, p + grid[0] * grid[1], dim, requires_grad=True)

    def mix(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer.project_and_mix(x, grid, None, False)

    tensors = _saved_tensors(mix, x)
    # x, or a C x C block of the weight, cast to bf16
    casts = [t for t in tensors if t.dtype == torch.bfloat16 and t.shape in (x.shape, (dim, dim))]
    assert len({t.untyped_storage().data_ptr() for t in casts if t.shape == x.shape}) == int(autocast)  # x cast once
    kept_elsewhere = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters(), *casts)}
    saved = _storage_bytes([t for t in tensors if t.untyped_storage().data_ptr() not in kept_elsewhere])
    options = attention_options("linformer", {"k": k}, grid)
    case = CostCase(TokenLayout(grid, p), heads, dim // heads, options, act_bytes=2 if autocast else 4)
    memory = layer.mixing_memory(case)
    assert saved == batch * memory.train + memory.shared
