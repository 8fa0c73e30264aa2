"""visattn.models.lora: low-rank adapters on the attention projections, what they train and how they merge."""
from __future__ import annotations

import pytest
import timm
import torch

from visattn.models import add_lora, convert, create_model, merged_state_dict
from visattn.models.transfer import trainable_attention_parameters
from visattn.models.lora import adapted_state_dict, freeze_for_lora

TINY_VIT = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=5)


def tiny(attn: str = "softmax", **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("visattn_vit_tiny_patch16", attn=attn, **TINY_VIT, **kwargs).eval()


def test_an_untrained_adapter_changes_nothing():
    model, images = tiny("linear"), torch.randn(2, 3, 16, 16)
    expected = model(images)
    assert add_lora(model, rank=4) == 4  # qkv and proj of 2 blocks
    assert torch.equal(model(images), expected)  # B starts at zero: W + 0 is W exactly


def test_the_merged_weights_are_a_plain_model_that_computes_what_the_adapted_one_does():
    adapted, images = tiny("linear"), torch.randn(2, 3, 16, 16)
    add_lora(adapted, rank=2, alpha=4.0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if name.endswith((".up", ".down")):
                param.normal_()
    plain = tiny("linear")
    merged = merged_state_dict(adapted.state_dict())
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    # the same sum, W + (alpha / r) B A, once in the parametrization and once in the merge
    assert torch.equal(plain(images), adapted(images))
    qkv = "blocks.0.attn.qkv"
    original = adapted.state_dict()[f"{qkv}.parametrizations.weight.original"]
    delta = merged[f"{qkv}.weight"] - original
    assert torch.linalg.matrix_rank(delta) == 2
    lora = adapted.blocks[0].attn.qkv.parametrizations.weight[0]
    torch.testing.assert_close(delta, 2.0 * lora.up @ lora.down)  # alpha / rank = 2


def test_merged_weights_loaded_into_a_model_with_adapters_compute_what_a_plain_model_does():
    """What a run does for its final test: the best weights, saved merged, loaded into the model it trains,
    whose adapters have moved on since."""
    trained, images = tiny("linear"), torch.randn(2, 3, 16, 16)
    add_lora(trained, rank=2)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if name.endswith((".up", ".down")):
                param.normal_()
    merged = merged_state_dict(trained.state_dict())
    plain = tiny("linear")
    plain.load_state_dict(merged)
    moved_on = tiny("linear")
    add_lora(moved_on, rank=2)
    with torch.no_grad():
        for name, param in moved_on.named_parameters():
            if name.endswith((".up", ".down")):
                param.normal_()
    moved_on.load_state_dict(adapted_state_dict(moved_on, merged))
    assert torch.equal(moved_on(images), plain(images))
    # a model without adapters takes the plain weights as they are
    assert adapted_state_dict(plain, merged) == merged


def test_a_state_dict_without_adapters_is_its_own_merge():
    state = tiny().state_dict()
    assert merged_state_dict(state) == state
    # another parametrization's weight is left as it is
    other = {"a.parametrizations.weight.original": torch.ones(2, 2), "a.parametrizations.weight.0.base": torch.ones(2)}
    assert merged_state_dict(other) == other


def test_adapters_are_added_once():
    model = tiny()
    add_lora(model, rank=1)
    with pytest.raises(ValueError, match="^lora_rank: the attention projections already have adapters"):
        add_lora(model, rank=1)


def test_with_adapters_only_they_the_attention_s_own_parameters_and_the_head_train():
    model = tiny("linear", attn_kwargs=dict(feature_map="learned"))
    add_lora(model, rank=2)
    own = [param for block in trainable_attention_parameters(model) for param in block]
    freeze_for_lora(model, [*own, *model.get_classifier().parameters()])
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    adapters = {f"blocks.{i}.attn.{module}.parametrizations.weight.0.{part}"
                for i in range(2) for module in ("qkv", "proj") for part in ("up", "down")}
    own_names = {f"blocks.{i}.attn.{name}" for i in range(2) for name in
                 ("learned_map.query", "learned_map.key", "dwconv.weight", "dwconv.bias")}
    assert trained == adapters | own_names | {"head.weight", "head.bias"}
    # attention transfer trains the adapters too: a type with nothing of its own has something to learn
    axial = tiny("axial")
    assert not any(trainable_attention_parameters(axial))
    add_lora(axial, rank=2)
    names = {id(param): name for name, param in axial.named_parameters()}
    assert {names[id(param)].rsplit(".", 1)[1] for block in trainable_attention_parameters(axial) for param in block} == {
        "up", "down"}


def test_a_converted_timm_vit_takes_adapters():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3)
    convert(model, "linear")
    assert add_lora(model, rank=1) == 2 * len(model.blocks)


@pytest.mark.parametrize("rank, alpha, message", [
    (0, None, "lora_rank: an integer, at least 1, got 0"),
    (2.5, None, "lora_rank: an integer, at least 1, got 2.5"),
    (2, 0.0, "lora_alpha: above 0, got 0.0"),
])
def test_bad_ranks_and_alphas_are_refused_in_one_line(rank, alpha, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        add_lora(tiny(), rank, alpha)


def test_a_model_without_attention_projections_is_refused():
    with pytest.raises(ValueError, match="Linear has no blocks with attention qkv/proj"):
        add_lora(torch.nn.Linear(4, 4), rank=1)
