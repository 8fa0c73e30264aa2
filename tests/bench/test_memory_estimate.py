"""The benchmark's memory estimate on CUDA against the peaks measured on an NVIDIA H200."""
from __future__ import annotations

import pytest

from visattn.bench import sweep_cli
from visattn.bench.sweep import plan_model_sweep

MIB = 2**20

# Training steps of ViT-S/16 in bf16 at 1024 px, batch 8 (forward, backward, AdamW), peak MiB from
# torch.cuda.max_memory_allocated: docs/results/2026-11-27-h200-benchmark.md ("Training steps"; the figures
# are train_peak_mem_mb in results/2026-11-27-h200-benchmark/train_1024/bench.csv), measured at
# commit c5a4ad1.
H200_TRAIN_1024_B8_PEAK_MIB = {
    "timm": 6005.6,
    "floor": 5708.5,
    "linear": 6052.0,
    "axial": 8332.9,
    "neighborhood": 6316.9,
}
# The estimates that run planned with (train_mem_estimate_mb in the same file), on the CPU's paths, which
# the estimate for the CPU still takes.
H200_TRAIN_1024_B8_ESTIMATE_C5A4AD1_MIB = {
    "timm": 5649.6,
    "floor": 4488.3,
    "linear": 5929.2,
    "axial": 5352.5,
    "neighborhood": 7719.9,
}

# The estimate is a lower bound: the caching allocator's peak holds all it counts (weights, gradients and
# the AdamW moments from the step before; its rounding to 512 bytes is negligible here; the optimizer step's
# temporaries come after the activations are freed, off the peak), and about 666 MiB it does not count:
# under autocast the residual stream is fp32, so the inputs of both norms that each block keeps take 4
# bytes an element, not the 2 of bf16 (2 x 2 bytes x 4,097 tokens x 384 channels x 12 blocks x batch 8 =
# 576 MiB), and autocast keeps bf16 copies of the weights of the linear layers and the patch embedding
# (21.9 M parameters: 42 MiB) and of the images (3 x 1024 x 1024 x 8 x 2 bytes = 48 MiB) for the backward.
# That is 8.0% (axial) to 11.7% (floor) of these peaks, so an estimate may fall 12% short.
# floor also keeps all of the qkv projection, of which its output is a view (2 N C more a block and image
# than the estimate's proj input: 576 MiB, 10.1% of its peak), so it may fall 23% short. (timm's estimate
# counts SDPA's output twice, as its own and as proj's input, and falls 5.9% short.)
# linear is the exception: it falls only 123 MiB short (6,052.0 - 5,929.2, 2.0%), so its formula counts
# about 540 MiB that the step did not hold at its peak, and it is a lower bound here only because that is
# less than the 666 MiB left out. Its CUDA training path (plain_checkpoint) keeps q, k, v as the CPU's
# blocked path does, so the path is not the cause; what is was not measured (the 2 M C a block the formula
# counts for the depthwise convolution, 576 MiB here, whose input is a view of v, is a candidate).
ALLOWED_SHORTFALL = {"floor": 0.23}
DEFAULT_SHORTFALL = 0.12


def _within(attn: str, estimate_mib: float) -> bool:
    peak = H200_TRAIN_1024_B8_PEAK_MIB[attn]
    return (1 - ALLOWED_SHORTFALL.get(attn, DEFAULT_SHORTFALL)) * peak <= estimate_mib <= peak


def _plan_the_h200_command(device: str) -> dict[str, float]:
    """The plan of the H200's command, ``--device cuda --dtype bf16 --modes train --sizes 1024 --batch-size 8
    --attn linear axial neighborhood`` (timm and floor come with every sweep), for ``device``: parsed for
    the CPU (the parser refuses cuda without a GPU), planned for ``device``, which planning reads from
    ``args.device`` alone."""
    args = sweep_cli.parse_args(
        ["--device", "cpu", "--dtype", "bf16", "--modes", "train", "--sizes", "1024", "--batch-size", "8",
         "--attn", "linear", "axial", "neighborhood"]
    )
    args.device = device
    (group,) = plan_model_sweep(args)
    return {r.case.attn: r.estimate_bytes / MIB for r in group}


@pytest.fixture(scope="module")
def cuda_estimates_mib() -> dict[str, float]:
    return _plan_the_h200_command("cuda")


@pytest.mark.parametrize("attn", list(H200_TRAIN_1024_B8_PEAK_MIB))
def test_the_cuda_training_estimate_is_a_close_lower_bound_of_the_h200_peak(cuda_estimates_mib, attn):
    assert _within(attn, cuda_estimates_mib[attn]), (
        f"{attn}: estimate {cuda_estimates_mib[attn]:.1f} MiB against the peak {H200_TRAIN_1024_B8_PEAK_MIB[attn]} MiB"
    )


def test_the_cpu_estimates_are_those_of_that_run_and_miss_the_cuda_bound():
    """Planned for the CPU, the same command still gets the estimates the H200's run planned with at
    c5a4ad1 (to the 0.1 MiB of bench.csv), and those miss the bound on CUDA: axial's was 36% under its
    peak, neighborhood's 22% over it."""
    cpu = _plan_the_h200_command("cpu")
    assert cpu.keys() == H200_TRAIN_1024_B8_ESTIMATE_C5A4AD1_MIB.keys()
    for attn, recorded in H200_TRAIN_1024_B8_ESTIMATE_C5A4AD1_MIB.items():
        assert cpu[attn] == pytest.approx(recorded, abs=0.05), attn
    assert not _within("axial", cpu["axial"])
    assert not _within("neighborhood", cpu["neighborhood"])
