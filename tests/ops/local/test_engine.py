"""The tiled engine of the local ops: its chunked inference path, its differentiable gathered path and
its dense path (all tokens, the windows as a mask) agree with each other and with the explicit-mask
twins, prefix tokens included. Each path is forced: on these small grids the engine itself would choose
the dense one."""
from __future__ import annotations

import pytest
import torch

import visattn

from tests.helpers import assert_rms_close, grads_of
from visattn.ops.backends import force_backend
from visattn.ops.local import blocked_axis, chunked, engine, naive_masked_attn, neighborhood_axis, tiled_local_attn
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

# (B, heads, H, W, prefix tokens, patches see the prefix, window, head_dim)
CASES = [
    (1, 2, 9, 7, 0, False, ("neighborhood", 3, 4), 8),
    (2, 3, 7, 5, 1, False, ("neighborhood", 5, 3), 8),  # tiles cut by both grid edges
    (2, 2, 12, 10, 2, True, ("neighborhood", 7, 8), 16),  # longformer: patches see the prefix tokens
    (1, 2, 5, 9, 3, False, ("sparse", 3, 1), 8),
    (2, 1, 8, 11, 1, True, ("sparse", 4, 2), 8),
    (1, 3, 6, 6, 0, False, ("sparse", 2, 0), 8),
]
IDS = [f"B{b}-H{h}-grid{gh}x{gw}-p{p}-{'global' if vis else 'local'}-{w[0]}{w[1]}-{w[2]}-d{d}" for b, h, gh, gw, p, vis, w, d in CASES]


def _plans(window, grid):
    kind, size, extra = window
    if kind == "neighborhood":
        return [neighborhood_axis(length, size, extra, torch.device("cpu")) for length in grid]
    return [blocked_axis(length, size, extra, torch.device("cpu")) for length in grid]


def _reference(q, k, v, window, grid, p, prefix_visible):
    kind, size, extra = window
    allowed = torch.zeros(q.shape[2], q.shape[2], dtype=torch.bool)
    allowed[:p] = True  # prefix queries see every token
    allowed[p:, :p] = prefix_visible
    allowed[p:, p:] = neighborhood_mask(grid, size) if kind == "neighborhood" else sparse_mask(grid, size, extra)
    return naive_masked_attn(q, k, v, allowed)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 64)  # one tile per chunk: many chunks per call


@pytest.mark.parametrize("b,heads,gh,gw,p,prefix_visible,window,d", CASES, ids=IDS)
def test_inference_and_training_paths_match_reference(b, heads, gh, gw, p, prefix_visible, window, d, small_chunks):
    n = p + gh * gw
    q, k, v = (torch.randn(b, heads, n, d) for _ in range(3))
    rows, cols = _plans(window, (gh, gw))

    def engine(q, k, v):
        return tiled_local_attn(q, k, v, rows, cols, num_prefix_tokens=p, prefix_visible=prefix_visible)

    expected, expected_grads = grads_of(lambda q, k, v: _reference(q, k, v, window, (gh, gw), p, prefix_visible), q, k, v)
    for path in ("gathered", "dense"):  # the differentiable paths
        with force_backend("local", path):
            trained, grads = grads_of(engine, q, k, v)
        assert_rms_close(trained, expected, 1e-5, f"{path} path")
        for name, g, g_ref in zip("qkv", grads, expected_grads):
            assert_rms_close(g, g_ref, 1e-5, f"{path} path: d{name}")
    with torch.no_grad(), force_backend("local", "chunked"):
        inferred = engine(q, k, v)
    assert_rms_close(inferred, expected, 1e-5, "chunked path")


def test_chunked_path_with_chunks_of_whole_images(monkeypatch):
    """A budget of two images and a bit: five images run as chunks of 2, 2 and 1 whole images."""
    b, heads, grid, p, window, d = 5, 2, (7, 5), 1, ("neighborhood", 3, 4), 8
    q, k, v = (torch.randn(b, heads, p + grid[0] * grid[1], d) for _ in range(3))
    rows, cols = _plans(window, grid)
    planned = []

    def recording(seqs, batch, values_per_seq, budget):
        planned.append((seqs.num_seqs * values_per_seq, chunked_pieces(seqs, batch, values_per_seq, budget)))
        return planned[-1][1]

    chunked_pieces = chunked._chunk_pieces
    monkeypatch.setattr(chunked, "_chunk_pieces", recording)
    monkeypatch.setattr(chunked, "_chunks", chunked._chunks.__wrapped__)  # uncached: every call plans afresh
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 1 << 40)  # first, one chunk: to read the values per image
    with torch.no_grad(), force_backend("local", "chunked"):
        tiled_local_attn(q, k, v, rows, cols, p)
        per_image = planned[-1][0]
        monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 2 * per_image + 1)
        out = tiled_local_attn(q, k, v, rows, cols, p)
    assert [(images.start, images.stop) for images, _ in planned[-1][1]] == [(0, 2), (2, 4), (4, 5)]
    assert_rms_close(out, _reference(q, k, v, window, grid, p, False), 1e-5, "chunked path")


@pytest.mark.parametrize("b,heads,gh,gw,p,prefix_visible,window,d", CASES[1:3], ids=IDS[1:3])
def test_chunked_path_bf16_and_autocast(b, heads, gh, gw, p, prefix_visible, window, d, small_chunks):
    n = p + gh * gw
    q, k, v = (torch.randn(b, heads, n, d) for _ in range(3))
    rows, cols = _plans(window, (gh, gw))
    expected = _reference(q, k, v, window, (gh, gw), p, prefix_visible)
    with torch.no_grad(), force_backend("local", "chunked"):
        out = tiled_local_attn(*(t.bfloat16() for t in (q, k, v)), rows, cols, p, prefix_visible)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_out = tiled_local_attn(q, k, v, rows, cols, p, prefix_visible)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), expected, 2e-2, "bf16")
    assert_rms_close(autocast_out.float(), expected, 2e-2, "autocast")


@pytest.mark.parametrize("path,grad", [("chunked", False), ("gathered", True), ("dense", False), ("dense", True)])
def test_output_is_token_major(path, grad):
    """Merging the heads of the output (the layer's next step) is a view, not a copy, on every path and
    whatever the layout of q, k, v (here head-major)."""
    q, k, v = (torch.randn(2, 3, 1 + 6 * 5, 8) for _ in range(3))
    rows, cols = _plans(("neighborhood", 3, 4), (6, 5))
    with torch.set_grad_enabled(grad), force_backend("local", path):
        out = tiled_local_attn(*(t.requires_grad_(grad) for t in (q, k, v)), rows, cols, 1)
    merged = out.transpose(1, 2).reshape(2, 31, 24)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None


def test_layouts_are_cached():
    rows, cols = _plans(("neighborhood", 5, 4), (9, 7))
    assert neighborhood_axis(9, 5, 4, torch.device("cpu")) is rows
    first = engine._tile_layout(rows, cols, 1, False, torch.float32)
    assert engine._tile_layout(rows, cols, 1, False, torch.float32) is first
    assert engine._tile_layout(rows, cols, 1, False, torch.bfloat16) is not first  # the mask is per dtype


@pytest.mark.parametrize("p", [0, 2], ids=["p0", "p2"])
@pytest.mark.parametrize("window", [("neighborhood", 1, 4), ("sparse", 1, 0)], ids=["k1", "b1-halo0"])
def test_a_window_of_one_key_returns_v_exactly(window, p):
    q, k, v = (torch.randn(2, 2, p + 5 * 6, 8) for _ in range(3))
    rows, cols = _plans(window, (5, 6))
    out, (dq, dk, dv) = grads_of(lambda q, k, v: tiled_local_attn(q, k, v, rows, cols, p), q, k, v)
    assert torch.equal(out[:, :, p:], v[:, :, p:])
    with torch.no_grad():
        assert torch.equal(tiled_local_attn(q, k, v, rows, cols, p)[:, :, p:], v[:, :, p:])
    assert torch.count_nonzero(dq[:, :, p:]) == 0  # a softmax over one key has no gradient
    if p == 0:
        assert torch.count_nonzero(dk) == 0


@pytest.mark.parametrize("evaluate,train", [("chunked", "gathered"), ("dense", "dense")])
@pytest.mark.parametrize("name", ["neighborhood", "sparse", "longformer"])
def test_training_after_an_inference_mode_forward(name, evaluate, train):
    """The cached plans and masks of an evaluation under torch.inference_mode never reach a training step:
    a validate-then-train loop runs, and the gradients equal those of a fresh layer."""
    grid, p = (6, 7), 1
    x = torch.randn(2, p + grid[0] * grid[1], 16)

    def layer() -> torch.nn.Module:
        torch.manual_seed(0)
        m = visattn.get_attention(name)(16, num_heads=2, **({"block_size": 3} if name == "sparse" else {}))
        m.set_grid(grid, p)
        return m

    evaluated, fresh = layer(), layer()
    with torch.inference_mode(), force_backend("local", evaluate):
        evaluated(x)
    grads = []
    for m in (evaluated, fresh):
        with force_backend("local", train):
            m(x).square().sum().backward()
        grads.append([t.grad for t in m.parameters()])
    for g, g_ref in zip(*grads):
        torch.testing.assert_close(g, g_ref)


def test_a_window_of_one_key_applies_dropout():
    """Dropout on the single softmax weight: each output is 0 or v / (1 - p), and not all of them v."""
    q, k, v = (torch.randn(2, 2, 5 * 6, 8) for _ in range(3))
    rows, cols = _plans(("neighborhood", 1, 2), (5, 6))
    torch.manual_seed(0)
    out = tiled_local_attn(q, k, v, rows, cols, 0, dropout_p=0.5)
    kept = (out != 0).all(dim=-1, keepdim=True)
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(out, torch.where(kept, v / 0.5, torch.zeros_like(v)))
