#!/usr/bin/env bash
# The experiment tables of cluttered digits at 1,024 tokens with the max-pooling recipe
# (configs/cluttered-digits-maxpool-1024tok.yaml), trained several runs at a time (--jobs; one GPU holds a dozen
# of these small runs):
#   types      every type from scratch, 3 seeds (the softmax runs are the transfer tables' parents)
#   transfer   each type converted from its seed's softmax parent, with and without attention transfer
#   resolution the parents' first stage (64 px, 256 tokens) converted and trained on at 128 px (1,024 tokens)
#   axial      axial with a first stage of FIRST_EPOCHS_AXIAL epochs on the tuning and held-out variants
# Usage (from the repository root): [JOBS=4] [LIMIT=seconds] [TABLES=docs/tables] [RUNS=runs] [ONLY="types ..."] \
#   [SEEDS="0 1 2"] \
#   bash scripts/experiment_tables.sh [train.py flags laid over every run, e.g. --max-train-samples 64]
# Every table is written by its runner, with the command that wrote it; a runner stopped at LIMIT leaves its runs
# to be resumed by the same command, and the tables are then written from the runs that finished
# (--tables-only). Runners that do not depend on each other run side by side, each JOBS runs at a time.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # many processes: one thread each
PY=${PYTHON:-python3}
JOBS=${JOBS:-4}
LIMIT=${LIMIT:-0}  # seconds for the training of all tables (0: no limit)
TABLES=${TABLES:-docs/tables}
RUNS=${RUNS:-runs}
ONLY=${ONLY:-types transfer resolution axial}
SEEDS=(${SEEDS:-0 1 2})
FIRST_EPOCHS_AXIAL=${FIRST_EPOCHS_AXIAL:-16}
CONFIG=configs/cluttered-digits-maxpool-1024tok.yaml
STAGE="--img-size 64 --epochs 8"
TYPES=$RUNS/maxpool-types
PARENTS=() PARENTS_STAGE1=()  # each seed's softmax run and its first stage
for seed in "${SEEDS[@]}"; do PARENTS+=("$TYPES/softmax/seed$seed"); PARENTS_STAGE1+=("$TYPES/softmax/seed$seed-stage1"); done
EXTRA=("$@")
mkdir -p "$TABLES"
wanted() { [[ " $ONLY " == *" $1 "* ]]; }
within_limit() {  # the command (not a function), stopped at the limit (its process group: train.py processes too)
  if [ "$LIMIT" -gt 0 ]; then
    local left=$((LIMIT - SECONDS))
    [ "$left" -gt 0 ] || return 124
    timeout "$left" "$@"
  else
    "$@"
  fi
}
# Train (or, with --tables-only, tabulate) each table: the runner's command, its own words then --, EXTRA; while
# training, within the limit.
limited=within_limit
types() {
  $limited $PY -m visattn.experiments.accuracy --config $CONFIG --stage "$STAGE" --seeds "${SEEDS[@]}" --run-root "$TYPES" \
    --attn "$@" -- "${EXTRA[@]}"
}
transfer() {
  $limited $PY -m visattn.experiments.transfer --parent "${PARENTS[@]}" --seeds "${SEEDS[@]}" --from-scratch-root "$TYPES" \
    --from-scratch-rows linear:dwconv_kernel=null linear axial neighborhood sparse --run-root "$RUNS/transfer-maxpool" \
    --output "$TABLES/transfer-maxpool.md" "$@" -- "${EXTRA[@]}"
}
resolution() {
  $limited $PY -m visattn.experiments.transfer --parent "${PARENTS_STAGE1[@]}" --seeds "${SEEDS[@]}" \
    --attn softmax linear:feature_map=learned,dwconv_kernel=null linear:feature_map=learned axial neighborhood sparse \
    --from-scratch-root "$TYPES" --from-scratch-rows softmax linear:dwconv_kernel=null linear axial neighborhood sparse \
    --run-root "$RUNS/transfer-maxpool-64-to-128" --output "$TABLES/transfer-maxpool-64-to-128.md" "$@" \
    -- --img-size 128 "${EXTRA[@]}"
}
axial() {
  $limited $PY -m visattn.experiments.accuracy --config $CONFIG --stage "--img-size 64 --epochs $FIRST_EPOCHS_AXIAL" \
    --run-root "$RUNS/table-maxpool-axial$FIRST_EPOCHS_AXIAL" --attn axial --variants tuning held-out --seeds "${SEEDS[@]}" \
    --output "$TABLES/cluttered-digits-maxpool-axial$FIRST_EPOCHS_AXIAL.md" "$@" -- "${EXTRA[@]}"
}
ALL_TYPES=(softmax linear linear:dwconv_kernel=null axial neighborhood sparse)
TYPES_TABLE=(--output "$TABLES/cluttered-digits-maxpool-types.md")
# Each generated set drawn once, with every core, before the runs that read it start side by side.
$PY - "$CONFIG" <<'EOF'
import sys
from visattn.experiments.variants import VARIANTS
from visattn.train import make_config, read_yaml
from visattn.train.data import load_splits
recipe = read_yaml(sys.argv[1])
for options in (recipe["dataset_kwargs"], *(variant.dataset_kwargs for variant in VARIANTS.values())):
    for size in (64, 128):
        load_splits(make_config({**recipe, "img_size": size, "dataset_kwargs": {**recipe["dataset_kwargs"], **options}}))
print("generated sets ready", flush=True)
EOF
{
  # The parents first: the transfer tables start from them.
  if wanted types || wanted transfer || wanted resolution; then
    types softmax --output "$TABLES/.parents.md" --jobs "${#SEEDS[@]}"
  fi
  wanted transfer && transfer --jobs "$JOBS" &
  wanted resolution && resolution --jobs "$JOBS" &
  wait
} &
wanted types && types "${ALL_TYPES[@]:1}" --output "$TABLES/.types.md" --jobs "$JOBS" &
wanted axial && axial --jobs "$JOBS" &
wait
rm -f "$TABLES"/.parents.* "$TABLES"/.types.*
# The tables from every run that finished, each with the command that trains it.
limited=
wanted types && types "${ALL_TYPES[@]}" "${TYPES_TABLE[@]}" --tables-only
wanted transfer && transfer --tables-only
wanted resolution && resolution --tables-only
wanted axial && axial --tables-only
exit 0
