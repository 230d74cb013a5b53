#!/usr/bin/env bash
# One device call: grow the demo model's MTP modules (configs/train/demo-mtp.yaml: 4 modules trained on the
# main model's greedy tokens, backbone frozen), export the model, then time speculative vs plain greedy decoding
# with it and with the shipped demo (bench/spec_decode.py on held-out text prompts).
#   OUT=... bash bench/spec_mtp.sh            # GPU machine; carry .whl (grain, array_record, portpicker wheels for
#                                             # Python 3.12) and data/corpus (python -m minimax_jax.data.corpus
#                                             # --out data/corpus --max_mb 16)
#   SELF_N=8 SELF_NEW=16 TRAIN_S=60 STEPS=4 SEQ=256 BATCH=2 NEW=16 LENGTHS=64 LOOPS=4 OUT=/tmp/o \
#     bash bench/spec_mtp.sh                    # CPU smoke run (~1 minute)
#   By default (SELF=1) the modules train on the demo's own greedy continuations of SELF_N corpus prompts
#   (<= SELF_PROMPT tokens, SELF_NEW new tokens each, SELF_BATCH rows per engine batch, GEN_S seconds at most);
#   SELF=0 trains on the corpus itself
# Back in $OUT: metrics.jsonl (training), ck.tgz.* (the exported checkpoint in <= 15 MiB pieces: cat ck.tgz.* |
# tar xzf -), spec4/ and spec1/ spec_decode.json (grown model / shipped demo; SPEC_BASE=0 skips the demo's run).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  SITE=/tmp/site_$$
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
W=${W:-/tmp/spec_mtp}
rm -rf "$W" && mkdir -p "$W" "$OUT"
DATA=()
if [ "${SELF:-1}" = 1 ]; then
  # Self-distillation (minimax_jax/data/self_distill.py): the demo's greedy continuations of corpus prompts are
  # the training text, so the modules learn on what verification sees (greedy tokens after greedy tokens).
  SD=$W/sd
  PMAX=${SELF_PROMPT:-512}
  python3 -m minimax_jax.data.self_distill prompts --corpus 'data/corpus/train-*.jsonl' \
    --tokenizer checkpoints/demo/tokenizer.json --num "${SELF_N:-2048}" --min_tokens $((PMAX < 128 ? PMAX : 128)) \
    --max_tokens "$PMAX" --out "$SD/prompts.jsonl" || exit 1
  timeout "${GEN_S:-150}" python3 infer.py --checkpoint checkpoints/demo --prompts_file "$SD/prompts.jsonl" \
    --temperature 0 --max_new_tokens "${SELF_NEW:-512}" --batch_size "${SELF_BATCH:-256}" --dtype bfloat16 \
    --output "$SD/gen.jsonl" --no_echo_prompt > /dev/null 2> "$SD/gen.log"
  echo "generation exit $? ($(wc -l < "$SD/gen.jsonl") records)"; grep -v "^W1" "$SD/gen.log" | tail -4
  python3 -m minimax_jax.data.self_distill join --prompts "$SD/prompts.jsonl" --generations "$SD/gen.jsonl" \
    --out "$SD/data/train-00000.jsonl" || exit 1
  DATA=(--set "data.sources=[$SD/data/train-*.jsonl]")
fi
# SIGINT at TRAIN_S: train.py saves a checkpoint at the step it reached and exits (then the export takes it).
timeout -s INT "${TRAIN_S:-240}" python3 train.py --config configs/train/demo-mtp.yaml --set run.run_dir="$W/run" \
  --set run.steps="${STEPS:-1000}" --set data.seq_len="${SEQ:-1024}" --set data.batch_size="${BATCH:-32}" \
  --set checkpoint.every=250 --set run.log_every=50 --set run.progress=false "${DATA[@]}" 2>&1 | tail -25
cp "$W/run/metrics.jsonl" "$OUT/" 2>/dev/null
python3 -m minimax_jax.train.export --run_dir "$W/run" --dst "$W/ck" --dtype bfloat16 --tokenizer checkpoints/demo/tokenizer.json || exit 1
tar czf - -C "$W" ck | split -b 15m - "$OUT/ck.tgz."
P=data/corpus/heldout.jsonl
for s in 4 $([ "${SPEC_BASE:-1}" = 1 ] && echo 1); do
  ck=$([ $s = 4 ] && echo "--checkpoint $W/ck" || echo "")
  timeout "${SPEC_S:-170}" python3 bench/spec_decode.py $ck --prompts $P --lengths "${LENGTHS:-512,4000}" --rows padded \
    --new "${NEW:-512}" --spec-loops "${LOOPS:-32}" --out "$OUT/spec$s" 2>&1 | tail -8
done
