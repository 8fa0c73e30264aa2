#!/usr/bin/env bash
# The experiment tables of cluttered digits at 1,024 tokens with the max-pooling recipe
# (configs/cluttered-digits-maxpool-1024tok.yaml), trained several runs at a time (--jobs; one GPU holds a dozen
# of these small runs):
#   types      every type from scratch, 3 seeds (the softmax runs are the transfer tables' parents)
#   transfer   each type converted from its seed's softmax parent, with and without attention transfer
#   resolution the parents' first stage (64 px, 256 tokens) converted and trained on at 128 px (1,024 tokens)
#   axial      axial with a first stage of FIRST_EPOCHS_AXIAL epochs on the tuning and held-out variants
# Usage: [JOBS=4] [LIMIT=seconds] [TABLES=results/tables] [RUNS=runs] [ONLY="types ..."] [SEEDS="0 1 2"] \
#   bash scripts/experiment_tables.sh [train.py flags laid over every run, e.g. --max-train-samples 64]
# (paths relative to the repository root). Every table is written by its runner, with the command that wrote it;
# a runner stopped at LIMIT (or by Ctrl-C) leaves its runs to be resumed by the same command, and the tables are
# then written from the runs that finished (--tables-only). Runners that do not depend on each other run side by
# side, each JOBS runs at a time. Exit status 1 when a runner failed (one stopped at the limit has not), 2 for a
# bad setting.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # many processes: one thread each
PY=${PYTHON:-python3}
JOBS=${JOBS:-4}
LIMIT=${LIMIT:-0}  # seconds for the training of all tables (0: no limit)
TABLES=${TABLES:-results/tables}
RUNS=${RUNS:-runs}
TABLE_NAMES="types transfer resolution axial"
ONLY=${ONLY:-$TABLE_NAMES}
SEEDS=(${SEEDS:-0 1 2})
FIRST_EPOCHS_AXIAL=${FIRST_EPOCHS_AXIAL:-16}
for word in $ONLY; do
  [[ " $TABLE_NAMES " == *" $word "* ]] || { echo "ONLY: unknown table '$word'; accepted: $TABLE_NAMES" >&2; exit 2; }
done
[[ "$LIMIT" =~ ^[0-9]+$ ]] || { echo "LIMIT: whole seconds (0: no limit), got '$LIMIT'" >&2; exit 2; }
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "JOBS: runs at a time, at least 1, got '$JOBS'" >&2; exit 2; }
CONFIG=configs/cluttered-digits-maxpool-1024tok.yaml
STAGE="--img-size 64 --epochs 8"
TYPES=$RUNS/maxpool-types
PARENTS=() PARENTS_STAGE1=()  # each seed's softmax run and its first stage
for seed in "${SEEDS[@]}"; do PARENTS+=("$TYPES/softmax/seed$seed"); PARENTS_STAGE1+=("$TYPES/softmax/seed$seed-stage1"); done
EXTRA=("$@")
mkdir -p "$TABLES"
STATE=$(mktemp -d)  # the runners' timeout processes, the failures, and whether a stop was asked for
trap 'rm -rf "$STATE"' EXIT
stop() {  # Ctrl-C or TERM: each timeout passes the signal on to its runner's process group, train.py processes too
  touch "$STATE/stopped"
  echo "stopping the runners" >&2
  for pid in $(cat "$STATE/pids" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null; done
  wait
  rm -f "$TABLES"/.parents.* "$TABLES"/.types.*
  exit 130
}
trap stop INT TERM
wanted() { [[ " $ONLY " == *" $1 "* ]]; }
runner() {  # NAME COMMAND...: while training, within the limit in its own process group (timeout's; 0: no limit)
  local name=$1; shift
  if [ "$MODE" = tables ]; then
    "$@" || echo "$name --tables-only: exit $?" | tee -a "$STATE/failures"
    return 0
  fi
  [ ! -e "$STATE/stopped" ] || return 0
  local left=0
  if [ "$LIMIT" -gt 0 ]; then
    left=$((LIMIT - SECONDS))
    [ "$left" -gt 0 ] || { echo "$name: not started, the limit of $LIMIT s has passed"; return 0; }
  fi
  timeout "$left" "$@" &
  local pid=$!
  echo "$pid" >>"$STATE/pids"
  wait "$pid"
  local rc=$?
  if [ "$rc" -eq 124 ]; then
    echo "$name: stopped at the limit of $LIMIT s; the same command resumes its runs"
  elif [ "$rc" -ne 0 ] && [ ! -e "$STATE/stopped" ]; then
    echo "$name: exit $rc" | tee -a "$STATE/failures"
  fi
}
# Each table's runner: its command, its own words, then -- and EXTRA.
types() {  # NAME ROW... [RUNNER FLAGS]
  runner "$1" $PY -m visattn.experiments.accuracy --config $CONFIG --stage "$STAGE" --seeds "${SEEDS[@]}" \
    --run-root "$TYPES" --attn "${@:2}" -- "${EXTRA[@]}"
}
transfer() {
  runner transfer $PY -m visattn.experiments.transfer --parent "${PARENTS[@]}" --seeds "${SEEDS[@]}" \
    --from-scratch-root "$TYPES" --from-scratch-rows linear:dwconv_kernel=null linear axial neighborhood sparse \
    --run-root "$RUNS/transfer-maxpool" --output "$TABLES/transfer-maxpool.md" "$@" -- "${EXTRA[@]}"
}
resolution() {
  runner resolution $PY -m visattn.experiments.transfer --parent "${PARENTS_STAGE1[@]}" --seeds "${SEEDS[@]}" \
    --attn softmax linear:feature_map=learned,dwconv_kernel=null linear:feature_map=learned axial neighborhood sparse \
    --from-scratch-root "$TYPES" --from-scratch-rows softmax linear:dwconv_kernel=null linear axial neighborhood sparse \
    --run-root "$RUNS/transfer-maxpool-64-to-128" --output "$TABLES/transfer-maxpool-64-to-128.md" "$@" \
    -- --img-size 128 "${EXTRA[@]}"
}
axial() {
  runner axial $PY -m visattn.experiments.accuracy --config $CONFIG --stage "--img-size 64 --epochs $FIRST_EPOCHS_AXIAL" \
    --run-root "$RUNS/table-maxpool-axial$FIRST_EPOCHS_AXIAL" --attn axial --variants tuning held-out --seeds "${SEEDS[@]}" \
    --output "$TABLES/cluttered-digits-maxpool-axial$FIRST_EPOCHS_AXIAL.md" "$@" -- "${EXTRA[@]}"
}
ALL_TYPES=(softmax linear linear:dwconv_kernel=null axial neighborhood sparse)
# The normalisation statistics of each generated set the tables read computed once, with every core, before the runs
# that read it start side by side: the recipe's, and the variants' for the axial table.
VARIANT_SETS=$(wanted axial && echo variants)
$PY - "$CONFIG" $VARIANT_SETS <<'PYTHON' || { echo "drawing the generated sets failed" >&2; exit 1; }
import sys
from visattn.experiments.variants import VARIANTS
from visattn.train import make_config, read_yaml
from visattn.train.data import load_splits
recipe = read_yaml(sys.argv[1])
variants = VARIANTS.values() if sys.argv[2:] == ["variants"] else []
for options in (recipe["dataset_kwargs"], *(variant.dataset_kwargs for variant in variants)):
    for size in (64, 128):
        load_splits(make_config({**recipe, "img_size": size, "dataset_kwargs": {**recipe["dataset_kwargs"], **options}}))
print("generated sets ready", flush=True)
PYTHON
MODE=train
{
  # The parents first: the transfer tables start from them.
  if wanted types || wanted transfer || wanted resolution; then
    types parents softmax --output "$TABLES/.parents.md" --jobs "${#SEEDS[@]}"
  fi
  wanted transfer && transfer --jobs "$JOBS" &
  wanted resolution && resolution --jobs "$JOBS" &
  wait
} &
wanted types && types types "${ALL_TYPES[@]:1}" --output "$TABLES/.types.md" --jobs "$JOBS" &
wanted axial && axial --jobs "$JOBS" &
wait
rm -f "$TABLES"/.parents.* "$TABLES"/.types.*
# The tables from every run that finished, each with the command that trains it.
MODE=tables
wanted types && types types "${ALL_TYPES[@]}" --output "$TABLES/cluttered-digits-maxpool-types.md" --tables-only
wanted transfer && transfer --tables-only
wanted resolution && resolution --tables-only
wanted axial && axial --tables-only
if [ -s "$STATE/failures" ]; then
  echo "failed:" >&2
  cat "$STATE/failures" >&2
  exit 1
fi
exit 0
