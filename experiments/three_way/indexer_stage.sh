#!/usr/bin/env bash
# Indexer-only continuation of an MSA checkpoint, then the same-run eval of before / after / dense
# (issue 10, session 10). Run 5's MSA model trails full attention at 4K (0.69-0.88 vs 1.00 on the
# needle tasks) with an indexer block recall of 0.77; its indexer warmed up for only 168 steps with the
# whole model training. This trains the index branches alone (backbone frozen: msa.indexer_warmup_steps
# = run.steps with msa.freeze_backbone_in_warmup, i.e. dense attention + the dense indexer KL for every
# step, the M3 recipe's warm-up), so the network the selection serves is unchanged, and measures:
#   - before: the checkpoint as trained (MSA);
#   - after:  the checkpoint with the retrained indexer (MSA);
#   - dense:  the checkpoint with its MSA layers run as full attention (eval --attention dense), the
#             upper bound any indexer of this backbone can reach;
# each with the eval CLI (all five tasks at LENGTHS, NUM_SAMPLES per cell, same seed = same prompts) and
# the indexer block recall at RECALL_LENGTH tokens of held-out prose (before / after).
#
#   CKPT=checkpoints/demo bash experiments/three_way/indexer_stage.sh
#
# Environment: CKPT [checkpoints/demo]; W work dir [/tmp/idx]; OUT results [$W/out]; MAX_MB corpus [40]
# (retrieval documents 500-12,000 characters, seed SEED [3]: documents the checkpoint never saw);
# SEQ [4096] x BATCH [8] rows, STEPS [800] steps at LR [1e-3] (constant after a short warm-up),
# capped at CAP_S [240] s (SIGTERM -> final save); LENGTHS [2048,4096,8192]; NUM_SAMPLES [8];
# EVAL_BUDGET_S [150] per eval; RECALL_LENGTH [4096]; MEM_FRACTION per process [0.3];
# EXTRA_SETS more --set flags (CPU smoke runs); SEND_CKPT=1 sends the new checkpoint back in <= 15 MiB
# pieces (cat idx_ckpt.tar.part-* | tar xf -).
set -u
cd "$(dirname "$0")/../.."
CKPT=${CKPT:-checkpoints/demo}
W=${W:-/tmp/idx}
OUT=${OUT:-$W/out}
PY=${PYTHON:-python3}
LENGTHS=${LENGTHS:-2048,4096,8192}
MEM=${MEM_FRACTION:-0.3}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/indexer_stage.log"; }
[ -d "$CKPT" ] || { log "no checkpoint $CKPT"; exit 2; }
ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
ATTN_IMPL=${ATTN_IMPL:-$([ "$ngpu" -ge 1 ] && echo pallas_flash_gpu || echo auto)}

if [ -e "$W/corpus/manifest.json" ]; then
  log "reusing $W/corpus"
else
  log "corpus (${MAX_MB:-40} MB, seed ${SEED:-3})"
  $PY -m minimax_jax.data.corpus --out "$W/corpus.tmp" --max_mb "${MAX_MB:-40}" --seed "${SEED:-3}" \
    --shares prose=0.05,code=0.05,synthetic=0.9 --synthetic_max_chars 12000 \
    --workers "$(( $(nproc) < 16 ? $(nproc) : 16 ))" > "$OUT/corpus_idx.json" || exit 1
  rm -rf "$W/corpus" && mv "$W/corpus.tmp" "$W/corpus"    # complete or absent: a killed build is redone
fi
# Held-out prose (works never trained on) for the recall measurement.
$PY - "$W" <<'EOF' || exit 1
import json, sys
w = sys.argv[1]
docs = [json.loads(l) for l in open(f"{w}/corpus/heldout.jsonl", encoding="utf-8")]
open(f"{w}/heldout_prose.txt", "w", encoding="utf-8").write(
    "\n\n".join(d["text"] for d in docs if d["source"].startswith("shakespeare")))
EOF

STEPS=${STEPS:-800}
t0=$SECONDS
# shellcheck disable=SC2086
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout -s TERM -k 60 "${CAP_S:-240}" $PY train.py \
  --config configs/train/demo.yaml --no_prepare_data \
  --set "data.sources=[$W/corpus/train-*.jsonl]" --set "data.tokenizer=$CKPT/tokenizer.json" \
  --set init.mode=checkpoint --set "init.path=$CKPT" --set data.seq_len="${SEQ:-4096}" \
  --set data.batch_size="${BATCH:-8}" --set run.steps="$STEPS" --set msa.indexer_warmup_steps="$STEPS" \
  --set msa.freeze_backbone_in_warmup=true --set msa.warmup_lr="${LR:-1e-3}" --set schedule.warmup_steps=20 \
  --set model.attention_impl="$ATTN_IMPL" --set model.msa_impl="${MSA_IMPL:-auto}" --set "run.run_dir=$W/run" \
  --set run.progress=false --set checkpoint.every=200 --set run.log_every=50 ${EXTRA_SETS:-} > "$W/train_idx.log" 2>&1
log "train (indexer only): rc $? after $((SECONDS - t0)) s (124 = stopped by the cap with a SIGTERM save)"
cp "$W/run/metrics.jsonl" "$OUT/metrics_idx.jsonl" 2>/dev/null
cp "$W/train_idx.log" "$OUT/" 2>/dev/null
$PY -m minimax_jax.train.export --run_dir "$W/run" --dst "$W/ckpt_idx" >> "$OUT/train_idx.log" 2>&1 \
  || { log "export failed"; exit 1; }
# The backbone must be bit-identical: only index_* leaves may differ.
$PY - "$CKPT" "$W/ckpt_idx" > "$OUT/frozen_check.txt" 2>&1 <<'EOF'
import sys
import jax
import numpy as np
from minimax_jax.infer.loading import load_model
a, b = (load_model(p) for p in sys.argv[1:3])
fa = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(a.params)}
fb = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(b.params)}
assert fa.keys() == fb.keys(), "different parameter trees"
changed = [k for k in fa if not np.array_equal(np.asarray(fa[k]), np.asarray(fb[k]))]
bad = [k for k in changed if "index_" not in k]
print(f"{len(changed)} of {len(fa)} leaves changed; non-index leaves changed: {bad}")
sys.exit(1 if bad or not changed else 0)
EOF
log "frozen-backbone check: rc $? ($(tail -1 "$OUT/frozen_check.txt"))"

eval_one() {  # name checkpoint attention
  local t0=$SECONDS
  XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM timeout -k 30 $(( ${EVAL_BUDGET_S:-150} + 150 )) $PY -m minimax_jax.eval \
    --checkpoint "$2" --attention "$3" --tasks all --lengths "$LENGTHS" --num_samples "${NUM_SAMPLES:-8}" \
    --batch_size 8 --time_budget_s "${EVAL_BUDGET_S:-150}" --prefill_chunk 1024 --ppl_seq_len 4096 \
    --ppl_max_tokens 65536 --out "$OUT/eval_$1.json" > "$W/eval_$1.log" 2>&1
  log "eval $1: rc $? after $((SECONDS - t0)) s"
  if [ "$3" = as_trained ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout -k 10 180 $PY -m minimax_jax.eval.recall --checkpoint "$2" \
      --text_file "$W/heldout_prose.txt" --length "${RECALL_LENGTH:-4096}" --out "$OUT/recall_$1.json" >> "$W/eval_$1.log" 2>&1
    log "recall $1: rc $?"
  fi
  cp "$W/eval_$1.log" "$OUT/" 2>/dev/null
}
eval_one before "$CKPT" as_trained &
eval_one after "$W/ckpt_idx" as_trained &
eval_one dense "$CKPT" dense &
wait
if [ "${SEND_CKPT:-0}" = 1 ]; then tar cf - -C "$W" ckpt_idx | split -b 15m - "$OUT/idx_ckpt.tar.part-"; fi
log "done"
