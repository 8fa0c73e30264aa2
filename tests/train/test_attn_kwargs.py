"""attn_kwargs in train.py and visattn-bench: one syntax (flat options, or options under a type name),
one rule for which type gets which option, and a recipe's options for a type the command line replaced."""
from __future__ import annotations

import pytest
import torch
import timm

import visattn
from visattn.bench.sweep_cli import parse_args as parse_bench_args
from visattn.layers.options import options_per_type
from visattn.train import attention
from visattn.train.attention import resolve_attention
from visattn.train.cli import resolve_config
from visattn.train.config import ConfigError
from tests.train.test_train import REPO

HIRES = str(REPO / "configs" / "hires_imagefolder.yaml")


def test_no_option_is_named_like_a_type():
    """A key of attn_kwargs is either a type or an option, never both."""
    for name in visattn.list_attentions():
        assert not set(visattn.get_attention(name).type_options()) & set(visattn.list_attentions()), name


@pytest.mark.parametrize(
    "names, attn_kwargs, per_type, unused",
    [
        pytest.param(["neighborhood"], {"kernel_size": 5}, {"neighborhood": {"kernel_size": 5}}, [], id="flat"),
        pytest.param(["neighborhood"], {"neighborhood": {"kernel_size": 5}}, {"neighborhood": {"kernel_size": 5}}, [], id="by-type"),
        pytest.param(["linear"], {"kernel_size": 5}, {"linear": {}}, ["kernel_size"], id="flat-not-taken"),
        pytest.param(["linear"], {"neighborhood": {"kernel_size": 5}}, {"linear": {}}, [], id="other-type-passed-over"),
        pytest.param(
            ["neighborhood", "longformer", "neighborhood"], {"kernel_size": 5, "longformer": {"kernel_size": 3}},
            {"neighborhood": {"kernel_size": 5}, "longformer": {"kernel_size": 3}}, [], id="flat-to-every-type-type-wins",
        ),
    ],
)
def test_options_per_type(names, attn_kwargs, per_type, unused):
    assert options_per_type(names, attn_kwargs) == (per_type, unused)


@pytest.mark.parametrize(
    "attn_kwargs, message",
    [
        pytest.param({"bogus": 1}, "unknown option(s) bogus: neither an attention type nor an option of one", id="unknown-key"),
        pytest.param({"linear": 3}, "linear: expected a mapping of its options", id="type-not-mapping"),
        pytest.param({"linear": {"kernel_size": 3}}, "linear: unknown option(s) kernel_size; accepted: feature_map", id="wrong-option-of-type"),
    ],
)
def test_options_per_type_refuses_what_no_type_takes(attn_kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        options_per_type(["linear"], attn_kwargs)


@pytest.mark.parametrize(
    "words",
    [["kernel_size=5"], ["neighborhood={kernel_size: 5}"], ['{"neighborhood": {"kernel_size": 5}}'], ["kernel_size=3", "neighborhood={kernel_size: 5}"]],
    ids=["flat", "by-type", "json", "flat-and-by-type"],
)
def test_train_and_bench_read_the_same_words_alike(words):
    config, _, _ = resolve_config(["--attn", "neighborhood", "--attn-kwargs", *words])
    assert resolve_attention(config) == []
    assert (config.attn, config.attn_kwargs) == ("neighborhood", {"kernel_size": 5})
    bench = parse_bench_args(["--attn", "neighborhood", "--attn-kwargs", *words, "--device", "cpu"])
    assert bench.attn_kwargs == {"neighborhood": {"kernel_size": 5}}


def test_bench_refuses_options_for_none_of_its_types(capsys):
    for words in (["kernel_size=5"], ["neighborhood={kernel_size: 5}"]):
        with pytest.raises(SystemExit):
            parse_bench_args(["--attn", "linear", "--attn-kwargs", *words, "--device", "cpu"])
        assert "applies to none of --attn (linear)" in capsys.readouterr().err


def test_a_recipe_for_another_type_builds_with_the_type_of_the_command_line(tmp_path):
    config, _, _ = resolve_config(["--config", HIRES, "--attn", "linear", "--data-dir", str(tmp_path)])
    assert resolve_attention(config) == []
    assert (config.attn, config.attn_kwargs) == ("linear", {})
    model = timm.create_model(config.model, **config.model_kwargs_for_timm(num_classes=3))
    assert {block.attn.name for block in model.blocks} == {"linear"}
    config, _, _ = resolve_config(["--config", HIRES, "--data-dir", str(tmp_path)])
    resolve_attention(config)
    assert (config.attn, config.attn_kwargs) == ("neighborhood", {"kernel_size": 7})


def test_flat_options_no_type_takes_are_dropped_with_one_notice(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("attn: neighborhood\nattn_kwargs: {kernel_size: 5, tile_size: 4}\n")
    config, _, _ = resolve_config(["--config", str(recipe), "--attn", "linear,neighborhood,linear,linear"])
    assert resolve_attention(config) == []
    assert config.attn_kwargs == {"neighborhood": {"kernel_size": 5, "tile_size": 4}}
    config, _, _ = resolve_config(["--config", str(recipe), "--attn", "linear"])
    notices = resolve_attention(config)
    assert notices == ["attn_kwargs: kernel_size dropped: not an option of linear",
                       "attn_kwargs: tile_size dropped: not an option of linear"]
    assert config.attn_kwargs == {}
    resolved = (config.attn, dict(config.attn_kwargs))
    assert resolve_attention(config) == [] and (config.attn, config.attn_kwargs) == resolved  # idempotent


def test_auto_is_resolved_to_the_type_the_model_chooses():
    config, _, _ = resolve_config(["--attn", "auto", "--attn-kwargs", "dwconv_kernel=5,kernel_size=3"])
    model = timm.create_model(config.model, **config.model_kwargs_for_timm(num_classes=10) | {"attn_kwargs": {}})
    chosen = model.blocks[0].attn.name
    resolve_attention(config)
    assert config.attn == chosen
    assert config.attn_kwargs == options_per_type([chosen], {"dwconv_kernel": 5, "kernel_size": 3})[0][chosen]


def test_a_key_no_type_takes_is_a_config_error():
    config, _, _ = resolve_config(["--attn", "linear", "--attn-kwargs", "kernel_sise=5"])
    with pytest.raises(ConfigError, match=r"attn_kwargs: unknown option\(s\) kernel_sise"):
        resolve_attention(config)


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_chooses_for_the_device_the_run_trains_on(monkeypatch, gpu):
    """accelerate trains on the GPU where there is one: attn=auto is chosen for that device."""
    devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(attention, "select_attention", lambda *args: devices.append(args[-1]) or "linear")
    config, _, _ = resolve_config(["--attn", "auto"])
    assert attention.names_per_block(config) == ["linear"] * config.depth
    assert devices == ["cuda" if gpu else "cpu"]
