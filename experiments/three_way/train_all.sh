#!/usr/bin/env bash
# Three-way experiment, part 1 (issue 10): build the offline corpus and the BPE tokenizer, then
# train the demo model (configs/train/demo.yaml) three ways with train.py only:
#   msa      configs as shipped: layers 2-5 MSA (block 64, top-8 = 512 attended tokens), indexer
#            warm-up (dense attention + KL) for msa.indexer_warmup_steps, then sparse;
#   full     layers 2-5 full attention;
#   sliding  layers 2-5 sliding-window attention, window 512 (the same attended-token budget).
# Layers 0-1 are full attention in all three (the M3 layout). Then export each run to a checkpoint
# infer.py loads (train.export). Part 2 is eval_all.sh.
#
#   W=/tmp/three_way bash experiments/three_way/train_all.sh
#
# Environment (defaults in brackets): W work dir [/tmp/three_way]; OUT where the small results go
# [$W/out]; MAX_MB corpus text [40]; TRAIN_BUDGET_S wall-clock cap per run, SIGTERM -> final save
# [480]; VARIANTS [msa full sliding]; GPUS_MSA/GPUS_FULL/GPUS_SLIDING CUDA device per run [0/1/0
# when two GPUs are visible, else 0]; EXTRA_SETS more --set overrides for every run (CPU smoke);
# MSA_IMPL force the MSA implementation (default: auto when impl_check.py passes on a GPU, else xla).
set -u
cd "$(dirname "$0")/../.."
W=${W:-/tmp/three_way}
OUT=${OUT:-$W/out}
MAX_MB=${MAX_MB:-40}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-480}
VARIANTS=${VARIANTS:-msa full sliding}
EXTRA_SETS=${EXTRA_SETS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/train_all.log"; }

ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
if [ "$ngpu" -ge 2 ]; then d_full=1; else d_full=0; fi
GPUS_MSA=${GPUS_MSA:-0}; GPUS_FULL=${GPUS_FULL:-$d_full}; GPUS_SLIDING=${GPUS_SLIDING:-0}

log "corpus ($MAX_MB MB) and tokenizer"
$PY -m minimax_jax.data.corpus --out "$W/corpus" --max_mb "$MAX_MB" --seed 0 > "$OUT/corpus.json" || exit 1
$PY -m minimax_jax.data.tokenizer train --input "$W"/corpus/train-*.jsonl --field text --vocab_size 4096 \
  --out "$W/tok" >> "$OUT/train_all.log" 2>&1 || exit 1

if [ -z "${MSA_IMPL:-}" ]; then
  MSA_IMPL=xla
  if [ "$ngpu" -ge 1 ]; then
    if CUDA_VISIBLE_DEVICES=$GPUS_MSA $PY experiments/three_way/impl_check.py > "$OUT/impl_check.json" 2>"$W/impl_check.err"; then
      MSA_IMPL=auto
    else
      log "impl_check failed (rc $?): training MSA with the XLA reference; see impl_check.json / .err"
      tail -20 "$W/impl_check.err" >> "$OUT/train_all.log"
    fi
  fi
fi
log "MSA implementation for training: $MSA_IMPL (GPUs: $ngpu)"

train_one() {  # variant device
  local v=$1 dev=$2 sets
  case $v in
    msa) sets="--set model.msa_impl=$MSA_IMPL" ;;
    full) sets="--set model.layer_types=[full,full,full,full,full,full] --set msa.indexer_warmup_steps=0" ;;
    sliding) sets="--set model.layer_types=[full,full,sliding,sliding,sliding,sliding] --set model.sliding_window=512 --set msa.indexer_warmup_steps=0" ;;
    *) echo "unknown variant $v"; return 2 ;;
  esac
  local t0=$SECONDS
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$dev XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout -s TERM -k 60 "$TRAIN_BUDGET_S" \
    $PY train.py --config configs/train/demo.yaml --noprepare_data \
      --set "data.sources=[$W/corpus/train-*.jsonl]" --set "data.tokenizer=$W/tok/tokenizer.json" \
      --set "run.run_dir=$W/runs/$v" --set run.progress=false $EXTRA_SETS $sets \
      > "$W/train_$v.log" 2>&1
  local rc=$?
  log "train $v: rc $rc after $((SECONDS - t0)) s (124 = stopped by the time cap with a SIGTERM save)"
  $PY -m minimax_jax.train.export --run_dir "$W/runs/$v" --dst "$W/ckpt/$v" >> "$W/train_$v.log" 2>&1
  log "export $v: rc $?"
}

for v in $VARIANTS; do
  case $v in msa) dev=$GPUS_MSA ;; full) dev=$GPUS_FULL ;; *) dev=$GPUS_SLIDING ;; esac
  train_one "$v" "$dev" &
done
wait
for v in $VARIANTS; do
  cp "$W/train_$v.log" "$OUT/" 2>/dev/null
  cp "$W/runs/$v/metrics.jsonl" "$OUT/metrics_$v.jsonl" 2>/dev/null
done
log "done"
