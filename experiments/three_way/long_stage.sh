#!/usr/bin/env bash
# Long-row continuation of exported checkpoints, then (optionally) their eval (issue 10, session 9):
# models trained on 4K rows (stage 2 of train_all.sh) retrieve little beyond 4K; this trains them on
# longer rows. Each checkpoint keeps its own attention layout (its config), so the three variants of
# the experiment continue the same way.
#   CKPT=<exported checkpoint dir> bash experiments/three_way/long_stage.sh          # one model, named msa
#   CKPTS="msa=/tmp/tw/ckpt/msa full=/tmp/tw/ckpt/full sliding=/tmp/tw/ckpt/sliding" EVAL=0 \
#     DST=/tmp/tw/ckpt3 bash experiments/three_way/long_stage.sh                    # stage 3, side by side
#   CORPUS_ONLY=1 bash experiments/three_way/long_stage.sh                           # just the corpus
# Builds (once, in W/corpus) a corpus whose retrieval documents are LONG_MIN_CHARS..LONG_MAX_CHARS
# characters [12000..50000: ~3.5K-15K tokens]; trains each checkpoint with train.py (init.mode=checkpoint,
# fresh optimizer) on SEQ [16384] x BATCH [2] rows for STEPS [800] steps (capped at CAP_S [260] s,
# SIGTERM -> final save) at LR [5e-4]; exports to DST/<name> [W/ckpt/<name>] and runs the copy check;
# with EVAL=1 [default] runs the eval CLI at LENGTHS [4096,...,65536] under EVAL_BUDGET_S [150].
# Environment: W work dir [/tmp/long]; OUT results [$W/out]; MAX_MB corpus [60]; MSA_IMPL / ATTN_IMPL
# [auto / pallas_flash_gpu on a GPU]; MEM_FRACTION per process [0.3 with several checkpoints, else 0.75];
# EXTRA_SETS more --set flags (CPU smoke runs); SETS_<name> more --set flags for the run <name> only, after
# EXTRA_SETS (e.g. SETS_msa="--set init.mode=sparse_cpt ..." turns that copy into MSA; issue 31's recipe);
# LONG_SEED the corpus seed [2]; COPY_CHECK=0 skips the copy check; SEND_CKPT=1 sends DST/<name> back in <= 15 MiB pieces
# (cat long_ckpt_<name>.tar.part-* | tar xf -).
set -u
cd "$(dirname "$0")/../.."
W=${W:-/tmp/long}
OUT=${OUT:-$W/out}
DST=${DST:-$W/ckpt}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/long_stage.log"; }
ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
ATTN_IMPL=${ATTN_IMPL:-$([ "$ngpu" -ge 1 ] && echo pallas_flash_gpu || echo auto)}
MSA_IMPL=${MSA_IMPL:-auto}

if [ -e "$W/corpus/manifest.json" ]; then
  log "reusing $W/corpus"
else
  log "corpus (${MAX_MB:-60} MB, retrieval documents ${LONG_MIN_CHARS:-12000}-${LONG_MAX_CHARS:-50000} characters)"
  $PY -m minimax_jax.data.corpus --out "$W/corpus.tmp" --max_mb "${MAX_MB:-60}" --seed "${LONG_SEED:-2}" \
    --shares prose=0.05,code=0.05,synthetic=0.9 --synthetic_min_chars "${LONG_MIN_CHARS:-12000}" \
    --synthetic_max_chars "${LONG_MAX_CHARS:-50000}" --workers "$(( $(nproc) < 16 ? $(nproc) : 16 ))" \
    > "$OUT/corpus_long_$(basename "$W").json" || exit 1
  rm -rf "$W/corpus" && mv "$W/corpus.tmp" "$W/corpus"    # complete or absent: a killed build is redone
fi
[ "${CORPUS_ONLY:-0}" = 1 ] && exit 0

if [ -z "${CKPTS:-}" ]; then
  : "${CKPT:?set CKPT (one exported checkpoint) or CKPTS (name=dir ...)}"
  CKPTS="msa=$CKPT"
fi
n=$(echo "$CKPTS" | wc -w)
MEM=${MEM_FRACTION:-$([ "$n" -gt 1 ] && echo 0.3 || echo 0.75)}

one() {  # name checkpoint-dir
  local name=$1 ckpt=$2 t0=$SECONDS rd="$W/run_$1" own="SETS_$1"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM timeout -s TERM -k 60 "${CAP_S:-260}" $PY train.py \
    --config configs/train/demo.yaml --no_prepare_data \
    --set "data.sources=[$W/corpus/train-*.jsonl]" --set "data.tokenizer=$ckpt/tokenizer.json" \
    --set init.mode=checkpoint --set "init.path=$ckpt" --set data.seq_len="${SEQ:-16384}" \
    --set data.batch_size="${BATCH:-2}" --set run.steps="${STEPS:-800}" --set optim.lr="${LR:-5e-4}" \
    --set schedule.warmup_steps=20 --set msa.indexer_warmup_steps=0 --set model.attention_impl="$ATTN_IMPL" \
    --set model.msa_impl="$MSA_IMPL" --set "run.run_dir=$rd" --set run.progress=false --set checkpoint.every=200 \
    --set run.log_every=50 ${EXTRA_SETS:-} ${!own:-} > "$W/train_$name.log" 2>&1
  log "train $name: rc $? after $((SECONDS - t0)) s (124 = stopped by the cap with a SIGTERM save)"
  cp "$rd/metrics.jsonl" "$OUT/metrics_long_$name.jsonl" 2>/dev/null
  tail -5 "$W/train_$name.log" > "$OUT/train_long_tail_$name.txt"
  $PY -m minimax_jax.train.export --run_dir "$rd" --dst "$DST/$name" >> "$W/train_$name.log" 2>&1 \
    || { log "export $name failed"; return 1; }
  if [ "${COPY_CHECK:-1}" = 1 ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 PYTHONPATH=.:${PYTHONPATH:-} $PY experiments/learnability/induction.py repeat \
      --checkpoint "$DST/$name" > "$OUT/induction_long_$name.txt" 2>>"$W/train_$name.log"
    log "copy check $name: $(tail -1 "$OUT/induction_long_$name.txt")"
  fi
  if [ "${EVAL:-1}" = 1 ]; then
    t0=$SECONDS
    XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM timeout -k 30 $(( ${EVAL_BUDGET_S:-150} + 120 )) $PY -m minimax_jax.eval \
      --checkpoint "$DST/$name" --tasks all --lengths "${LENGTHS:-4096,8192,16384,32768,65536}" \
      --num_samples "${NUM_SAMPLES:-8}" --batch_size 8 --time_budget_s "${EVAL_BUDGET_S:-150}" --prefill_chunk 1024 \
      --ppl_seq_len 4096 --ppl_max_tokens 65536 --out "$OUT/eval_long_$name.json" > "$W/eval_$name.log" 2>&1
    log "eval $name: rc $? after $((SECONDS - t0)) s"
    cp "$W/eval_$name.log" "$OUT/" 2>/dev/null
  fi
  cp "$W/train_$name.log" "$OUT/" 2>/dev/null
  if [ "${SEND_CKPT:-0}" = 1 ]; then tar cf - -C "$DST" "$name" | split -b 15m - "$OUT/long_ckpt_$name.tar.part-"; fi
}

for pair in $CKPTS; do
  [ -d "${pair#*=}" ] || { log "no checkpoint ${pair#*=} for ${pair%%=*}"; exit 2; }
done
pids=""
for pair in $CKPTS; do one "${pair%%=*}" "${pair#*=}" & pids="$pids $!"; done
rc=0
for p in $pids; do wait "$p" || rc=1; done    # a run whose export failed fails the stage (a capped run does not)
log "done (rc $rc)"
exit $rc
