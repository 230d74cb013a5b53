#!/usr/bin/env bash
# A long-row continuation of one exported checkpoint, then its eval (issue 10, session 9): does a model
# trained on 4K rows (stage 2 of train_all.sh) retrieve beyond 4K once it has seen longer rows?
#   CKPT=<exported checkpoint dir> bash experiments/three_way/long_stage.sh
# Builds a corpus whose retrieval documents are LONG_MIN_CHARS..LONG_MAX_CHARS characters [12000..50000:
# ~3.5K-15K tokens], trains with train.py (init.mode=checkpoint, fresh optimizer) on SEQ [16384] x
# BATCH [2] rows for STEPS [800] steps (capped at CAP_S [260] s, SIGTERM -> final save) at LR [5e-4],
# exports, then runs the eval CLI at LENGTHS [4096,...,65536] under EVAL_BUDGET_S [150] and the copy
# check. Environment: W work dir [/tmp/long]; OUT results [$W/out]; MAX_MB corpus [60]; MSA_IMPL /
# ATTN_IMPL [auto / pallas_flash on a GPU]; EXTRA_SETS more --set flags (CPU smoke runs); SEND_CKPT [0].
set -u
cd "$(dirname "$0")/../.."
: "${CKPT:?set CKPT to an exported checkpoint directory (train.export)}"
W=${W:-/tmp/long}
OUT=${OUT:-$W/out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/long_stage.log"; }
ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
ATTN_IMPL=${ATTN_IMPL:-$([ "$ngpu" -ge 1 ] && echo pallas_flash || echo auto)}
MSA_IMPL=${MSA_IMPL:-auto}

log "corpus (${MAX_MB:-60} MB, retrieval documents ${LONG_MIN_CHARS:-12000}-${LONG_MAX_CHARS:-50000} characters)"
$PY -m minimax_jax.data.corpus --out "$W/corpus" --max_mb "${MAX_MB:-60}" --seed 2 \
  --shares prose=0.05,code=0.05,synthetic=0.9 --synthetic_min_chars "${LONG_MIN_CHARS:-12000}" \
  --synthetic_max_chars "${LONG_MAX_CHARS:-50000}" --workers "$(( $(nproc) < 16 ? $(nproc) : 16 ))" \
  > "$OUT/corpus_long.json" || exit 1

t0=$SECONDS
# shellcheck disable=SC2086
timeout -s TERM -k 60 "${CAP_S:-260}" $PY train.py --config configs/train/demo.yaml --noprepare_data \
  --set "data.sources=[$W/corpus/train-*.jsonl]" --set "data.tokenizer=$CKPT/tokenizer.json" \
  --set init.mode=checkpoint --set "init.path=$CKPT" --set data.seq_len="${SEQ:-16384}" \
  --set data.batch_size="${BATCH:-2}" --set run.steps="${STEPS:-800}" --set optim.lr="${LR:-5e-4}" \
  --set schedule.warmup_steps=20 --set msa.indexer_warmup_steps=0 --set model.attention_impl="$ATTN_IMPL" \
  --set model.msa_impl="$MSA_IMPL" --set "run.run_dir=$W/run" --set run.progress=false --set checkpoint.every=200 \
  --set run.log_every=50 ${EXTRA_SETS:-} > "$W/train.log" 2>&1
log "train: rc $? after $((SECONDS - t0)) s (124 = stopped by the cap with a SIGTERM save)"
cp "$W/run/metrics.jsonl" "$OUT/metrics_long.jsonl" 2>/dev/null
tail -5 "$W/train.log" > "$OUT/train_long_tail.txt"
$PY -m minimax_jax.train.export --run_dir "$W/run" --dst "$W/ckpt" >> "$W/train.log" 2>&1 || { log "export failed"; exit 1; }

t0=$SECONDS
timeout -k 30 $(( ${EVAL_BUDGET_S:-150} + 120 )) $PY -m minimax_jax.eval --checkpoint "$W/ckpt" --tasks all \
  --lengths "${LENGTHS:-4096,8192,16384,32768,65536}" --num_samples "${NUM_SAMPLES:-8}" --batch_size 8 \
  --time_budget_s "${EVAL_BUDGET_S:-150}" --prefill_chunk 1024 --ppl_seq_len 4096 --ppl_max_tokens 65536 \
  --out "$OUT/eval_long.json" > "$W/eval.log" 2>&1
log "eval: rc $? after $((SECONDS - t0)) s"
PYTHONPATH=.:${PYTHONPATH:-} $PY experiments/learnability/induction.py repeat --checkpoint "$W/ckpt" \
  > "$OUT/induction_long.txt" 2>>"$W/eval.log"
log "copy check: $(tail -1 "$OUT/induction_long.txt")"
cp "$W/eval.log" "$W/train.log" "$OUT/" 2>/dev/null
# SEND_CKPT=1: the continued checkpoint comes back too, in <= 15 MiB pieces (cat long_ckpt.tar.part-* | tar xf -)
if [ "${SEND_CKPT:-0}" = 1 ]; then tar cf - -C "$W" ckpt | split -b 15m - "$OUT/long_ckpt.tar.part-"; fi
