"""Attention transfer (visattn.models.transfer) and the linear layer's learned feature map: transfer lowers
each layer's error against its softmax parent on held-out images and touches nothing but the attention
layers' own parameters; an untrained learned map is elu + 1 exactly; the learned map matches its naive twin
on every path it runs; a type with nothing to learn is refused in one line."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from tests.helpers import assert_rms_close
from visattn.layers import get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.layers.feature_map import LearnedFeatureMap
from visattn.models import AttentionTransfer, convert, transfer_attention
from visattn.ops.backends import choose_projected_linear_backend, force_backend
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.naive_decay import naive_decayed_linear_attn

LEARNED = dict(feature_map="learned", dwconv_kernel=None)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(256 training images, 128 held-out images): scikit-learn's digits at 16 x 16, three channels."""
    images = torch.tensor(load_digits().images[:384], dtype=torch.float32)[:, None] / 16
    images = F.interpolate(images, size=16, mode="bilinear").expand(-1, 3, -1, -1).contiguous()
    return images[:256], images[256:]


def softmax_parent() -> torch.nn.Module:
    """A tiny stock timm ViT (a 4 x 4 grid, 2 blocks) whose queries and keys are scaled up, so that its
    softmax weights are peaked as a trained model's are, not uniform as a fresh one's."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10
    )
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:64] *= 4  # the q and k rows
    return model.eval()


def batches(images: torch.Tensor, size: int = 32) -> list[torch.Tensor]:
    return [images[start:start + size] for start in range(0, len(images), size)]


@pytest.mark.parametrize("mode", ["joint", "layerwise"])
@pytest.mark.parametrize("options", [LEARNED, {}], ids=["learned-map", "dwconv"])
def test_transfer_lowers_every_layers_error_on_held_out_images(digits, mode, options):
    train_images, held_out = digits
    parent = softmax_parent()
    untrained = convert(copy.deepcopy(parent), "linear", **options)
    before = AttentionTransfer(parent, untrained).mean_losses(batches(held_out))
    # layerwise gives each block half of the steps: twice the epochs for the same steps per block
    result = transfer_attention(parent, "linear", batches(train_images), epochs=4 if mode == "joint" else 8, mode=mode, lr=1e-2,
                       **options)
    after = AttentionTransfer(parent, result.model).mean_losses(batches(held_out))
    assert len(result.losses) == (4 if mode == "joint" else 8) and all(len(epoch) == 2 for epoch in result.losses)
    for block, (old, new) in enumerate(zip(before, after)):
        assert new < 0.5 * old, f"block {block}: held-out MSE {old:.3g} -> {new:.3g}"


def test_transfer_changes_only_the_attention_layers_own_parameters(digits):
    parent = softmax_parent()
    parent_before = {key: value.clone() for key, value in parent.state_dict().items()}
    result = transfer_attention(parent, "linear", batches(digits[0][:64]), epochs=1, lr=1e-2, feature_map="learned")
    trained = {name for name, _ in result.model.named_parameters() if ".learned_map." in name or ".dwconv." in name}
    assert trained == {f"blocks.{i}.attn.{part}" for i in range(2)
                       for part in ("learned_map.query", "learned_map.key", "dwconv.weight", "dwconv.bias")}
    student = dict(result.model.named_parameters())
    for name, value in parent.named_parameters():
        assert torch.equal(value, parent_before[name]), f"the parent's {name} changed"
        assert torch.equal(student[name], value), f"{name} changed in transfer"
    assert all(student[name].grad is None for name in parent_before if name in student)
    identity = torch.eye(16).expand(2, 16, 16)
    assert not torch.equal(student["blocks.0.attn.learned_map.query"], identity)


def test_train_projections_trains_qkv_too(digits):
    parent = softmax_parent()
    result = transfer_attention(parent, "linear", batches(digits[0][:64]), epochs=1, lr=1e-2, train_projections=True, **LEARNED)
    assert not torch.equal(result.model.blocks[0].attn.qkv.weight, parent.blocks[0].attn.qkv.weight)
    assert torch.equal(result.model.blocks[0].mlp.fc1.weight, parent.blocks[0].mlp.fc1.weight)


@pytest.mark.parametrize("attn, options, named", [
    ("linear", dict(feature_map="elu", dwconv_kernel=None), "'linear'"),
    ("softmax", {}, "'softmax'"),
])
def test_a_type_with_nothing_to_learn_says_so_in_one_line(digits, attn, options, named):
    with pytest.raises(ValueError) as caught:
        transfer_attention(softmax_parent(), attn, batches(digits[0][:32]), **options)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"attention transfer: {named} add(s) no parameters") and "nothing to learn" in message


def test_layerwise_trains_one_block_at_a_time_in_order():
    student = convert(softmax_parent(), "linear", **LEARNED)
    joint, layerwise = (AttentionTransfer(softmax_parent(), student, mode=mode) for mode in ("joint", "layerwise"))
    assert [joint.blocks_at(step, 6) for step in range(6)] == [[0, 1]] * 6
    assert [layerwise.blocks_at(step, 6) for step in range(6)] == [[0], [0], [0], [1], [1], [1]]
    with pytest.raises(ValueError, match="mode must be one of joint, layerwise, got 'blockwise'"):
        AttentionTransfer(softmax_parent(), student, mode="blockwise")


# -- the learned feature map ------------------------------------------------------------------------------
def test_untrained_learned_map_is_elu_plus_one_exactly():
    torch.manual_seed(3)
    q = torch.randn(2, 3, 20, 8)
    k = torch.randn(2, 3, 20, 8)
    mapped_q, mapped_k = LearnedFeatureMap(3, 8)(q, k)
    assert torch.equal(F.elu(mapped_q) + 1, F.elu(q) + 1) and torch.equal(F.elu(mapped_k) + 1, F.elu(k) + 1)

    learned = get_attention("linear")(24, num_heads=3, feature_map="learned")
    elu = get_attention("linear")(24, num_heads=3, feature_map="elu")
    elu.load_state_dict({key: value for key, value in learned.state_dict().items() if "learned_map" not in key})
    x = torch.randn(2, 1 + 20, 24)
    for layer in (learned, elu):
        layer.set_grid((4, 5), num_prefix_tokens=1)
    with force_backend("projected_linear", "split"):
        assert torch.equal(learned(x), elu(x))


def _perturbed_layer(**options) -> torch.nn.Module:
    torch.manual_seed(5)
    layer = get_attention("linear")(24, num_heads=3, feature_map="learned", dwconv_kernel=None, **options)
    with torch.no_grad():
        for weight in (layer.learned_map.query, layer.learned_map.key):
            weight.add_(0.3 * torch.randn_like(weight))  # a trained map, not the identity
    return layer


def _output_and_grads(fn, layer, q, k, v):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    for weight in layer.learned_map.parameters():
        weight.grad = None
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))
    return out.detach(), [t.grad for t in leaves] + [w.grad.clone() for w in layer.learned_map.parameters()]


@pytest.mark.parametrize("op, path, causal", [
    ("linear", "blocked", False), ("linear", "plain", False), ("linear", "chunk", True),
    ("decayed_linear", "rerun", False), ("decayed_linear", "autograd", False),
])
def test_learned_map_matches_naive_twin_on_every_path(op, path, causal):
    grid, prefix = (4, 5), 1
    layer = _perturbed_layer(decay=True if op == "decayed_linear" else None)
    layer.set_grid(grid, prefix)
    q, k, v = torch.randn(3, 2, 3, prefix + 20, 8).unbind(0)

    def fast(q, k, v):
        with force_backend(op, path):
            return layer.mix(q, k, v, grid=grid, attn_mask=None, is_causal=causal)

    def naive(q, k, v):
        mapped_q, mapped_k = q @ layer.learned_map.query, k @ layer.learned_map.key
        if op == "decayed_linear":
            return naive_decayed_linear_attn(mapped_q, mapped_k, v, layer.spatial_decay(), grid, prefix, "elu")
        return naive_linear_attn(mapped_q, mapped_k, v, "elu", causal=causal)

    out, grads = _output_and_grads(fast, layer, q, k, v)
    ref, ref_grads = _output_and_grads(naive, layer, q, k, v)
    assert_rms_close(out, ref, 1e-5, f"{path} output")
    for name, grad, ref_grad in zip(("q", "k", "v", "map query", "map key"), grads, ref_grads):
        assert_rms_close(grad, ref_grad, 1e-5, f"{path} grad {name}")


def test_learned_map_routes_the_projection_to_split():
    layer = _perturbed_layer()
    x = torch.randn(2, 20, 24)
    with torch.no_grad():  # where feature_map="elu" would fuse the projection with the mixing
        assert choose_projected_linear_backend(x.device, causal=False, has_qk_norm=False) == "fused_qkv"
        assert choose_projected_linear_backend(x.device, causal=False, has_qk_norm=False, learned_map=True) == "split"
        q, k, v = layer.qkv(x).unflatten(-1, (3, 3, 8)).permute(2, 0, 3, 1, 4).unbind(0)
        assert_rms_close(layer(x), layer.proj(layer.mix(q, k, v, None, None, False).transpose(1, 2).flatten(2)), 1e-6)
        for path in ("fused_qkv", "packed"):
            with force_backend("projected_linear", path), pytest.raises(ValueError, match="feature_map='learned' needs 'split'"):
                layer(x)


def test_learned_map_cost():
    layout = TokenLayout(num_prefix_tokens=1, grid=(8, 8))
    linear = get_attention("linear")
    options = dict(linear.type_options(), dwconv_kernel=None)
    elu_flops = linear.mixing_flops(CostCase(layout, 4, 16, options))
    learned_flops = linear.mixing_flops(CostCase(layout, 4, 16, dict(options, feature_map="learned")))
    assert learned_flops - elu_flops == 4 * 65 * 64 * 16  # 4 N C d
    elu_memory = linear.mixing_memory(CostCase(layout, 4, 16, options, 4))
    learned_memory = linear.mixing_memory(CostCase(layout, 4, 16, dict(options, feature_map="learned"), 4))
    assert learned_memory.train - elu_memory.train == 2 * 65 * 64 * 4
    assert learned_memory.infer - elu_memory.infer == 2 * 65 * 64 * 4
    layer = linear(64, num_heads=4, feature_map="learned")
    assert sum(p.numel() for p in layer.learned_map.parameters()) == 2 * 4 * 16 * 16


def test_unknown_feature_map_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"linear: unknown feature_map 'hedgehog'; valid: elu, relu, learned"):
        get_attention("linear")(24, num_heads=3, feature_map="hedgehog")
