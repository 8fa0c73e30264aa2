"""How a Triton kernel picks its launch configuration on a GPU (visattn.ops.triton_support): with autotuning
off (``VISATTN_TRITON_AUTOTUNE=0``), each kernel's first candidate. The launches are read on the CPU with the
modules told they are compiled: nothing runs."""
from __future__ import annotations

import pytest
import torch

import visattn.ops.axial.triton as axial_triton
import visattn.ops.linear.triton as linear_triton
import visattn.ops.local.triton as local_triton
from visattn.ops import triton_support

triton = pytest.importorskip("triton", reason="needs the triton package")


class _Tuner:
    """What autotuned_configs reads of a Triton autotuner: its cache, key -> chosen triton.Config."""

    def __init__(self, cache):
        self.cache = cache


@pytest.fixture
def compiled_without_autotuning(monkeypatch):
    for module in (linear_triton, axial_triton, local_triton):
        monkeypatch.setattr(module, "INTERPRETED", False)
        monkeypatch.setattr(module, "AUTOTUNE", False)
        monkeypatch.setattr(module, "wrap_triton", lambda kernel: kernel)


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False)])
def test_the_setting_reads_0_or_1(monkeypatch, value, expected):
    monkeypatch.setenv("VISATTN_TRITON_AUTOTUNE", value)
    assert triton_support._autotune_setting() is expected


def test_the_setting_refuses_anything_else(monkeypatch):
    monkeypatch.setenv("VISATTN_TRITON_AUTOTUNE", "off")
    with pytest.raises(ValueError, match=r"VISATTN_TRITON_AUTOTUNE must be 0 .* or 1 \(autotune\), got 'off'"):
        triton_support._autotune_setting()


def test_linear_kernels_launch_with_their_first_candidate(compiled_without_autotuning):
    for name, candidates in linear_triton.AUTOTUNE_CONFIGS.items():
        for block_d, first in ((64, candidates[0]), (128, linear_triton.WIDE_HEAD_CONFIGS[0])):
            flags = {"BLOCK_D": block_d, "FEATURE_MAP": 0, "ROPE": False}
            kernel, launch = linear_triton._kernel(name, flags, torch.bfloat16)
            assert kernel is getattr(linear_triton.kernels, name)  # the kernel itself, not an autotuner
            assert launch == {"BLOCK_N": first.block_n, "num_warps": first.num_warps, "num_stages": first.num_stages}


def test_local_kernels_launch_with_their_first_candidate(compiled_without_autotuning):
    for name, candidates in local_triton.AUTOTUNE_CONFIGS.items():
        kernel, launch, configs = local_triton._launch(name, 64, torch.bfloat16)
        first = candidates[0]
        assert kernel is getattr(local_triton.kernels, name) and configs == (first,)
        assert launch == {"QH": first.qh, "QW": first.qw, "KH": first.kh, "KW": first.kw,
                          "num_warps": first.num_warps, "num_stages": first.num_stages}


def test_axial_kernels_launch_with_their_first_candidate(compiled_without_autotuning, monkeypatch):
    launched = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((self.kernel, meta))

    monkeypatch.setattr(axial_triton, "wrap_triton", Recorder)
    meta = {"BLOCK_L": 16, "BLOCK_P": 16, "BLOCK_D": 64}
    for kernel in ("forward", "backward"):
        axial_triton._launch("rows", kernel, (1, 1), [], meta, torch.bfloat16)
    block_q, warps, stages = axial_triton.AUTOTUNE_CONFIGS[0]
    first = {"BLOCK_Q": block_q, "num_warps": warps, "num_stages": stages}
    assert launched == [(axial_triton._KERNELS[kernel], meta | first) for kernel in ("forward", "backward")]


def test_linear_table_entries_serve_only_their_feature_map_rope_and_kernel(compiled_without_autotuning, monkeypatch):
    """A choice is keyed as the autotuning is: the one for elu, no rope and a 3 x 3 locality term is not taken
    for relu, for rope or for another kernel side (those launch as without an entry: here the first candidate)."""
    tuned = linear_triton.LaunchConfig(128, 8, 2)
    monkeypatch.setattr(linear_triton, "TUNED_CONFIGS", {("output_kernel", 64, "bfloat16", "elu", False, 3): tuned})
    first = linear_triton.AUTOTUNE_CONFIGS["output_kernel"][0]
    elu = {"BLOCK_D": 64, "FEATURE_MAP": linear_triton.FEATURE_MAP_CODES["elu"], "ROPE": False}
    relu = elu | {"FEATURE_MAP": linear_triton.FEATURE_MAP_CODES["relu"]}
    for flags, size, expected in ((elu, 3, tuned), (relu, 3, first), (elu | {"ROPE": True}, 3, first), (elu, 5, first)):
        _, launch = linear_triton._kernel("output_kernel", flags, torch.bfloat16, size)
        assert launch["BLOCK_N"] == expected.block_n and launch["num_warps"] == expected.num_warps, (flags, size)


def test_linear_autotuning_choices_come_back_as_table_entries(compiled_without_autotuning, monkeypatch):
    """Triton's autotuner caches a choice under the values of its key arguments, then the tensor arguments'
    dtypes; each becomes the TUNED_CONFIGS entry that ``_kernel`` looks up for the same launch."""
    chosen = triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3)
    monkeypatch.setattr(linear_triton, "_AUTOTUNED", raising=False, value={
        ("output_kernel", False): _Tuner({(64, 1, True, 3, "torch.bfloat16", "torch.float32"): chosen}),
        ("state_kernel", False): _Tuner({(64, 0, False, "torch.float16", "torch.float32"): chosen}),
    })
    expected = linear_triton.LaunchConfig(64, 8, 3)
    assert linear_triton.autotuned_configs() == {
        ("output_kernel", 64, "bfloat16", "relu", True, 3): expected,
        ("state_kernel", 64, "float16", "elu", False, 0): expected,
    }


def test_local_autotuning_keeps_the_first_windows_choice(compiled_without_autotuning, monkeypatch):
    """The autotuning's key holds the window, the table's does not: the first window tuned (neighborhood's
    7 x 7 in scripts/time_kernels.py) gives the entry, a later window's choice does not replace it."""
    first = triton.Config({"QH": 8, "QW": 8, "KH": 4, "KW": 16}, num_warps=4, num_stages=2)
    later = triton.Config({"QH": 8, "QW": 16, "KH": 8, "KW": 16}, num_warps=8, num_stages=2)
    cache = {  # DIM, DIM_V, row_a, row_c, col_a, col_c, ROW_BLOCK, COL_BLOCK, BLOCK_P, then the dtypes
        (64, 64, 3, 7, 3, 7, 0, 0, 16, "torch.bfloat16"): first,  # a 7 x 7 neighbourhood
        (64, 64, 3, 0, 3, 0, 8, 8, 16, "torch.bfloat16"): later,  # blocks of 8, halo 3
    }
    monkeypatch.setattr(local_triton, "_AUTOTUNED", raising=False, value={"window_forward_kernel": _Tuner(cache)})
    assert local_triton.autotuned_configs() == {
        ("window_forward_kernel", 64, "bfloat16"): local_triton.TileConfig(8, 8, 4, 16, 4, 2),
    }
