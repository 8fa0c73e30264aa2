"""The benchmark's memory estimate on CUDA against the peaks measured on an NVIDIA H200, and the band the
reports state for it."""
from __future__ import annotations

import pytest

from visattn.bench import sweep_cli
from visattn.bench.memory import estimate_band
from visattn.bench.sweep import plan_model_sweep
from visattn.ops.backends import force_backend

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
    with force_backend("axial", "sdpa"):  # the path the H200 ran axial on, before its Triton kernels
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


# Every benchmark row of the GPU check at 564fa2c (docs/results/2026-11-27-h200-check.md, "Inference" and
# "Training steps"; results/2026-11-27-h200-check/<stage>/bench.csv): (peak MiB, the estimate that run planned, MiB)
# of each row, {mode}_peak_mem_mb and {mode}_mem_estimate_mb.
H200_CHECK_PEAK_AND_ESTIMATE_MIB: dict[str, dict[str, tuple[float, float]]] = {
    "infer 2048 px, batch 4": {
        "timm": (1101.5, 875.9), "floor": (1101.5, 875.9), "linear": (1101.7, 876.0), "axial": (1101.5, 875.9),
        "neighborhood": (1102.8, 878.9), "sparse": (1102.8, 878.9), "longformer": (1102.8, 878.9),
        "linformer": (1485.5, 1291.9),
    },
    "infer 1024 px, batch 16": {
        "timm": (1083.5, 858.0), "floor": (1083.5, 858.0), "linear": (1083.7, 858.1), "axial": (1083.5, 858.0),
        "neighborhood": (1083.8, 865.5), "sparse": (1083.8, 865.5), "longformer": (1083.8, 865.5),
        "linformer": (1179.5, 962.0),
    },
    "infer 224 px, batch 128": {
        "timm": (487.3, 379.2), "floor": (487.3, 379.2), "linear": (555.1, 379.4), "axial": (487.3, 379.2),
        "neighborhood": (487.4, 379.3), "sparse": (487.4, 379.3), "longformer": (487.4, 379.3),
        "linformer": (491.9, 424.8),
    },
    "train 1024 px, batch 8": {
        "timm": (6005.6, 5649.6), "floor": (5708.5, 4488.3), "linear": (6052.0, 5929.2), "axial": (8332.9, 7692.6),
        "neighborhood": (6316.9, 5689.3),
    },
    "train 2048 px, batch 2": {"timm": (6061.7, 5720.6), "floor": (5764.3, 4559.6), "linear": (6104.5, 6000.3)},
}


def test_the_stated_cuda_band_is_the_h200_checks_peaks_over_their_estimates():
    """The band the CUDA reports state is where the GPU check's 32 peaks fell against the estimates that run
    planned: the lowest quotient at its low end and the highest at its high end (to its two decimals). It is
    a statement about that commit's paths: the Triton paths added since were not measured on a GPU."""
    band = estimate_band("model", "cuda")
    quotients = [peak / estimate for rows in H200_CHECK_PEAK_AND_ESTIMATE_MIB.values() for peak, estimate in rows.values()]
    assert len(quotients) == 32
    assert (round(min(quotients), 2), round(max(quotients), 2)) == (band.low, band.high) == (1.02, 1.46)
    assert "564fa2c" in band.measured_on


def test_no_band_is_stated_for_the_cpu_or_the_ops():
    assert estimate_band("model", "cpu") is None
    assert estimate_band("op", "cuda") is None and estimate_band("op", "cpu") is None
    assert estimate_band("model", "cuda:1") == estimate_band("model", "cuda")
