"""The memory each type's token mixing keeps on the paths its op takes on a device
(:meth:`visattn.layers.GridAttention.mixing_memory_on`): the CPU's figures unchanged, FlexAttention's
tensors for the local types on CUDA."""
from __future__ import annotations

import pytest
import torch

import visattn
from visattn.layers import attention_options, get_attention
from visattn.layers.cost import MixingMemory, TokenLayout

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device is only named here: nothing runs on CUDA


@pytest.mark.parametrize("attn", visattn.list_attentions())
@pytest.mark.parametrize("grid, p", [((14, 14), 1), ((20, 24), 2), ((64, 64), 1)], ids=["14x14-p1", "20x24-p2", "64x64-p1"])
def test_on_the_cpu_every_type_states_its_cpu_figures(attn, grid, p):
    layer, layout = get_attention(attn), TokenLayout(grid, p)
    options = attention_options(attn, {}, grid)
    cpu = layer.mixing_memory_on(CPU, layout, 6, 64, options, 2)
    assert cpu == layer.mixing_memory(layout, 6, 64, options, 2)


# Windows small enough on a 20 x 24 grid that FlexAttention is chosen (not the dense path of short sequences)
LOCAL = [
    ("neighborhood", {"kernel_size": 3, "tile_size": 2}),
    ("sparse", {"block_size": 4, "halo": 1}),
    ("longformer", {"kernel_size": 3, "tile_size": 2}),
    ("longformer", {"local": "sparse", "block_size": 4, "halo": 1, "num_extra_global_tokens": 127}),
]
LOCAL_IDS = [name + "".join(f"-{key}{value}" for key, value in opts.items()) for name, opts in LOCAL]


@pytest.mark.parametrize("attn, opts", LOCAL, ids=LOCAL_IDS)
def test_a_local_type_on_cuda_counts_flex_attention_and_no_gathered_copies(attn, opts):
    """20 x 24 patches after 2 prefix tokens, 2 heads of 8, 2-byte activations. FlexAttention runs over the
    tokens in tile order: the global tokens (the 2 prefix tokens, plus 127 learned ones for the last
    longformer) padded to whole blocks of 128 slots, then the grid in tiles of 8 x 16 (128 slots; 16 wide
    since the grid is at least 16 wide), padded to 24 x 32 = 768 slots. It keeps q, k, v in that order and
    its output (4 x slots x 16 channels x 2 bytes) and an fp32 log-sum-exp per slot and head (2 x 4 bytes);
    nothing per tile, and no mask."""
    layout = TokenLayout((20, 24), 2)
    options = attention_options(attn, opts, layout.grid)
    global_tokens = 2 + options.get("num_extra_global_tokens", 0)
    slots = (128 if global_tokens <= 128 else 256) + 24 * 32
    kept = 4 * slots * 16 * 2 + 2 * 4 * slots
    cuda = get_attention(attn).mixing_memory_on(CUDA, layout, 2, 8, options, 2)
    assert cuda == MixingMemory(infer=kept, train=kept, shared=0)
    cpu = get_attention(attn).mixing_memory_on(CPU, layout, 2, 8, options, 2)
    assert cpu.train > cuda.train and cpu.shared > 0  # the gathered tiles and their mask


def test_a_local_type_on_cuda_keeps_the_tiles_where_the_dense_path_runs():
    """7 x 7 windows on 14 x 14 patches: the engine takes the dense path on every device, which the
    estimate leaves to the tiles' figures, as on the CPU."""
    layout, options = TokenLayout((14, 14), 1), attention_options("neighborhood", {}, (14, 14))
    layer = get_attention("neighborhood")
    assert layer.mixing_memory_on(CUDA, layout, 6, 64, options, 2) == layer.mixing_memory(layout, 6, 64, options, 2)
