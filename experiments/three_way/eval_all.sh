#!/usr/bin/env bash
# Three-way experiment, part 2 (issue 10): evaluate the checkpoints train_all.sh exported, with the
# eval CLI and infer.py only:
#   - RULER-style tasks (python -m minimax_jax.eval, all five tasks) at LENGTHS, NUM_SAMPLES each,
#     shortest prompts first under EVAL_BUDGET_S (prompts not reached are listed as skipped), plus
#     held-out perplexity (PPL_SEQ [4096]-token windows of the held-out Shakespeare works);
#   - indexer block recall vs dense attention's top blocks (python -m minimax_jax.eval.recall) for
#     the MSA checkpoint at RECALL_LENGTH tokens of held-out text;
#   - time per token: infer.py with a held-out context of about CTX_TOKENS tokens, 64 new tokens.
#
#   W=/tmp/three_way bash experiments/three_way/eval_all.sh
#
# VARIANTS may also name msa_dense: the MSA checkpoint evaluated with `--attention dense` (its MSA layers
# run as full attention: the ceiling of any indexer of that backbone; RESULTS.md, session 10) and msa_top<N>:
# the MSA checkpoint with index_topk N (a copy under W with its config.yaml edited); give each
# of N variants sharing one GPU MEM_FRACTION <= 0.9 / N. RECALL_ONLY=1: only the indexer recall, of every
# variant in VARIANTS (each a checkpoint CKPT_ROOT/<variant> with MSA layers; e.g. an indexer warm-up's export).
# Environment: W [/tmp/three_way]; OUT [$W/out]; CKPT_ROOT [$W/ckpt]; VARIANTS [msa full sliding]; TASKS [all]; LENGTHS
# [2048,4096,8192,16384,32768,65536]; NUM_SAMPLES [8]; BATCH [8]; EVAL_BUDGET_S [240] (the eval CLI's
# own budget) and EVAL_SLACK_S [240] (hard cap = budget + slack: loading, compilation, perplexity);
# RECALL_LENGTH [4096: the training row]; RECALL_TIMEOUT_S [180]; PPL_BUCKETS perplexity-by-position bucket edges (--ppl_buckets, e.g.
# 1024,4096,16384; default: the eval CLI's); INFER=0 skips the infer.py timing; CTX_TOKENS [32768]; PREFILL_CHUNK paged-engine prefill step [1024];
# GPUS_* and MEM_FRACTION (per process; 0.3 when three share one GPU) as in train_all.sh.
set -u
cd "$(dirname "$0")/../.."
W=${W:-/tmp/three_way}
OUT=${OUT:-$W/out}
VARIANTS=${VARIANTS:-msa full sliding}
CKPT_ROOT=${CKPT_ROOT:-$W/ckpt}    # <root>/<variant>: train_all.sh's exports, or long_stage.sh's (stage 3)
LENGTHS=${LENGTHS:-2048,4096,8192,16384,32768,65536}
NUM_SAMPLES=${NUM_SAMPLES:-8}
BATCH=${BATCH:-8}
EVAL_BUDGET_S=${EVAL_BUDGET_S:-240}
RECALL_LENGTH=${RECALL_LENGTH:-4096}
CTX_TOKENS=${CTX_TOKENS:-32768}
PPL_SEQ=${PPL_SEQ:-4096}
PREFILL_CHUNK=${PREFILL_CHUNK:-1024}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/eval_all.log"; }

ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
if [ "$ngpu" -ge 2 ]; then d_full=1; else d_full=0; fi
GPUS_MSA=${GPUS_MSA:-0}; GPUS_FULL=${GPUS_FULL:-$d_full}; GPUS_SLIDING=${GPUS_SLIDING:-0}

# Held-out text (works never trained on) for recall and the timing context.
$PY - "$W" <<'EOF' || exit 1
import json, sys
w = sys.argv[1]
docs = [json.loads(l) for l in open(f"{w}/corpus/heldout.jsonl", encoding="utf-8")]
text = "\n\n".join(d["text"] for d in docs if d["source"].startswith("shakespeare"))
open(f"{w}/heldout_prose.txt", "w", encoding="utf-8").write(text)
EOF

recall_one() {  # variant: block recall of CKPT_ROOT/<variant> at RECALL_LENGTH tokens of held-out text
  local t0=$SECONDS
  timeout -k 10 "${RECALL_TIMEOUT_S:-180}" $PY -m minimax_jax.eval.recall --checkpoint "$CKPT_ROOT/$1" --text_file "$W/heldout_prose.txt" \
    --length "$RECALL_LENGTH" --out "$OUT/recall_$1.json" >> "$W/eval_$1.log" 2>&1
  log "recall $1: rc $? after $((SECONDS - t0)) s"
  cp "$W/eval_$1.log" "$OUT/" 2>/dev/null
}

eval_one() {  # variant device
  local v=$1 dev=$2 t0=$SECONDS ck=$CKPT_ROOT/$1 att=as_trained
  [ "$v" = msa_dense ] && { ck=$CKPT_ROOT/msa; att=dense; }
  case $v in msa_top[0-9]*)   # the same weights selecting top-N blocks (an inference-time choice)
    ck=$W/ckpt_$v; rm -rf "$ck"; cp -r "$CKPT_ROOT/msa" "$ck" || return
    sed -i "s/^index_topk: .*/index_topk: ${v#msa_top}/" "$ck/config.yaml"
    grep -q "^index_topk: ${v#msa_top}\$" "$ck/config.yaml" || { log "eval $v: no index_topk line in config.yaml"; return; } ;;
  esac
  export CUDA_VISIBLE_DEVICES=$dev XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.45}
  if [ "${RECALL_ONLY:-0}" = 1 ]; then recall_one "$v"; return; fi
  timeout -k 30 $((EVAL_BUDGET_S + ${EVAL_SLACK_S:-240})) $PY -m minimax_jax.eval --checkpoint "$ck" --attention "$att" --tasks "${TASKS:-all}" \
    --lengths "$LENGTHS" --num_samples "$NUM_SAMPLES" --batch_size "$BATCH" --time_budget_s "$EVAL_BUDGET_S" \
    --prefill_chunk "$PREFILL_CHUNK" \
    --ppl_seq_len "$PPL_SEQ" --ppl_max_tokens 65536 ${PPL_BUCKETS:+--ppl_buckets "$PPL_BUCKETS"} --out "$OUT/eval_$v.json" > "$W/eval_$v.log" 2>&1
  log "eval $v: rc $? after $((SECONDS - t0)) s"
  [ "$v" = msa ] && recall_one "$v"
  if [ "${INFER:-1}" = 0 ]; then cp "$W/eval_$v.log" "$OUT/" 2>/dev/null; return; fi
  # About 3.3 characters per token for this tokenizer on Shakespeare.
  head -c $((CTX_TOKENS * 33 / 10)) "$W/heldout_prose.txt" > "$W/ctx_$v.txt"
  timeout -k 10 180 $PY infer.py --checkpoint "$ck" --attention "$att" --context_file "$W/ctx_$v.txt" \
    --prompt "Summarise the scene above." --max_new_tokens 64 --show_stats --nostream --prefill_chunk "$PREFILL_CHUNK" \
    > "$OUT/infer_$v.txt" 2>&1
  log "infer $v: rc $?"
  cp "$W/eval_$v.log" "$OUT/" 2>/dev/null
}

for v in $VARIANTS; do
  case $v in msa|msa_dense|msa_top*) dev=$GPUS_MSA ;; full) dev=$GPUS_FULL ;; *) dev=$GPUS_SLIDING ;; esac
  eval_one "$v" "$dev" &
done
wait
log "done"
