"""The blocks of a model with local attention on FlexAttention keep the tokens in tile order between the layers
(:mod:`visattn.models.tile_order`): the same function as every layer permuting for itself, and raster order
wherever a layer would not take FlexAttention with the same slots.

FlexAttention has no backward on the CPU, so the CPU tests run inference (flex forced: it is chosen on CUDA
only) and the gradients are compared in the ``cuda`` test."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn

import visattn
from tests.helpers import assert_rms_close
from visattn.models.tile_order import TileOrderBlocks, shared_tile_layout
from visattn.ops.backends import force_backend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (attn, attn_kwargs, grid, model keywords): the tile-aligned options (prefix queries apart, a ragged grid
# padded to whole tiles), an exact window (prefix tokens padded to a block), no prefix token at all
CASES = [
    ("neighborhood", {"tile_aligned": True}, (13, 21), {"reg_tokens": 1}),
    ("sparse", {"tile_aligned": True, "halo": 0}, (16, 32), {}),
    ("neighborhood", {"kernel_size": 5}, (11, 18), {}),
    ("sparse", {"block_size": 4, "halo": 2}, (9, 20), {"class_token": False, "global_pool": "avg"}),
]
IDS = [f"{attn}-{'aligned' if opts.get('tile_aligned') else 'exact'}-grid{g[0]}x{g[1]}" for attn, opts, g, _ in CASES]


def _model(attn, attn_kwargs, grid, depth=2, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "visattn_vit_tiny_patch16", img_size=(grid[0] * 16, grid[1] * 16), num_classes=5, depth=depth, attn=attn,
        attn_kwargs=attn_kwargs, **kwargs,
    ).eval()


def _tokens_seen(model: nn.Module, image: torch.Tensor) -> list[int]:
    """The token count each block's attention receives in one forward."""
    seen = []
    hooks = [block.attn.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1])) for block in model.blocks]
    with torch.no_grad():
        model(image)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("attn,attn_kwargs,grid,kwargs", CASES, ids=IDS)
def test_tile_order_is_the_function_of_raster_order(attn, attn_kwargs, grid, kwargs):
    model = _model(attn, attn_kwargs, grid, **kwargs)
    assert isinstance(model.blocks, TileOrderBlocks)
    image = torch.randn(2, 3, grid[0] * 16, grid[1] * 16)
    with force_backend("local", "flex"), torch.no_grad():
        kept = model(image)
        layout = shared_tile_layout([block.attn for block in model.blocks], image.new_empty(1, 1))
        assert _tokens_seen(model, image) == [layout.num_slots] * 2  # the layers read the slots...
        model.blocks.keep_tile_order = False
        permuted_per_layer = model(image)
        assert _tokens_seen(model, image) == [model.num_prefix_tokens + grid[0] * grid[1]] * 2  # ...or the tokens
    # the same arithmetic per token; only the GEMMs' blocking may differ with their row count (S or N)
    assert_rms_close(kept, permuted_per_layer, 1e-6, "tile order kept vs permuted per layer")
    with torch.no_grad():
        default_path = model(image)  # the CPU's own path, raster order
    assert_rms_close(kept, default_path, 1e-5, "tile order vs the CPU path")


def test_raster_order_where_the_layers_would_not_share_slots():
    """Mixed slots (an exact window pads the prefix tokens to a block, a tile-aligned one runs them apart),
    rope, the CPU's own path and a forced path other than flex keep the tokens in raster order."""
    grid, n = (12, 18), 1 + 12 * 18
    image = torch.randn(1, 3, grid[0] * 16, grid[1] * 16)
    mixed = _model(["neighborhood", "sparse"], {"sparse": {"tile_aligned": True}}, grid)
    rope = _model("neighborhood", {"rope": "axial"}, grid)
    with force_backend("local", "flex"):
        assert _tokens_seen(mixed, image) == [n, n]
        assert _tokens_seen(rope, image) == [n, n]
    plain = _model("neighborhood", {}, grid)
    assert _tokens_seen(plain, image) == [n, n]  # the CPU's path is not flex
    with force_backend("local", "gathered"):
        assert _tokens_seen(plain, image) == [n, n]
    with force_backend("local", "flex"):
        assert _tokens_seen(plain, image) == [plain.blocks[0].attn.tile_layout(image).num_slots] * 2


def test_blocks_keep_their_keys_and_paths_that_call_them_one_by_one():
    grid = (13, 21)
    model = _model("neighborhood", {"tile_aligned": True}, grid, depth=3)
    assert type(_model("linear", {}, grid, depth=3).blocks) is nn.Sequential  # no local layer: timm's blocks
    unwrapped = copy.deepcopy(model)
    unwrapped.blocks = nn.Sequential(*unwrapped.blocks)
    assert list(model.state_dict()) == list(unwrapped.state_dict())
    image = torch.randn(1, 3, grid[0] * 16, grid[1] * 16)
    with force_backend("local", "flex"), torch.no_grad():
        whole = model.forward_features(image)
        final, intermediates = model.forward_intermediates(image, indices=[0, 2])
    assert_rms_close(final, whole, 1e-6, "blocks one by one vs tile order kept")
    assert [tuple(t.shape[-2:]) for t in intermediates] == [grid, grid]
    assert isinstance(model.blocks[:2], TileOrderBlocks) and len(model.blocks[:2]) == 2


def test_a_second_convert_keeps_one_wrapper():
    model = _model("sparse", {"block_size": 4}, (8, 8))
    blocks = list(model.blocks)
    visattn.convert(model, "neighborhood", kernel_size=3)
    assert isinstance(model.blocks, TileOrderBlocks) and list(model.blocks) == blocks


@pytest.mark.compile
def test_a_compiled_model_keeps_the_tile_order_in_one_graph():
    """``torch.compile(fullgraph=True)`` traces the choice, the permutations and the layers' token order
    without a graph break, and the layers see the slots there too."""
    grid = (13, 21)
    model = _model("neighborhood", {"tile_aligned": True}, grid)
    image = torch.randn(2, 3, grid[0] * 16, grid[1] * 16)
    seen = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    torch._dynamo.reset()
    with force_backend("local", "flex"), torch.no_grad():
        eager = model.forward_features(image)
        compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(image)
        slots = model.blocks[0].attn.tile_layout(image).num_slots
    assert seen == [slots] * 4  # eager, then traced
    assert_rms_close(compiled, eager, 1e-6, "compiled vs eager")


@pytest.mark.cuda
@pytest.mark.parametrize("attn,attn_kwargs,grid,kwargs", CASES[::2], ids=IDS[::2])  # each compiles FlexAttention
def test_cuda_training_in_tile_order_matches_raster_order(attn, attn_kwargs, grid, kwargs):
    """Outputs and every parameter's gradient, FlexAttention in both (chosen for the tile-aligned options,
    forced for the exact windows, whose CUDA path is the Triton kernels)."""
    model = _model(attn, attn_kwargs, grid, **kwargs).cuda().train()
    image = torch.randn(2, 3, grid[0] * 16, grid[1] * 16, device="cuda")

    def run(keep: bool):
        model.blocks.keep_tile_order = keep
        model.zero_grad()
        with force_backend("local", "flex"):
            out = model(image)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    (kept, kept_grads), (per_layer, per_layer_grads) = run(True), run(False)
    assert_rms_close(kept, per_layer, 1e-5, "outputs")
    for got, expected in zip(kept_grads, per_layer_grads):
        assert_rms_close(got, expected, 1e-4, "gradients")
