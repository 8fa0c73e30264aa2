"""Sharded training: the FSDP config reaches accelerate's plugin as ``accelerate launch`` passes it, the
plugin's auto-wrap policy makes every timm Block its own FSDP unit (one process, gloo) without changing
what the model computes, and train.py refuses the config where accelerate would not shard."""
from __future__ import annotations

import copy
import types
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed as dist
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from accelerate.utils.launch import prepare_multi_gpu_env
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from visattn.train import build
from visattn.train.config import ConfigError, make_config

FSDP_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "fsdp.yaml"


@pytest.fixture
def launch_environment(monkeypatch) -> dict[str, str]:
    """The FSDP variables ``accelerate launch --config_file configs/accelerate/fsdp.yaml`` gives each process."""
    args = launch_command_parser().parse_args(["--config_file", str(FSDP_CONFIG), "train.py"])
    args, _, _ = _validate_launch_command(args)
    environment = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    return environment


def test_config_is_an_fsdp2_config_with_the_block_wrapped():
    config = load_config_from_file(str(FSDP_CONFIG))
    assert config.distributed_type == DistributedType.FSDP and config.num_processes == 2 and not config.use_cpu
    assert config.fsdp_config == {
        "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_version": 2,
    }


def test_launcher_passes_the_config_to_the_plugin(launch_environment):
    assert launch_environment["ACCELERATE_USE_FSDP"] == "true"
    plugin = FullyShardedDataParallelPlugin()  # built from the environment, as the Accelerator builds it
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.state_dict_type.name == "FULL_STATE_DICT" and plugin.reshard_after_forward is True


def test_every_block_is_an_fsdp_unit_and_the_model_computes_the_same(launch_environment, tmp_path):
    plugin = FullyShardedDataParallelPlugin()
    torch.manual_seed(0)
    model = timm.create_model("visattn_vit_tiny_patch16", img_size=16, patch_size=4, embed_dim=16, depth=3,
                              num_heads=2, attn="linear", num_classes=10)
    twin = copy.deepcopy(model)
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 5, 9])
    # What fsdp2_prepare_model reads of the Accelerator (accelerate selects FSDP only on accelerators).
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
                                        mixed_precision="no", is_main_process=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        sharded = fsdp2_prepare_model(accelerator, model)
        units = {name for name, module in sharded.named_modules() if isinstance(module, FSDPModule)}
        assert units == {"", "blocks.0", "blocks.1", "blocks.2", "norm"}
        assert all(isinstance(sharded.get_submodule(name), Block) for name in units if name.startswith("blocks."))
        # One process holds every shard: the same products in the same order, so the same numbers bit for bit.
        loss = torch.nn.functional.cross_entropy(sharded(images), labels)
        loss.backward()
        twin_loss = torch.nn.functional.cross_entropy(twin(images), labels)
        twin_loss.backward()
        assert torch.equal(loss, twin_loss)
        for (name, p), (_, q) in zip(sharded.named_parameters(), twin.named_parameters(), strict=True):
            assert torch.equal(p.grad.full_tensor(), q.grad), name
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the refusal is for machines without an accelerator")
def test_train_refuses_fsdp_without_an_accelerator(launch_environment, tmp_path):
    config = make_config({"run_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match=r"^the FSDP config needs a GPU or other accelerator: .* would train without sharding"):
        build.build_accelerator(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
