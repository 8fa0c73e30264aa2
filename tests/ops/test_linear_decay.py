"""Linear attention with the Manhattan decay: the tiled op against its naive twin (explicit N x N decay),
outputs and gradients (the rates' included), on both gradient paths, and hand-checked cases."""
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import assert_rms_close, grads_of
from visattn import ops
from visattn.layers.linear import decayed_linear_flops
from visattn.ops import backends
from visattn.ops.backends import BACKENDS, force_backend
from visattn.ops.linear import decay
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.naive_decay import manhattan_decay, naive_decayed_linear_attn
from visattn.ops.rope import axial_rope, init_mixed_rope_freqs, mixed_rope

# (batch, heads, grid, prefix tokens, head_dim, tile): several tiles per axis with a partial last one, a
# single row or column, a grid of one tile, and tiles of one cell
CASES = [
    (1, 2, (5, 7), 0, 4, 2),
    (3, 3, (9, 4), 2, 5, 3),
    (1, 2, (1, 9), 1, 4, 4),
    (3, 1, (8, 1), 1, 3, 3),
    (1, 2, (3, 3), 1, 3, 16),
    (3, 2, (4, 3), 0, 2, 1),
]
CASE_IDS = [f"B{b}-H{h}-grid{g[0]}x{g[1]}-p{p}-d{d}-t{t}" for b, h, g, p, d, t in CASES]
# per head: near 0, near 1, both ends of RMT's range
GAMMAS = {"near0": (1e-3, 0.02, 0.3), "near1": (0.999, 0.98, 0.9999), "rmt": (0.75, 0.9, 0.97)}


def _inputs(batch, heads, grid, prefix, d, dtype, gammas, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    q, k, v = (torch.randn(batch, heads, n, d, generator=gen, dtype=dtype) for _ in range(3))
    return q, k, v, torch.tensor(gammas[:heads], dtype=dtype)


def _check_against_naive(case, gammas, dtype, tol, backend, feature_map="elu"):
    batch, heads, grid, prefix, d, tile = case
    inputs = _inputs(batch, heads, grid, prefix, d, dtype, gammas)
    out, grads = grads_of(
        lambda q, k, v, g: ops.decayed_linear_attn(
            q, k, v, g, grid, prefix, feature_map=feature_map, tile_size=tile, backend=backend
        ),
        *inputs,
    )
    ref, ref_grads = grads_of(
        lambda q, k, v, g: naive_decayed_linear_attn(q, k, v, g, grid, prefix, feature_map=feature_map),
        *(t.double() for t in inputs),
    )
    assert out.dtype == dtype
    assert_rms_close(out, ref, tol, "out")
    for name, g, g_ref in zip(["dq", "dk", "dv", "dgamma"], grads, ref_grads):
        assert_rms_close(g, g_ref, tol, name)


@pytest.mark.parametrize("backend", BACKENDS["decayed_linear"])
@pytest.mark.parametrize("gammas", GAMMAS.values(), ids=GAMMAS.keys())
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_naive_fp64(case, gammas, backend):
    _check_against_naive(case, gammas, torch.float64, 1e-10, backend)


@pytest.mark.parametrize("gammas", GAMMAS.values(), ids=GAMMAS.keys())
@pytest.mark.parametrize("case", CASES[:3], ids=CASE_IDS[:3])
def test_matches_naive_fp32(case, gammas):
    _check_against_naive(case, gammas, torch.float32, 2e-5, "rerun")


def test_relu_feature_map_matches_naive():
    _check_against_naive(CASES[1], GAMMAS["rmt"], torch.float64, 1e-10, "rerun", feature_map="relu")


@pytest.mark.parametrize("tile", [2, 5, 16])
def test_result_does_not_depend_on_tile_or_heads_taken_at_once(tile, monkeypatch):
    inputs = _inputs(2, 3, (7, 6), 1, 4, torch.float64, GAMMAS["rmt"])
    expected = ops.decayed_linear_attn(*inputs[:3], inputs[3], (7, 6), 1, tile_size=3)
    monkeypatch.setitem(decay.STATE_ELEMENTS, "cpu", 1)  # one (image, head) at a time
    out = ops.decayed_linear_attn(*inputs[:3], inputs[3], (7, 6), 1, tile_size=tile)
    assert_rms_close(out, expected, 1e-12, f"tile {tile}")


def test_rate_one_is_plain_linear_attention():
    q, k, v, _ = _inputs(3, 2, (6, 5), 2, 4, torch.float64, GAMMAS["rmt"])
    out = ops.decayed_linear_attn(q, k, v, torch.ones(2, dtype=torch.float64), (6, 5), 2, tile_size=4)
    assert_rms_close(out, naive_linear_attn(q, k, v), 1e-12, "gamma = 1")


def test_hand_checked_row():
    """A 1 x 3 grid, d = 1, relu(q) = relu(k) = 1: the weights are gamma ** |i - j| themselves.
    With gamma = 1/2 and v = (4, 2, 8): out_0 = (4 + 1 + 2) / (1 + 1/2 + 1/4) = 4, out_1 = (2 + 2 + 4) / 2 = 4,
    out_2 = (1 + 1 + 8) / 1.75 = 40/7. At gamma = 1 each is the mean, 14/3."""
    q = k = torch.ones(1, 1, 3, 1, dtype=torch.float64)
    v = torch.tensor([4.0, 2.0, 8.0], dtype=torch.float64).view(1, 1, 3, 1)
    for gamma, expected in ((0.5, [4.0, 4.0, 40 / 7]), (1.0, [14 / 3] * 3)):
        out = ops.decayed_linear_attn(q, k, v, torch.tensor([gamma], dtype=torch.float64), (1, 3), feature_map="relu")
        torch.testing.assert_close(out.flatten(), torch.tensor(expected, dtype=torch.float64))


def test_hand_checked_prefix_token_is_not_decayed():
    """A class token and a 2 x 2 grid, all phi(q).phi(k) = 1, gamma = 1/2: a patch weighs itself 1, its two
    neighbours 1/2, the opposite corner 1/4 and the class token 1; the class token weighs every token 1."""
    q = k = torch.ones(1, 1, 5, 1, dtype=torch.float64)
    v = torch.tensor([10.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 5, 1)
    out = ops.decayed_linear_attn(q, k, v, torch.tensor([0.5], dtype=torch.float64), (2, 2), 1, feature_map="relu")
    first_patch = (10 + 1 + 0.5 * (2 + 3) + 0.25 * 4) / (1 + 1 + 0.5 + 0.5 + 0.25)
    torch.testing.assert_close(out[0, 0, 0, 0], torch.tensor(20 / 5, dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 1, 0], torch.tensor(first_patch, dtype=torch.float64))


def test_rate_zero_leaves_each_patch_alone():
    q, k, v, _ = _inputs(2, 2, (4, 5), 0, 3, torch.float64, GAMMAS["rmt"])
    out = ops.decayed_linear_attn(q, k, v, torch.zeros(2, dtype=torch.float64), (4, 5), tile_size=2)
    torch.testing.assert_close(out, v)


def test_manhattan_decay_weights():
    weights = manhattan_decay(torch.tensor([0.5]), (2, 3), num_prefix_tokens=1)[0]
    assert weights.shape == (7, 7)
    assert (weights[0] == 1).all() and (weights[:, 0] == 1).all()
    # patch (0, 0) against (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)
    torch.testing.assert_close(weights[1, 1:], torch.tensor([1, 0.5, 0.25, 0.5, 0.25, 0.125]))


def test_bf16_and_autocast_compute_in_fp32():
    q, k, v, gamma = _inputs(2, 3, (5, 6), 1, 8, torch.float32, GAMMAS["rmt"])
    expected = naive_decayed_linear_attn(q, k, v, gamma, (5, 6), 1)
    out = ops.decayed_linear_attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), gamma, (5, 6), 1, tile_size=4)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), expected, 2e-2, "bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.decayed_linear_attn(q, k, v, gamma, (5, 6), 1, tile_size=4)
    assert out.dtype == torch.float32
    assert_rms_close(out, expected, 1e-5, "fp32 inputs under autocast stay fp32")


def test_training_keeps_nothing_of_size_tokens_times_d_squared():
    """The rerun path saves q, k, v and a few (N, d + 1) tensors; one d x (d + 1) state per token would be
    (d + 1) / 16 times more than the bound checked here."""
    batch, heads, grid, d = 1, 2, (32, 32), 32
    n = 1 + grid[0] * grid[1]
    q, k, v = (torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3))
    gamma = torch.full((heads,), 0.9, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.decayed_linear_attn(q, k, v, gamma, grid, 1, backend="rerun")
    assert sum(saved.values()) < 16 * batch * heads * n * (d + 1) * 4


@pytest.mark.parametrize("grid, prefix, d, tile", [((5, 7), 0, 4, 2), ((9, 4), 2, 5, 3), ((1, 9), 1, 4, 4), ((8, 1), 1, 4, 3), ((20, 33), 1, 8, 16)])
def test_flop_formula_matches_the_flop_counter(grid, prefix, d, tile):
    heads = 2
    q, k, v, gamma = _inputs(1, heads, grid, prefix, d, torch.float32, GAMMAS["rmt"])
    with FlopCounterMode(display=False) as counter:
        ops.decayed_linear_attn(q, k, v, gamma, grid, prefix, tile_size=tile)
    assert counter.get_total_flops() == heads * decayed_linear_flops(grid, prefix, d, tile)


def test_bad_inputs_raise():
    q, k, v, gamma = _inputs(1, 2, (3, 4), 1, 4, torch.float32, GAMMAS["rmt"])
    call = ops.decayed_linear_attn
    with pytest.raises(ValueError, match=r"gamma must be a floating-point tensor of shape \(heads,\) = \(2,\), got shape \(3,\)"):
        call(q, k, v, torch.full((3,), 0.5), (3, 4), 1)
    with pytest.raises(ValueError, match=r"gamma must be a floating-point tensor .* got 0.5"):
        call(q, k, v, 0.5, (3, 4), 1)
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\], got \[0.5, 1.5\]"):
        call(q, k, v, torch.tensor([0.5, 1.5]), (3, 4), 1)
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\]"):
        call(q, k, v, torch.tensor([0.5, float("nan")]), (3, 4), 1)
    with pytest.raises(ValueError, match="do not match num_prefix_tokens=0"):
        call(q, k, v, gamma, (3, 4), 0)
    with pytest.raises(ValueError, match="tile_size must be an integer >= 1, got 0"):
        call(q, k, v, gamma, (3, 4), 1, tile_size=0)
    with pytest.raises(ValueError, match="backend must be one of rerun, autograd, got 'fast'"):
        call(q, k, v, gamma, (3, 4), 1, backend="fast")
    with pytest.raises(ValueError, match="feature_map"):
        call(q, k, v, gamma, (3, 4), 1, feature_map="softplus")


def test_gradient_path_is_named_and_forced(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="visattn.ops.backends")
    q, k, v, gamma = _inputs(1, 2, (3, 4), 1, 4, torch.float32, GAMMAS["rmt"])
    several_tiles = ops.decayed_linear_attn(q, k, v, gamma, (3, 4), 1, tile_size=2)
    with force_backend("decayed_linear", "autograd"):
        forced = ops.decayed_linear_attn(q, k, v, gamma, (3, 4), 1, tile_size=2)
    one_tile = ops.decayed_linear_attn(q, k, v, gamma, (3, 4), 1, tile_size=4)
    assert caplog.messages == [
        "decayed_linear: rerun backend (chosen)",
        "decayed_linear: autograd backend (forced)",
        "decayed_linear: autograd backend (chosen)",
    ]
    torch.testing.assert_close(forced, several_tiles)
    torch.testing.assert_close(one_tile, several_tiles)


class _LargestTensor(TorchFunctionMode):
    """Records the largest number of values of any tensor a torch function returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_holds_a_state_per_token():
    """Forward and backward on a grid of 3 x 3 tiles, the four (image, head) pairs taken at once: no tensor
    holds half as many values as one d x (d + 1) state per token of a single head would (the states are per
    grid column; the largest tensors are the explicit scores of a row of tiles)."""
    batch, heads, grid, d = 2, 2, (24, 20), 16
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3))
    gamma = torch.full((heads,), 0.9, requires_grad=True)
    # forward-mode AD loads its decompositions on first use: done here, outside the mode, which then sees
    # the op's own tensors only
    ops.decayed_linear_attn(q, k, v, gamma, grid, tile_size=8, backend="rerun").sum().backward()
    with _LargestTensor() as mode:
        out = ops.decayed_linear_attn(q, k, v, gamma, grid, tile_size=8, backend="rerun")
        out.backward(torch.randn_like(out))
    assert mode.largest < n * d * (d + 1) / 2


@pytest.mark.parametrize("backend", BACKENDS["decayed_linear"])
@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_rope_turns_the_numerator_only(mode, backend):
    """With a rope table, against the naive twin (explicit rotation matrices, explicit decay), outputs and
    gradients, the mixed table's frequencies included; and the FLOP formula of the two products."""
    batch, heads, grid, prefix, d = 3, 2, (5, 6), 1, 8
    inputs = list(_inputs(batch, heads, grid, prefix, d, torch.float64, GAMMAS["rmt"]))
    if mode == "mixed":
        inputs.append(init_mixed_rope_freqs(d, heads, dtype=torch.float64))

    def table(freqs=None):
        return axial_rope(grid, d, prefix, dtype=torch.float64) if freqs is None else mixed_rope(freqs, grid, prefix)

    out, grads = grads_of(
        lambda q, k, v, g, *f: ops.decayed_linear_attn(q, k, v, g, grid, prefix, tile_size=2, backend=backend, rope=table(*f)),
        *inputs,
    )
    ref, ref_grads = grads_of(
        lambda q, k, v, g, *f: naive_decayed_linear_attn(q, k, v, g, grid, prefix, rope=table(*f)), *inputs
    )
    assert_rms_close(out, ref, 1e-10, "out")
    for name, g, g_ref in zip(["dq", "dk", "dv", "dgamma"], grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-10, name)
    if mode == "mixed":  # mixed_rope computes its angles in fp32, and so their gradient
        assert_rms_close(grads[4], ref_grads[4], 1e-6, "dfreqs")
    # the table built outside the count: the formula is the op's (timm < 1.0.31 builds mixed tables with a matmul)
    rope = table(*inputs[4:])
    with FlopCounterMode(display=False) as counter:
        ops.decayed_linear_attn(*inputs[:4], grid, prefix, tile_size=2, rope=rope)
    assert counter.get_total_flops() == batch * heads * decayed_linear_flops(grid, prefix, d, 2, rotated=True)
