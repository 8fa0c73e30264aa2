#!/usr/bin/env bash
# The GPU check: the cuda tests, the Triton kernels timed beside the paths they replace (with the launch
# configurations their autotuning chose) and the GPU benchmark rows (ViT-S/16, bf16); when named, the benchmark rows
# on the paths before the kernels, one short bf16 training run at 4,096 tokens, kernel profiles, the largest grid
# each type trains at and compiled rows. Each stage runs under its own time limit, so that one failure leaves the
# others' results.
# Usage: OUT=results_dir [ARCHIVE=file.tgz] [COMMIT=sha] bash scripts/device_check.sh   (from the repository
# root, on a GPU machine). After every stage OUT/results.md (the dated results page, scripts/device_report.py)
# is written anew, and ARCHIVE, if set (outside OUT), with all of OUT but the run's weights.
# Stage limits (seconds) are CUDA_TESTS_LIMIT, KERNELS_LIMIT, INFER_LIMIT, TRAIN_LIMIT, TRAIN_2048_LIMIT, RUN_LIMIT,
# PROFILE_LIMIT, MAX_TOKENS_LIMIT, COMPILE_LIMIT; STAGES (below) chooses them. MAX_TOKENS_ROWS, words passed to
# `visattn-bench max-tokens` (default: $ATTN below, beside timm and floor), replaces the max_tokens stage's rows, e.g.
# MAX_TOKENS_ROWS="--references --attn longformer linformer" searches those two types without timm and floor.
set -uo pipefail
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1  # a stage stopped at its limit keeps the log it printed
PY=${PYTHON:-python3}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# The check: about 445 s of stages on an H200, an estimate: the cuda tests and the kernels at their limits (150 s,
# 60 s; 129 cuda tests, many of which compile Triton kernels: 60 of them took 106 s) and the benchmark stages'
# 235 s of docs/results/2026-11-27-h200-check.md (where FlexAttention compiled in the rows the Triton kernels take
# now, their compiled kernels cached by the kernels stage). When named: the rows on the paths before the kernels
# (about 35 and 30 s), the tile-aligned rows (aligned_2048, aligned_1024, aligned_train_1024), the training run
# (99 s there), the kernel profiles (75 s), max_tokens (over 225 s) and compile_1024.
CHECK="cuda_tests kernels infer_2048 infer_1024 train_1024 infer_224 train_2048"
STAGES=${STAGES:-$CHECK}  # or some of the stage names below, e.g. STAGES="cuda_tests infer_2048"
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/commands.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/commands.txt"
  tail -5 "$OUT/$name.log"
  $PY scripts/device_report.py "$OUT" --commit "$COMMIT" >"$OUT/results.md"
  [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" --exclude="*.safetensors" --exclude="*.pkl" --exclude="*.bin" -C "$OUT" .
}
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, timm, accelerate; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__, 'accelerate', accelerate.__version__)"
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
BENCH="$PY -m visattn.bench --device cuda --dtype bf16 --warmup 2 --min-iters 5 --min-seconds 0.25 --max-seconds 5"
ATTN="--attn linear axial neighborhood sparse longformer linformer"  # beside timm (flash SDPA) and floor
MAX_TOKENS_ROWS=${MAX_TOKENS_ROWS:-$ATTN}
# The paths the types with Triton kernels took before them: the linear layer's projection split into heads and
# linear_attn's plain matmuls, SDPA on the rows and columns, FlexAttention's local windows.
PREVIOUS="--references --backend projected_linear=split --backend linear=plain"
PREVIOUS+=" --backend axial=sdpa --backend local=flex"
# Most important first: a stage past its limit loses only itself (the benchmark writes the rows it measured).
# Each kernel at its first candidate configuration: autotuning at every small shape of the tests would compile every
# candidate (the kernels stage autotunes at the model's shapes and compares its results with the previous paths').
# Without autotuning a kernel compiles once per specialisation, so the 106 s that 60 tests took with it are an upper
# bound's guide; past the limit the stage loses only the tests not yet run (-v prints each result as it ends).
stage cuda_tests "${CUDA_TESTS_LIMIT:-150}" env VISATTN_TRITON_AUTOTUNE=0 $PY -m pytest -v -m cuda -p no:cacheprovider \
  --durations 8 tests
# From here on a kernel autotunes once per key and dtype on this machine: later processes read the choice from
# Triton's cache (the tests' choices, made at their small shapes, are not kept).
export TRITON_CACHE_AUTOTUNING=1
# The Triton kernels at ViT-S/16 shapes beside the paths they replace; their launch configurations to keep.
stage kernels "${KERNELS_LIMIT:-60}" $PY scripts/time_kernels.py --device cuda --out "$OUT/kernels"
stage infer_2048 "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 2048 --batch-size 4 $ATTN --out "$OUT/infer_2048"
stage infer_2048_previous "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 2048 --batch-size 4 $PREVIOUS \
  --attn linear axial neighborhood sparse longformer --out "$OUT/infer_2048_previous"
stage infer_1024 "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 1024 --batch-size 16 $ATTN --out "$OUT/infer_1024"
stage train_1024 "${TRAIN_LIMIT:-60}" $BENCH --modes train --sizes 1024 --batch-size 8 --attn linear axial neighborhood --out "$OUT/train_1024"
stage train_1024_previous "${TRAIN_LIMIT:-60}" $BENCH --modes train --sizes 1024 --batch-size 8 $PREVIOUS \
  --attn linear axial neighborhood --out "$OUT/train_1024_previous"
stage infer_224 "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 224 --batch-size 128 $ATTN --out "$OUT/infer_224"
stage train_2048 "${TRAIN_2048_LIMIT:-45}" $BENCH --modes train --sizes 2048 --batch-size 2 --attn linear --out "$OUT/train_2048"
# The tile-aligned options (every block FlexAttention keeps is full; the model keeps the tokens in tile order), whose
# targets are stated beside the exact windows' rows above: three more stages of about 40 s, named when wanted.
ALIGNED="--attn neighborhood sparse --attn-kwargs tile_aligned=true"
stage aligned_2048 "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 2048 --batch-size 4 $ALIGNED --out "$OUT/aligned_2048"
stage aligned_1024 "${INFER_LIMIT:-75}" $BENCH --modes infer --sizes 1024 --batch-size 16 $ALIGNED --out "$OUT/aligned_1024"
stage aligned_train_1024 "${TRAIN_LIMIT:-60}" $BENCH --modes train --sizes 1024 --batch-size 8 $ALIGNED \
  --out "$OUT/aligned_train_1024"
# The README's bf16 run at 1024 px (4,096 tokens), one short epoch.
stage train_run "${RUN_LIMIT:-150}" $PY -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision bf16 \
  --dynamo_backend no train.py --dataset cluttered-digits --img-size 1024 --model vit_small_patch16_224 --attn linear \
  --batch-size 32 --epochs 1 --warmup-epochs 0 --dataset-kwargs train_size=2560 val_size=320 test_size=320 \
  --num-workers 14 --measure-loader 8 --run-dir "$OUT/run_linear_4096" --overwrite
# Where a training step's time goes, beside floor's (the training targets).
stage profile_train_1024 "${PROFILE_LIMIT:-40}" $PY scripts/profile_block.py --device cuda --dtype bf16 --size 1024 --batch-size 8 \
  --mode train --attn softmax linear axial neighborhood --top 6
# The largest grid each type trains at, batch 1, in 80 GB: doubling from 131,072 tokens, then bisecting to 50%.
stage max_tokens "${MAX_TOKENS_LIMIT:-400}" $PY -m visattn.bench max-tokens --device cuda --dtype bf16 --modes train \
  --max-memory 80GB --min-tokens 131072 --max-tokens 1048576 --tolerance 0.5 --trial-timeout 40 $MAX_TOKENS_ROWS --out "$OUT/max_tokens"
# torch.compile: the 1024 px inference rows compiled (the first warm-up round compiles).
stage compile_1024 "${COMPILE_LIMIT:-150}" $BENCH --compile --modes infer --sizes 1024 --batch-size 16 \
  --attn linear axial neighborhood --out "$OUT/compile_1024"
# Where the time goes, kernel by kernel, beside floor's: block 0 at the sizes of the targets.
stage profile_2048 "${PROFILE_LIMIT:-40}" $PY scripts/profile_block.py --device cuda --dtype bf16 --size 2048 --batch-size 4 \
  --attn softmax linear axial neighborhood sparse longformer linformer --top 6
stage profile_224 "${PROFILE_LIMIT:-40}" $PY scripts/profile_block.py --device cuda --dtype bf16 --size 224 --batch-size 128 \
  --attn softmax linear axial neighborhood sparse longformer linformer --top 6
