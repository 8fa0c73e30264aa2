"""visattn-bench: speed and peak memory of every attention type on one ViT backbone.

Model sweep (default): at each point, an image size at a batch size (``--sizes`` x ``--batch-size``),
every selected attention type is built into the same backbone (``--model``, default
``visattn_vit_small_patch16``) next to two references: ``timm``, timm's stock ViT of the same shape with
its fused softmax attention (``vit_small_patch16_224`` built with the image size), and ``floor``, the
layer that mixes no tokens (the speed limit); ``--references`` can leave either out, e.g. timm in a run
at sizes where one of its steps would take an hour, and add a third, ``tiled``: timm's stock ViT built at
its own input size (``--tile``, default 224) and run on tiles of the image overlapping by
``--tile-overlap`` pixels, all tiles of a batch in one forward (:class:`visattn.tiled.TiledViT`), the
baseline a user would try first. Each row is timed in inference (forward under
``inference_mode``) and in training (forward, backward, AdamW step), the latter optionally with gradient
checkpointing (``--grad-checkpointing``).

Per row: images/s, tokens/s and ms per step (timm's ``infer_samples_per_sec``, ``infer_step_time``, ...),
analytic GFLOPs per image (training = forward + backward), achieved GFLOP/s, % of floor's images/s and
speed-up over timm (each the median over the interleaved rounds of the per-round ratio, with its
interquartile range), peak memory (on CUDA beside its estimate, :data:`~visattn.bench.memory.ESTIMATE_BANDS`),
and the parameter count (millions, ``param_count``). Outputs: a
markdown report on stdout (also ``bench.md``; one table per mode and batch size), ``bench.csv`` (one row
per type, size and batch size), ``bench.png`` (images/s and peak memory against tokens, log-log, one row
of panels per mode and batch size) and ``bench_summary.json`` in ``--out``. The report adds, per mode
and batch size, the scaling exponents of step time and memory against tokens (log-log slope over the
largest ``--fit-points`` sizes; memory above the model's own footprint) and, per type, the crossover:
the smallest token count from which it beats timm at every larger measured size, by the per-round ratio of
``x timm``; then the verdict on
each target of :mod:`~visattn.bench.targets` at a point the run measured. ``--calibrate`` also writes,
from this sweep, the calibration that ``attn="auto"`` reads, per batch size.

Ops mode (``--ops``): the token mixing alone (each layer's ``mix`` on random q, k, v; 6 heads of 64, as
ViT-S) on grids of 512 to 32,768 tokens, at each ``--batch-size``, in the same harness, beside
``softmax_explicit`` (softmax with explicit N x N scores).

Max-tokens mode (``visattn-bench max-tokens``): the largest token count each type runs forward and
trains (batch 1) within ``--max-memory``, by doubling and bisecting, one capped process per trial.

On CUDA (``--device cuda``, ``--dtype bf16``/``fp16``, ``--compile``): steps timed with CUDA events, one
worker on the GPU at a time, peak memory from ``torch.cuda.max_memory_allocated``; see
:mod:`~visattn.bench.timing`, and :mod:`~visattn.bench.sweep_cli` for the commands of the GPU table.

The modules, in the order a run uses them:

* :mod:`~visattn.bench.cli`: ``visattn-bench``, which runs one of the two commands;
* :mod:`~visattn.bench.arguments`: what both command lines read alike (shared arguments, memory sizes);
* :mod:`~visattn.bench.sweep_cli`: the sweep's command line, and its run from arguments to written reports;
* :mod:`~visattn.bench.sweep`: the points of a sweep (:class:`~visattn.bench.sweep.Point`), the cases of
  a point (:class:`~visattn.bench.sweep.Case`) and their results to fill
  (:class:`~visattn.bench.sweep.Result`), planned with FLOPs and memory estimates;
* :mod:`~visattn.bench.flops`: the model-level cost (FLOPs, memory estimate) from the per-type
  formulas on the layer classes;
* :mod:`~visattn.bench.runners`: what a worker builds and steps, one runner per kind and mode;
* :mod:`~visattn.bench.timing`: the worker processes and the interleaved timing rounds;
* :mod:`~visattn.bench.memory`: peak memory of a worker, and which workers fit the machine at once;
* :mod:`~visattn.bench.ratios`: the ratios between rows, round by round, with their spread;
* :mod:`~visattn.bench.sweep_summary`: scaling exponents and crossovers;
* :mod:`~visattn.bench.sweep_report`: the sweep's tables, CSV and plot;
* :mod:`~visattn.bench.targets`: the speed and memory targets and their check;
* :mod:`~visattn.bench.calibrate`: the calibration of ``attn="auto"``;
* :mod:`~visattn.bench.max_tokens_cli`: the max-tokens command line, and its run from arguments to written reports;
* :mod:`~visattn.bench.max_tokens`: the max-tokens search (doubling, then bisecting) and its rows;
* :mod:`~visattn.bench.trial`: one max-tokens trial, a runner stepped in its own capped process;
* :mod:`~visattn.bench.max_tokens_report`: the max-tokens table and CSV files.
"""
from visattn.bench.cli import main

__all__ = ["main"]
