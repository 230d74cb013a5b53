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
# [$W/out]; MAX_MB corpus text [170]; SYNTH_MAX_CHARS longest retrieval document [12000: fits a 4K row]; SHARES corpus shares [prose=0.05,code=0.05,synthetic=0.9:
# all of Shakespeare and the stdlib source, the rest dense retrieval documents, whose haystacks are
# Shakespeare too]; TRAIN_BUDGET_S wall-clock cap per run, SIGTERM -> final save [480];
# VARIANTS [msa full sliding]; GPUS_MSA/GPUS_FULL/GPUS_SLIDING CUDA device per run [0/1/1
# when two GPUs are visible, else 0]; EXTRA_SETS more --set overrides for every run (CPU smoke);
# MSA_IMPL force the MSA implementation (default: auto when impl_check.py passes on a GPU, else xla);
# STEPS the same step count for all three runs (default: measured by a short probe of the MSA run,
# the slowest, so that it finishes inside TRAIN_BUDGET_S; the cosine schedule then ends where the
# run ends and the three runs see the same batches); WARMUP_FRAC share of MSA indexer warm-up [0.12];
# PROBE_SIDE a command run on the other GPU while the probe runs (optional); CONTENTION (below);
# VOCAB the BPE vocabulary and the model's vocab_size [configs/demo-m3.yaml's] (RESULTS.md: the
# copy-task plateau lengthens steeply with the vocabulary).
# Curriculum (off unless CURRICULUM_STEPS > 0; RESULTS.md run 3: no model learned to copy): stage 1
# trains every variant for CURRICULUM_STEPS steps on a second corpus of short documents
# (SHORT_MAX_CHARS [1500] characters, SHORT_MB [30] MB, SHORT_SHARES [prose=0.05,code=0.05,synthetic=0.3,
# copy=0.6]: copy documents (minimax_jax.data.copying) repeat each span 2-3 times, the densest signal
# for in-context copying) in rows of SHORT_SEQ [1024] x SHORT_BATCH [32] (RESULTS.md "What learning to
# copy needs": the induction circuit formed with 256 x 128 or 64 x 512 tokens per step and never with
# 16-32 rows; run 4's 16 x 1,024 did not copy), capped at CURRICULUM_CAP_S [150] s, exports it, and records
# the copy check of experiments/learnability/induction.py (induction_<v>.txt); stage 2 (the runs
# above) starts from those weights (init.mode=checkpoint) with a fresh optimizer; the MSA variant
# does its indexer warm-up in stage 1 only.
# SHARED_STAGE1=1 (session 9): stage 1 trains ONE model, all layers full attention, alone on the GPU
# (MEM_FRACTION_STAGE1 [0.6]), and all three stage-2 runs start from it: full and sliding load it as
# is (init.mode=checkpoint; sliding swaps layers 2-5 to windows), MSA turns layers 2-5 into MSA
# (init.mode=sparse_cpt: fresh index branches) and warms its indexer up for WARMUP_FRAC of stage 2.
# Three stage-1 runs side by side cost three times the GPU time for a weaker copy circuit each
# (RESULTS.md "Stage 1 with 32K-token batches"); a shared start also removes stage-1 luck from the
# comparison, which is then about long-context training with each attention kind.
# RESULTS.md run 5 is this mode (its commands are there); the first run whose models retrieve.
set -u
cd "$(dirname "$0")/../.."
W=${W:-/tmp/three_way}
OUT=${OUT:-$W/out}
MAX_MB=${MAX_MB:-170}
SHARES=${SHARES:-prose=0.05,code=0.05,synthetic=0.9}
WARMUP_FRAC=${WARMUP_FRAC:-0.12}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-480}
VARIANTS=${VARIANTS:-msa full sliding}
EXTRA_SETS=${EXTRA_SETS:-}
PY=${PYTHON:-python3}
VOCAB=${VOCAB:-$($PY -c "import yaml; print(yaml.safe_load(open('configs/demo-m3.yaml'))['model']['vocab_size'])")}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/train_all.log"; }
CURRICULUM_STEPS=${CURRICULUM_STEPS:-0}
if [ "$CURRICULUM_STEPS" -le 0 ] && { [ "${STOP_AFTER_STAGE1:-0}" = 1 ] || [ "${REUSE_W:-0}" = 1 ]; }; then
  log "STOP_AFTER_STAGE1 / REUSE_W split the curriculum's two stages: set CURRICULUM_STEPS > 0 (the same in both calls)"
  exit 2
fi

ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
if [ "$ngpu" -ge 2 ]; then d_full=1; else d_full=0; fi
GPUS_MSA=${GPUS_MSA:-0}; GPUS_FULL=${GPUS_FULL:-$d_full}; GPUS_SLIDING=${GPUS_SLIDING:-$d_full}

# The Pallas-vs-XLA MSA check (impl_check.py) runs on the GPU while the CPU builds the corpus.
IMPL_PID=
if [ -z "${MSA_IMPL:-}" ] && [ "$ngpu" -ge 1 ]; then
  CUDA_VISIBLE_DEVICES=$GPUS_MSA XLA_PYTHON_CLIENT_MEM_FRACTION=${IMPL_MEM_FRACTION:-0.25} $PY experiments/three_way/impl_check.py > "$OUT/impl_check.json" 2>"$W/impl_check.err" &
  IMPL_PID=$!
fi
# REUSE_W=1: keep what an earlier call on the same machine built in W (corpora, tokenizer, stage-1
# checkpoints) instead of building it again; with STOP_AFTER_STAGE1=1 on the first call, stage 1 and
# stage 2 fit two device calls (the machine stays warm between them).
done_before() { [ "${REUSE_W:-0}" = 1 ] && [ -e "$1" ] && log "reusing $1"; }
# The short-document corpus (stage 1 only) builds on the CPU next to the main corpus; it is not needed
# when every stage-1 checkpoint is already there (a stage-2 call on a fresh machine, see device.sh).
NWORK=$(( $(nproc) < 16 ? $(nproc) : 16 ))
SHORT_PID=
stage1_needed() {
  local v
  [ "$CURRICULUM_STEPS" -gt 0 ] || return 1
  for v in $(stage1_variants); do [ -e "$W/ckpt1/$v" ] || return 0; done
  return 1
}
stage1_variants() { if [ "${SHARED_STAGE1:-0}" = 1 ]; then echo full; else echo "$VARIANTS"; fi; }
if stage1_needed && ! done_before "$W/corpus_short/manifest.json"; then
  log "short-document corpus for the curriculum"
  $PY -m minimax_jax.data.corpus --out "$W/corpus_short" --max_mb "${SHORT_MB:-30}" --seed 1 \
    --shares "${SHORT_SHARES:-prose=0.05,code=0.05,synthetic=0.3,copy=0.6}" \
    --synthetic_min_chars 300 --synthetic_max_chars "${SHORT_MAX_CHARS:-1500}" \
    --workers "$NWORK" > "$OUT/corpus_short.json" &
  SHORT_PID=$!
fi
if ! done_before "$W/corpus/manifest.json"; then
  log "corpus ($MAX_MB MB)"
  $PY -m minimax_jax.data.corpus --out "$W/corpus" --max_mb "$MAX_MB" --seed 0 --shares "$SHARES" \
    --synthetic_max_chars "${SYNTH_MAX_CHARS:-12000}" --workers "$NWORK" > "$OUT/corpus.json" || exit 1
fi
if ! done_before "$W/tok/tokenizer.json"; then
  log "tokenizer"
  $PY -m minimax_jax.data.tokenizer train --input "$W"/corpus/train-*.jsonl --field text --vocab_size "$VOCAB" \
    --max_chars 40000000 --split_digits --out "$W/tok" >> "$OUT/train_all.log" 2>&1 || exit 1
fi
if [ -n "$SHORT_PID" ]; then wait "$SHORT_PID" || { log "short-document corpus failed"; exit 1; }; fi
[ "$CURRICULUM_STEPS" -gt 0 ] && WARMUP_FRAC=0     # the MSA indexer warm-up happens in stage 1

if [ -z "${MSA_IMPL:-}" ]; then
  MSA_IMPL=xla
  if [ -n "$IMPL_PID" ]; then
    if wait "$IMPL_PID"; then
      MSA_IMPL=auto
    else
      log "impl_check failed (rc $?): training MSA with the XLA reference; see impl_check.json / .err"
      tail -20 "$W/impl_check.err" >> "$OUT/train_all.log"
    fi
  fi
fi
# Dense attention (layers 0-1, the full variant, the MSA warm-up) through the flash kernels on a GPU:
# the XLA reference keeps [H, T, S] probabilities per layer for the backward.
if [ -z "${ATTN_IMPL:-}" ]; then ATTN_IMPL=auto; [ "$ngpu" -ge 1 ] && ATTN_IMPL=pallas_flash_gpu; fi
log "MSA implementation for training: $MSA_IMPL; dense attention: $ATTN_IMPL (GPUs: $ngpu)"
COMMON_SETS="--set model.attention_impl=$ATTN_IMPL --set model.vocab_size=$VOCAB"

tc() {  # CUDA device, cap s, args...: train.py with the shared data flags
  local dev=$1 cap=$2; shift 2
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$dev XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.45} timeout -s TERM -k 60 "$cap" \
    $PY train.py --config configs/train/demo.yaml --no_prepare_data \
      --set "data.sources=[$W/corpus/train-*.jsonl]" --set "data.tokenizer=$W/tok/tokenizer.json" \
      --set run.progress=false $COMMON_SETS $EXTRA_SETS "$@"
}

# DEADLINE_EPOCH (optional, seconds since the epoch): the whole script must be done by then (a
# device call's limit); the training cap shrinks to fit, leaving EXPORT_S [45] for the exports.
fit_budget() {
  if [ -n "${DEADLINE_EPOCH:-}" ]; then
    local left=$((DEADLINE_EPOCH - $(date +%s) - ${EXPORT_S:-45}))
    [ "$left" -lt "$TRAIN_BUDGET_S" ] && TRAIN_BUDGET_S=$left
  fi
  log "training cap: $TRAIN_BUDGET_S s"
}
fit_budget

variant_sets() {  # variant -> the --set flags of its attention layers
  case $1 in
    msa) echo "--set model.msa_impl=$MSA_IMPL" ;;
    full) echo "--set model.layer_types=[full,full,full,full,full,full] --set msa.indexer_warmup_steps=0" ;;
    sliding) echo "--set model.layer_types=[full,full,sliding,sliding,sliding,sliding] --set model.sliding_window=512 --set msa.indexer_warmup_steps=0" ;;
    *) return 2 ;;
  esac
}
dev_of() { case $1 in msa) echo "$GPUS_MSA" ;; full) echo "$GPUS_FULL" ;; *) echo "$GPUS_SLIDING" ;; esac; }

stage1_one() {  # variant device
  local v=$1 dev=$2 t0=$SECONDS warm="" mem=${MEM_FRACTION:-0.45}
  [ "$v" = msa ] && warm="--set msa.indexer_warmup_steps=$(( CURRICULUM_STEPS / 5 ))"
  [ "${SHARED_STAGE1:-0}" = 1 ] && mem=${MEM_FRACTION_STAGE1:-0.6}
  # shellcheck disable=SC2046,SC2086
  MEM_FRACTION=$mem tc "$dev" "${CURRICULUM_CAP_S:-150}" --set "run.run_dir=$W/runs1/$v" --set run.steps=$CURRICULUM_STEPS \
    --set "data.sources=[$W/corpus_short/train-*.jsonl]" --set data.seq_len=${SHORT_SEQ:-1024} \
    --set data.batch_size=${SHORT_BATCH:-32} --set schedule.warmup_steps=50 $(variant_sets "$v") $warm \
    > "$W/stage1_$v.log" 2>&1
  log "stage 1 $v: rc $? after $((SECONDS - t0)) s"
  $PY -m minimax_jax.train.export --run_dir "$W/runs1/$v" --dst "$W/ckpt1/$v" >> "$W/stage1_$v.log" 2>&1
  log "stage 1 export $v: rc $?"
  CUDA_VISIBLE_DEVICES=$dev XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 $PY experiments/learnability/induction.py repeat \
    --checkpoint "$W/ckpt1/$v" > "$OUT/induction_$v.txt" 2>>"$W/stage1_$v.log"
  log "stage 1 copy check $v: $(tail -1 "$OUT/induction_$v.txt")"
  cp "$W/runs1/$v/metrics.jsonl" "$OUT/metrics_stage1_$v.jsonl" 2>/dev/null
}
if [ "$CURRICULUM_STEPS" -gt 0 ]; then
  for v in $(stage1_variants); do done_before "$W/ckpt1/$v" || stage1_one "$v" "$(dev_of "$v")" & done
  wait
  if [ "${STOP_AFTER_STAGE1:-0}" = 1 ]; then log "stage 1 done (STOP_AFTER_STAGE1=1)"; exit 0; fi
  fit_budget
fi
[ "${SHARED_STAGE1:-0}" = 1 ] && [ "$CURRICULUM_STEPS" -gt 0 ] && WARMUP_FRAC=${WARMUP_FRAC_SHARED:-0.12}

if [ -z "${STEPS:-}" ]; then
  # Probe: the MSA run (the slowest) for 8 warm-up + 16 sparse steps, timed per phase from its
  # metrics (the first interval of each phase includes compilation and is not used).
  log "probe: timing the MSA run's two phases"
  [ -n "${PROBE_SIDE:-}" ] && [ "$ngpu" -ge 2 ] && { CUDA_VISIBLE_DEVICES=1 bash -c "$PROBE_SIDE" > "$OUT/probe_side.log" 2>&1 & }
  t0=$SECONDS
  tc "$GPUS_MSA" 300 --set "run.run_dir=$W/probe" --set model.msa_impl=$MSA_IMPL --set run.steps=24 \
    --set msa.indexer_warmup_steps=8 --set run.log_every=4 --set checkpoint.every=1000 > "$W/probe.log" 2>&1
  probe_s=$((SECONDS - t0))
  wait
  fit_budget
  # CONTENTION: the MSA run's slowdown from sharing its GPU ([1.0] with two GPUs, where MSA has one
  # to itself; [1.7] with one: run 2 used 2.2 and the MSA run finished 575 steps in 334 s of its 420 s
  # cap, ~1.9x its solo step time including its compilation, the others having finished earlier)
  if [ -z "${CONTENTION:-}" ]; then CONTENTION=1.7; [ "$ngpu" -ge 2 ] && CONTENTION=1.0; fi
  STEPS=$($PY - "$W/probe/metrics.jsonl" "$TRAIN_BUDGET_S" "$probe_s" "$WARMUP_FRAC" "$CONTENTION" 2>>"$OUT/train_all.log" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = {r["step"]: r for r in rows if "time" in r and "phase_warmup" in r}
budget, probe_s, frac = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
# wall time between log lines of one phase (steps 5-8 warm-up, 17-24 sparse: no compilation inside)
sw = (rows[8]["time"] - rows[4]["time"]) / 4
ss = (rows[24]["time"] - rows[16]["time"]) / 8
overhead = max(probe_s - 8 * sw - 16 * ss, 30.0)                  # start-up + two compilations
contention = float(sys.argv[5])
n = int((budget - overhead) * 0.93 / (contention * (frac * sw + (1 - frac) * ss)))
print(max(n, 50))
print(f"probe: warm-up {sw:.3f} s/step, sparse {ss:.3f} s/step, overhead {overhead:.0f} s, contention x{contention}"
      f" -> {n} steps", file=sys.stderr)
PYEOF
  ) || { log "probe failed, see probe.log"; tail -30 "$W/probe.log" >> "$OUT/train_all.log"; exit 1; }
  cp "$W/probe/metrics.jsonl" "$OUT/metrics_probe.jsonl" 2>/dev/null
fi
fit_budget
WARM_STEPS=$($PY -c "print(max(1, int($STEPS * $WARMUP_FRAC)))")
log "steps for every run: $STEPS (MSA indexer warm-up $WARM_STEPS)"

train_one() {  # variant device
  local v=$1 dev=$2 sets
  sets=$(variant_sets "$v") || { echo "unknown variant $v"; return 2; }
  if [ "$CURRICULUM_STEPS" -gt 0 ] && [ "${SHARED_STAGE1:-0}" = 1 ]; then
    if [ "$v" = msa ]; then   # the dense stage-1 model with MSA index branches added on layers 2-5
      sets="$sets --set init.mode=sparse_cpt --set init.path=$W/ckpt1/full --set msa.layers=[2,3,4,5]"
      sets="$sets --set msa.indexer_warmup_steps=$WARM_STEPS --set msa.freeze_backbone_in_warmup=false"
    else
      sets="$sets --set init.mode=checkpoint --set init.path=$W/ckpt1/full"
    fi
  elif [ "$CURRICULUM_STEPS" -gt 0 ]; then
    sets="$sets --set init.mode=checkpoint --set init.path=$W/ckpt1/$v"
    [ "$v" = msa ] && sets="$sets --set msa.indexer_warmup_steps=0"
  elif [ "$v" = msa ]; then
    sets="$sets --set msa.indexer_warmup_steps=$WARM_STEPS"
  fi
  local t0=$SECONDS
  # shellcheck disable=SC2086
  tc "$dev" "$TRAIN_BUDGET_S" --set "run.run_dir=$W/runs/$v" --set run.steps=$STEPS $sets > "$W/train_$v.log" 2>&1
  local rc=$?
  log "train $v: rc $rc after $((SECONDS - t0)) s (124 = stopped by the time cap with a SIGTERM save)"
  $PY -m minimax_jax.train.export --run_dir "$W/runs/$v" --dst "$W/ckpt/$v" >> "$W/train_$v.log" 2>&1
  log "export $v: rc $?"
  CUDA_VISIBLE_DEVICES=$dev XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 $PY experiments/learnability/induction.py repeat \
    --checkpoint "$W/ckpt/$v" > "$OUT/induction_final_$v.txt" 2>>"$W/train_$v.log"
  log "copy check $v: $(tail -1 "$OUT/induction_final_$v.txt")"
}

for v in $VARIANTS; do train_one "$v" "$(dev_of "$v")" & done
wait
for v in $VARIANTS; do
  cp "$W/train_$v.log" "$OUT/" 2>/dev/null
  cp "$W/runs/$v/metrics.jsonl" "$OUT/metrics_$v.jsonl" 2>/dev/null
done
log "done"
