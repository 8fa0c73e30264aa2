#!/usr/bin/env bash
# The GPU check: the cuda tests, the GPU benchmark rows (ViT-S/16, bf16) and one short bf16 training run
# at 4,096 tokens, each stage under its own time limit so that one failure leaves the others' results.
# Usage: OUT=results_dir [ARCHIVE=file.tgz] [COMMIT=sha] bash scripts/device_check.sh   (from the repository
# root, on a GPU machine). After every stage OUT/results.md (the dated results page, scripts/device_report.py)
# is written anew, and ARCHIVE, if set (outside OUT), with all of OUT but the run's weights.
# Stage limits (seconds) are CUDA_TESTS_LIMIT, INFER_LIMIT, TRAIN_LIMIT, MAX_TOKENS_LIMIT, RUN_LIMIT.
set -uo pipefail
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
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
BENCH="$PY -m visattn.bench --device cuda --dtype bf16 --warmup 2 --min-iters 5 --min-seconds 0.5 --max-seconds 10"
ATTN="--attn linear axial neighborhood sparse longformer linformer softmax"
stage cuda_tests "${CUDA_TESTS_LIMIT:-90}" $PY -m pytest -q -m cuda -p no:cacheprovider tests
stage infer_2048 "${INFER_LIMIT:-120}" $BENCH --modes infer --sizes 2048 --batch-size 4 $ATTN --out "$OUT/infer_2048"
stage infer_1024 "${INFER_LIMIT:-120}" $BENCH --modes infer --sizes 1024 --batch-size 16 $ATTN --out "$OUT/infer_1024"
stage train_1024 "${TRAIN_LIMIT:-120}" $BENCH --modes train --sizes 1024 --batch-size 8 --attn linear axial neighborhood --out "$OUT/train_1024"
stage infer_224 "${INFER_LIMIT:-120}" $BENCH --modes infer --sizes 224 --batch-size 128 $ATTN --out "$OUT/infer_224"
stage train_2048 "${TRAIN_LIMIT:-120}" $BENCH --modes train --sizes 2048 --batch-size 2 --attn linear --out "$OUT/train_2048"
stage max_tokens "${MAX_TOKENS_LIMIT:-240}" $PY -m visattn.bench max-tokens --device cuda --dtype bf16 --modes train \
  --max-memory 70GiB --attn linear axial neighborhood --out "$OUT/max_tokens"
stage train_run "${RUN_LIMIT:-150}" $PY -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision bf16 \
  --dynamo_backend no train.py --dataset cluttered-digits --img-size 128 --patch-size 2 --attn linear \
  --embed-dim 192 --depth 6 --num-heads 3 --mlp-ratio 4 --batch-size 64 --epochs 2 --warmup-epochs 0 \
  --lr 1e-3 --num-workers 8 --measure-loader 8 --run-dir "$OUT/run_linear_4096" --overwrite
