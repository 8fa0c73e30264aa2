"""The blocks of a model with local attention on FlexAttention keep the tokens in tile order between the layers
(:mod:`visattn.models.tile_order`): the same function as every layer permuting for itself, and raster order
wherever a layer would not take FlexAttention with the same slots or the layout pads.

FlexAttention has no backward on the CPU, so the CPU tests run inference (flex forced: it is chosen on CUDA
only) and the gradients are compared in the ``cuda`` test. Kept and permuted per layer, the same arithmetic
runs on the same tokens, only gathered at other times: the outputs differ by no more than fp32's rounding of
sums in another order, 1e-6 relative RMS (the tests of the paths against each other allow 1e-5 for their
different sums)."""
from __future__ import annotations

import copy
import threading

import pytest
import timm
import torch
import torch.nn as nn

import visattn
from tests.helpers import assert_rms_close
from visattn.layers.local import restore_tile_ordered, set_tile_ordered
from visattn.models.tile_order import TileOrderBlocks, shared_tile_layout
from visattn.ops import backends
from visattn.ops.backends import force_backend
from visattn.ops.local import flex_layout, planned_local_backend
from visattn.ops.neighborhood import neighborhood_plans

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (attn, attn_kwargs, grid, model keywords), each a layout without padding: the tile-aligned options on grids of
# whole 8 x 16 tiles (the prefix tokens run apart), exact windows without a prefix token on grids of whole tiles
CASES = [
    ("neighborhood", {"tile_aligned": True}, (16, 32), {"reg_tokens": 1}),
    ("sparse", {"tile_aligned": True, "halo": 0}, (16, 16), {}),
    ("neighborhood", {"kernel_size": 5}, (16, 16), {"class_token": False, "global_pool": "avg"}),
    ("sparse", {"block_size": 4, "halo": 2}, (8, 32), {"class_token": False, "global_pool": "avg"}),
]
IDS = [f"{attn}-{'aligned' if opts.get('tile_aligned') else 'exact'}-grid{g[0]}x{g[1]}" for attn, opts, g, _ in CASES]
SAME_ARITHMETIC = 1e-6  # module docstring


def _model(attn, attn_kwargs, grid, depth=2, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "visattn_vit_tiny_patch16", img_size=(grid[0] * 16, grid[1] * 16), num_classes=5, depth=depth, attn=attn,
        attn_kwargs=attn_kwargs, **kwargs,
    ).eval()


def _image(grid, batch=2) -> torch.Tensor:
    return torch.randn(batch, 3, grid[0] * 16, grid[1] * 16)


def _orders_seen(model: nn.Module, image: torch.Tensor) -> list[str]:
    """The token order each block's attention reads in one forward."""
    seen = []
    hooks = [block.attn.register_forward_pre_hook(lambda layer, _: seen.append(layer.token_order))
             for block in model.blocks if hasattr(block, "attn")]
    with torch.no_grad():
        model(image)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("attn,attn_kwargs,grid,kwargs", CASES, ids=IDS)
def test_tile_order_is_the_function_of_raster_order(attn, attn_kwargs, grid, kwargs):
    model = _model(attn, attn_kwargs, grid, **kwargs)
    assert isinstance(model.blocks, TileOrderBlocks)
    image = _image(grid)
    with force_backend("local", "flex"), torch.no_grad():
        kept = model(image)
        assert _orders_seen(model, image) == ["tile", "tile"]
        model.blocks.keep_tile_order = False
        permuted_per_layer = model(image)
        assert _orders_seen(model, image) == ["raster", "raster"]
    assert [layer.token_order for layer in (block.attn for block in model.blocks)] == ["raster", "raster"]
    assert_rms_close(kept, permuted_per_layer, SAME_ARITHMETIC, "tile order kept vs permuted per layer")
    with torch.no_grad():
        default_path = model(image)  # the CPU's own path, raster order
    assert_rms_close(kept, default_path, 1e-5, "tile order vs the CPU path")


def test_raster_order_where_the_layers_would_not_share_unpadded_slots():
    """Mixed slots (an exact window pads the prefix tokens to a block, a tile-aligned one runs them apart), a
    padded layout (a grid of 13 x 21, not whole tiles; an exact window after a class token), rope, the CPU's own
    path and a forced path other than flex keep the tokens in raster order."""
    grid = (16, 32)
    image = _image(grid, batch=1)
    mixed = _model(["neighborhood", "sparse"], {"sparse": {"tile_aligned": True}}, grid)
    ragged = _model("neighborhood", {"tile_aligned": True}, (13, 21))
    class_token = _model("neighborhood", {}, grid)
    rope = _model("neighborhood", {"rope": "axial", "tile_aligned": True}, grid)
    with force_backend("local", "flex"):
        for model in (mixed, class_token, rope):
            assert _orders_seen(model, image) == ["raster", "raster"]
        assert _orders_seen(ragged, _image((13, 21), batch=1)) == ["raster", "raster"]
    aligned = _model("neighborhood", {"tile_aligned": True}, grid)
    assert _orders_seen(aligned, image) == ["raster", "raster"]  # the CPU's path is not flex
    with force_backend("local", "gathered"):
        assert _orders_seen(aligned, image) == ["raster", "raster"]
    with force_backend("local", "flex"):
        assert _orders_seen(aligned, image) == ["tile", "tile"]


def test_on_cuda_the_tile_aligned_options_plan_flex_without_padding(monkeypatch):
    """The choice the blocks ask for, made for a CUDA device without running anything (Triton there, as with
    a GPU): ViT-S/16 at 1024 px (64 x 64 patches, a class token). Tile-aligned windows plan flex, unpadded
    (the tokens stay in tile order); exact windows the Triton kernels, which read raster order; with
    dropout the SDPA tiles; on a short grid dense attention; a forced path wins."""
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    aligned = neighborhood_plans((64, 64), 7, 8, (8, 16), cpu)
    exact = neighborhood_plans((64, 64), 7, 8, None, cpu)
    short = neighborhood_plans((14, 14), 7, 8, (8, 16), cpu)
    for needs_grad in (False, True):
        assert planned_local_backend(cuda, needs_grad, 0.0, *aligned, 1, False) == "flex"
        assert planned_local_backend(cuda, needs_grad, 0.0, *exact, 1, False) == "triton"
        assert planned_local_backend(cuda, needs_grad, 0.1, *aligned, 1, False) == "gathered"
        assert planned_local_backend(cuda, needs_grad, 0.0, *short, 1, False) == "dense"
    assert flex_layout(*aligned, 1, False).num_slots == 1 + 64 * 64
    with force_backend("local", "gathered"):
        assert planned_local_backend(cuda, False, 0.0, *aligned, 1, False) == "gathered"


@pytest.mark.parametrize("attn", ["neighborhood", "sparse"])
def test_unforced_on_cuda_the_tile_aligned_options_keep_the_tile_order(attn, monkeypatch):
    """The blocks' own question, as a CUDA device would get it (the plans built on the CPU, the choice made for
    CUDA with Triton present): ViT-S/16 shapes with a class token at 1024 and 2048 px keep the tile order for
    the tile-aligned options, in training and in inference; at 224 px (dense attention) and for the exact
    windows (the Triton kernels) the blocks stay in raster order."""
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(
        "visattn.layers.local.planned_local_backend",
        lambda device, *args: planned_local_backend(torch.device("cuda"), *args),
    )
    for aligned in (True, False):
        model = _model(attn, {"tile_aligned": aligned}, (14, 14))
        layers = [block.attn for block in model.blocks]
        for side in (64, 128, 14):
            for layer in layers:
                layer.set_grid((side, side), 1)
            x = torch.empty(1, 1 + side * side, 192)
            for training in (True, False):
                model.train(training)
                layout = shared_tile_layout(layers, x)
                if aligned and side != 14:
                    assert layout is not None and layout.num_slots == 1 + side * side, (side, training)
                else:
                    assert layout is None, (aligned, side, training)


def test_threads_sharing_a_model_each_keep_their_own_order():
    """Threads A and B both wait inside their first block until the other is inside too; A then finishes its
    forward while B waits, and B goes on: B's later blocks still read tile order (an order kept on the shared
    layers would have been taken back by A's end)."""
    grid = (16, 16)
    model = _model("sparse", {"tile_aligned": True, "halo": 0}, grid)
    images = {"a": _image(grid, batch=1), "b": _image(grid, batch=1)}
    with force_backend("local", "flex"), torch.no_grad():
        expected = {name: model(image) for name, image in images.items()}
    inside = {name: threading.Event() for name in images}
    a_done = threading.Event()
    names: dict[int, str] = {}

    def wait_inside(layer, args):
        name = names[threading.get_ident()]
        inside[name].set()
        other = "b" if name == "a" else "a"
        assert inside[other].wait(timeout=60), f"thread {other} did not reach its first block"
        if name == "b":
            assert a_done.wait(timeout=60), "thread a did not finish"

    model.blocks[0].attn.register_forward_pre_hook(wait_inside)
    outputs = {}

    def run(name: str) -> None:
        names[threading.get_ident()] = name
        with torch.no_grad():  # grad mode is per thread
            outputs[name] = model(images[name])
        if name == "a":
            a_done.set()

    threads = [threading.Thread(target=run, args=(name,)) for name in images]
    with force_backend("local", "flex"):  # for every thread: what it forces is not per thread
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert sorted(outputs) == ["a", "b"]
    for name in images:
        assert_rms_close(outputs[name], expected[name], SAME_ARITHMETIC, f"thread {name}")


def test_blocks_keep_their_keys_and_paths_that_call_them_one_by_one():
    grid = (16, 32)
    model = _model("neighborhood", {"tile_aligned": True}, grid, depth=3)
    unwrapped = copy.deepcopy(model)
    unwrapped.blocks = nn.Sequential(*unwrapped.blocks)
    assert list(model.state_dict()) == list(unwrapped.state_dict())
    image = _image(grid, batch=1)
    with force_backend("local", "flex"), torch.no_grad():
        whole = model.forward_features(image)
        final, intermediates = model.forward_intermediates(image, indices=[0, 2])
    assert_rms_close(final, whole, SAME_ARITHMETIC, "blocks one by one vs tile order kept")
    assert [tuple(t.shape[-2:]) for t in intermediates] == [grid, grid]
    model.blocks.keep_tile_order = False
    first_two = model.blocks[:2]
    assert isinstance(first_two, TileOrderBlocks) and len(first_two) == 2 and not first_two.keep_tile_order


def test_convert_wraps_local_blocks_and_unwraps_the_others():
    model = _model("sparse", {"block_size": 4}, (8, 8))
    blocks = list(model.blocks)
    visattn.convert(model, "neighborhood", kernel_size=3)
    assert isinstance(model.blocks, TileOrderBlocks) and list(model.blocks) == blocks
    visattn.convert(model, "linear")
    assert type(model.blocks) is nn.Sequential and list(model.blocks) == blocks
    assert type(_model("linear", {}, (8, 8)).blocks) is nn.Sequential


def test_a_block_without_attention_runs_in_raster_order():
    grid = (16, 16)
    model = _model("sparse", {"tile_aligned": True, "halo": 0}, grid)
    model.blocks[1] = nn.Identity()
    with force_backend("local", "flex"):
        assert _orders_seen(model, _image(grid)) == ["raster"]


@pytest.mark.compile
def test_a_compiled_model_keeps_the_tile_order_in_one_graph():
    """``torch.compile(fullgraph=True)`` traces the choice, the permutations and the layers' token order
    without a graph break, and the layers read tile order there too."""
    grid = (16, 32)
    model = _model("neighborhood", {"tile_aligned": True}, grid)
    image = _image(grid)
    seen = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda layer, _: seen.append(layer.token_order))
    torch._dynamo.reset()
    with force_backend("local", "flex"), torch.no_grad():
        eager = model.forward_features(image)
        compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(image)
    assert seen == ["tile"] * 4  # eager, then traced
    assert_rms_close(compiled, eager, SAME_ARITHMETIC, "compiled vs eager")


@pytest.mark.compile
def test_a_layer_compiled_in_tile_order_is_compiled_again_for_raster_order():
    """A graph traced while the layer read tile order is not taken when another layer does and this one reads
    raster order (a guard on which layers, not only on how many)."""
    grid = (16, 16)
    model = _model("sparse", {"tile_aligned": True, "halo": 0}, grid)
    layer, other = (block.attn for block in model.blocks)
    image = _image(grid, batch=1)
    with force_backend("local", "flex"), torch.no_grad():
        model(image)  # the grid hook tells the layers their grid
        x = torch.randn(1, model.num_prefix_tokens + grid[0] * grid[1], 192)
        raster = layer(x)
        layout = layer.tile_layout(x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        previous = set_tile_ordered([layer])
        try:
            in_tiles = compiled(x.index_select(1, layout.slot_token))
        finally:
            restore_tile_ordered(previous)
        previous = set_tile_ordered([other])
        try:
            again = compiled(x)
        finally:
            restore_tile_ordered(previous)
    assert_rms_close(in_tiles.index_select(1, layout.token_slot), raster, SAME_ARITHMETIC, "tile order")
    assert_rms_close(again, raster, SAME_ARITHMETIC, "raster order after a graph traced in tile order")


@pytest.mark.cuda
@pytest.mark.parametrize("attn,attn_kwargs,grid,kwargs", CASES[:1] + CASES[2:3], ids=IDS[:1] + IDS[2:3])
def test_cuda_training_in_tile_order_matches_raster_order(attn, attn_kwargs, grid, kwargs):
    """Outputs and every parameter's gradient, FlexAttention in both (chosen for the tile-aligned option,
    forced for the exact window, whose CUDA path is the Triton kernels); each case compiles FlexAttention."""
    model = _model(attn, attn_kwargs, grid, **kwargs).cuda().train()
    image = _image(grid).cuda()

    def run(keep: bool):
        model.blocks.keep_tile_order = keep
        model.zero_grad()
        with force_backend("local", "flex"):
            out = model(image)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    (kept, kept_grads), (per_layer, per_layer_grads) = run(True), run(False)
    assert_rms_close(kept, per_layer, SAME_ARITHMETIC, "outputs")
    # a weight's gradient sums over the B N tokens, here in another order: fp32 sums of 2 x 513 or 2 x 256 terms
    # differ by about 2^-24 sqrt(B N), 2e-6 relative; 1e-5 leaves room and fails a wrong token's contribution
    for got, expected in zip(kept_grads, per_layer_grads):
        assert_rms_close(got, expected, 1e-5, "gradients")
