#!/usr/bin/env bash
# speculators' DFlash trainer (0.9.0) against ours on one GPU: the same target (SmolLM2-135M-Instruct, the
# recipe's GGUF), the same replies (the recipe's 6,973 greedy ones; regenerated when missing), the same
# number of optimizer steps over them (6 epochs at batch 64: 654), each drafter then measured by
# eval_dflash.py on the recipe's held-out questions at T=0 and T=0.8 (top_p 1.0, seed 0). Every step is
# resumable: a step whose output exists is skipped, and a speculators training resumes from its last
# checkpoint (one every 25 steps). Each call stops before CALL_SECONDS (default 540: a 10-minute device
# call less start-up) and exits 3 with OUT/state.json saying what is done: run the same command again,
# on the same machine (OUT/features and the checkpoints live on its disk), until it exits 0.
#
# Rows (ROWS, in this order by default):
#   spec_default  speculators' defaults: 5 layers, block 16, D-PACE weights, CE on the target's argmax,
#                 Muon (lr 1e-3, linear decay, 1% warmup), every layer sliding-window 2048 and causal
#                 inside the block (its default for DFlash)
#   spec_paper    speculators with the paper's objective: --per-position-loss-weight fixed-exp-decay
#                 --dflash-decay-gamma 7 --loss-fn ce, every layer full attention (bidirectional block)
#   spec_adamw    spec_default with our optimizer and schedule: AdamW 8e-4, no weight decay, cosine, 4% warmup
#   ours_recipe   configs/smollm2-gsm8k-gpu.yaml with the previous recipe's optimisation, ABLATION_BASE of
#                 tools/gpu/helpers.sh (DFlash, 8 layers, AdamW 8e-4 cosine, target-argmax labels)
#   ours_best     that plus BEST_ARGS (default --loss_weighting dpace: +0.26 held-out tau in the
#                 654-step runs of BENCHMARKS.md, at no cost per step)
# What is shared: the replies, tokenized by our data code (same tokens, same loss mask); the target's
# layer outputs (speculators reads them from files that OUR feature extractor writes: layers 1 8 14 20 27
# plus the last layer before the final norm, tools/speculators_compare.py); the mask token (16); the
# labels (both train on the target's argmax); the steps. A speculators step packs replies into one row
# of ~64 replies' tokens with 64 x 128 anchors, our step's replies and anchors; speculators' own batch
# shape (8,192 tokens, 512 anchors) would train 1/16 of our anchors per step. Its optimizer, learning
# rate, schedule and model defaults stay its own.
#
#   bash tools/gpu/speculators_compare.sh [OUT_DIR] [RECIPE_DIR]   # defaults outputs/speculators-compare,
#                                                                  # outputs/smollm2-gsm8k-gpu (its data/)
#   ROWS="spec_default ours_recipe" bash tools/gpu/speculators_compare.sh OUT   # some rows
#   EVAL_PROMPTS=50 TEMPS="0" BEST_ARGS="--drafter dflash2 --loss_weighting dpace" bash ... OUT
#   TINY=1 bash tools/gpu/speculators_compare.sh /tmp/trial   # the CPU trial: 24 demo replies, 3 steps,
#                                                             # 1-layer drafters, 2 prompts at T=0
# Writes OUT/table.md and OUT/results.json (every row's numbers: bring back these two), OUT/state.json
# (per row: trained, steps done of its target, temperatures evaluated), OUT/eval_ROW_tT.json, a log per
# step (OUT/ROW.log, OUT/eval_ROW_tT.log) and OUT/timings.tsv. Exit code 0: every row of ROWS trained and
# evaluated; 3: not yet (stopped for the call's time, or a step failed: its log's tail is printed), run again.
#
# Cost on one H100 (an outside run, BENCHMARKS.md 2026-12-05, rows side by side): regeneration 58 s
# (skipped when the recipe's greedy.jsonl exists), the target's hidden states 52 s (6 slots x 576 x 2
# bytes per token: ~14 GB on disk, in OUT/features), ours_recipe with dpace 212 s of training, DFlash2
# 374 s; evaluation ~2.5 min per row (100 questions, both temperatures side by side; estimate). A
# speculators row: start-up and compiles ~145 s, then (eager loss) ~28.8k tokens/s, 555 of 654 steps in
# ~8.5 minutes; the fused loss is unmeasured. A speculators row thus takes 1-2 calls from a bare machine
# (the first also stages, regenerates and writes the features), each later call ~2.5 minutes of compiles.
# One call per speculators row, ours_recipe and ours_best in one more (each starts over when cut: it
# needs NEED_OURS, 330 s, left to start): ROWS="spec_default", ROWS="spec_paper", ROWS="ours_recipe ours_best",
# each repeated until it exits 0. EVAL_PROMPTS=50 halves the evaluations. The table takes every row
# with results so far.
#
# speculators' default loss (--loss-implementation fused, Triton kernels) fails to compile on torch 2.11:
# tools/speculators_compare.py (detach_fused_loss_prune_hook) says why and detaches the kernels' config
# prune hook, a no-op at SmolLM2's vocabulary, so the rows train with speculators' own fused loss.
#
# speculators is not on the GPU image. Fetch its wheels here (a machine with pip and internet), into
# .whl/speculators, and carry .whl (tools/gpu/setup.sh installs only .whl/*.whl; this script installs
# .whl/speculators/*.whl into $ROOT/speculators-site, used by the speculators steps alone, so its pins,
# datasets<=5.1 among them, never reach our trainer). The versions are those of a tested CPU set; the
# image has torch 2.11, transformers 5.17 (speculators wants <= 5.19), typer, rich, click, aiohttp,
# psutil, protobuf and httpx (speculators' render client imports it). openai 3 imports httpx2. 7 MB:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl/speculators speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions pydantic-settings==2.16.3 \
#     python-dotenv openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore anyio==4.16.0 jiter sniffio \
#     'idna>=3.18' 'h11>=0.16' datasets==5.1.0 'dill<0.4.2' 'multiprocess<0.70.20'
# (not torchvision or torchaudio: the image's match its torch). The first call with a speculators row
# installs them and prints "speculators 0.9.0" (the version from its package metadata: 0.9.0 has no
# __version__), or speculators' own import error.
set -uo pipefail
# This call stops before CALL_SECONDS have passed (0: no limit; the default of the CPU trial).
CALL_SECONDS=${CALL_SECONDS:-$([[ ${TINY:-0} == 1 ]] && echo 0 || echo 540)}
CALL_END=$(($(date +%s) + CALL_SECONDS))
((CALL_SECONDS == 0)) && CALL_END=$((1 << 40))
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-outputs/speculators-compare}")
RECIPE=$(realpath -m "${2:-outputs/smollm2-gsm8k-gpu}")
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

ROWS=${ROWS:-spec_default spec_paper ours_recipe ours_best}
TEMPS=${TEMPS:-0 0.8}
BEST_ARGS=${BEST_ARGS:---loss_weighting dpace}
TINY=${TINY:-0}
CONFIG=configs/smollm2-gsm8k-gpu.yaml
# The recipe's settings that both trainers share.
eval "$(python3 - "$CONFIG" <<'EOF'
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
print(f"BATCH={c['per_device_batch_size']} ANCHORS={c['num_anchors']} MASK={c['mask_token_id']} "
      f"MAXLEN={c['max_seq_length']} BLOCK={c['block_size']} LAYER_IDS='{' '.join(map(str, c['target_layer_ids']))}'")
EOF
)"
EPOCHS=6  # the comparison's own length, not the recipe's: 6 epochs of the greedy replies (654 steps), as every row so far
SPEC_IDS=$(for i in $LAYER_IDS; do printf '%d ' $((i + 1)); done)  # speculators indexes HF hidden states: our id + 1
SPEC_LAYERS=5               # speculators' default depth
EVAL_PROMPTS=${EVAL_PROMPTS:-100}  # the recipe's evaluation (tools/gpu/smollm2_gsm8k.sh)
EVAL_MAX_NEW=${EVAL_MAX_NEW:-256}
D=$RECIPE/data
REPLIES=${REPLIES:-$D/greedy.jsonl}
HELDOUT=${HELDOUT:-$D/heldout_questions.jsonl}
MAX_SAMPLES=""
SPEC_EXTRA=()   # speculators flags the CPU needs
OURS_EXTRA=()
OURS_LAUNCH=(accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py)
CHECKPOINT_STEPS=25         # a speculators row stopped for the call's time loses at most these steps
# Seconds a step needs before it is worth starting in this call (estimates, see the cost above). A
# speculators training needs its start-up and compiles plus one checkpoint interval; ours starts over.
NEED_FEATURES=150 NEED_SPEC=240 NEED_OURS=${NEED_OURS:-330} NEED_EVAL=$((30 + 150 * ${EVAL_PROMPTS} / 100))
if [[ $TINY == 1 ]]; then  # the CPU trial: the demo's replies and prompts, everything tiny
  REPLIES=${REPLIES_TINY:-data/demo_conversations.jsonl}
  HELDOUT=${HELDOUT_TINY:-data/demo_heldout_prompts.jsonl}
  MAX_SAMPLES=24 BATCH=4 ANCHORS=8 SPEC_LAYERS=1 EVAL_PROMPTS=2 EVAL_MAX_NEW=24 TEMPS=${TEMPS_TINY:-0}
  SPEC_EXTRA=(--draft-attn-impl sdpa --loss-implementation eager --num-workers 0)  # no flex backward, no Triton on CPU
  OURS_EXTRA=(--num_draft_layers 1 --target_cuda_graphs false --pad_to_multiple_of 1 --num_proc 1 --logging_steps 1)
  OURS_LAUNCH=(python3 train_dflash.py)
  CHECKPOINT_STEPS=1 NEED_FEATURES=10 NEED_SPEC=10 NEED_OURS=10 NEED_EVAL=10
fi
left() { echo $((CALL_END - $(date +%s))); }
# The table and OUT/state.json (what is done) so far, then exit: 3 when this call stopped for its time.
finish() {  # exit code
  # shellcheck disable=SC2086  # the temperatures and rows are words
  python3 tools/speculators_compare.py table "$OUT" --temperatures $TEMPS | tee "$OUT/table.md"
  [[ $1 == 3 ]] && echo "speculators_compare.sh: stopped for the call's time ($(left) s left of it): run the same command again to go on"
  # shellcheck disable=SC2086
  python3 -c 'import json, sys; state = json.load(open(sys.argv[1])); sys.exit(0 if all(state[r]["done"] for r in sys.argv[2:]) else 3)' \
    "$OUT/state.json" $ROWS ||
    { echo "speculators_compare.sh: not every row of ROWS is done ($OUT/state.json): run the same command again"; exit 3; }
  exit "$1"
}
enough() {  # seconds a step needs, its name: true when this call has them left
  (($(left) >= $1)) && return 0
  echo "speculators_compare.sh: $2 needs ~$1 s, $(left) s are left in this call" >&2
  return 1
}

# 1. The replies: the recipe's greedy ones (tools/gpu/smollm2_gsm8k.sh, step 1), regenerated here when missing.
if [[ ! -f $HELDOUT || ! -f $REPLIES ]]; then
  if [[ $REPLIES != "$D/greedy.jsonl" || $HELDOUT != "$D/heldout_questions.jsonl" ]]; then
    echo "speculators_compare.sh: no $REPLIES or $HELDOUT" >&2; exit 2
  fi
  recipe_greedy_replies "$D" || exit 1
fi
rows=$(grep -c . "$REPLIES")
[[ -n $MAX_SAMPLES ]] && ((rows > MAX_SAMPLES)) && rows=$MAX_SAMPLES
STEPS=${STEPS:-$([[ $TINY == 1 ]] && echo 3 || echo $((EPOCHS * ((rows + BATCH - 1) / BATCH))))}
echo "speculators_compare: $rows replies ($REPLIES), $STEPS steps at batch $BATCH x $ANCHORS anchors; rows: $ROWS; T: $TEMPS; $EVAL_PROMPTS prompts"

# 2. speculators (its rows only), from the carried wheels unless it is importable already.
SPEC_SITE=$ROOT/speculators-site
SPEC_PYTHON=(env "PYTHONPATH=$SPEC_SITE${PYTHONPATH:+:$PYTHONPATH}" python3)
spec_python() { "${SPEC_PYTHON[@]}" "$@"; }
# speculators 0.9.0 has no __version__: its version comes from the installed package's metadata.
spec_check='import importlib.metadata as m, speculators.train.cli; print("speculators", m.version("speculators"))'
if [[ $ROWS == *spec_* ]] && ! spec_python -c "$spec_check" 2>/dev/null; then
  if ! ls .whl/speculators/*.whl >/dev/null 2>&1; then
    echo "speculators_compare.sh: speculators is not installed and .whl/speculators has no wheels: fetch them (this script's header)" >&2; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SPEC_SITE" .whl/speculators/*.whl
  # an import error is reported as itself (its last lines), not as a missing package
  if ! found=$(spec_python -c "$spec_check" 2>&1); then
    echo "$found" | tail -n 5 >&2; echo "speculators_compare.sh: speculators does not import (above)" >&2; exit 2
  fi
  echo "$found" | tail -n 1
fi

# 3. The target's hidden states of every reply, once, for the speculators rows.
FEAT=$OUT/features
if [[ $ROWS == *spec_* && ! -f $FEAT/meta.json ]]; then
  enough $NEED_FEATURES features || finish 3
  timed features python3 tools/speculators_compare.py features --target_model "$SMOLLM2" --train_data "$REPLIES" \
    --target_layer_ids $LAYER_IDS --max_seq_length "$MAXLEN" --batch_size 64 ${MAX_SAMPLES:+--max_samples $MAX_SAMPLES} \
    --output "$FEAT" > "$OUT/features.log" 2>&1 || { tail -n 20 "$OUT/features.log"; exit 1; }
fi

# 4. Each row: train, (speculators) convert to our export's layout, evaluate at each temperature.
SPEC_COMMON=(--speculator-type dflash --verifier-name-or-path "$SMOLLM2" --target-layer-ids $SPEC_IDS
             --mask-token-id "$MASK" --block-size "$BLOCK" --num-layers "$SPEC_LAYERS" --max-anchors $((BATCH * ANCHORS))
             "${SPEC_EXTRA[@]}" ${SPEC_ARGS:-})
for row in $ROWS; do
  case $row in
    spec_default) flags=() ;;
    spec_paper) flags=(--per-position-loss-weight fixed-exp-decay --dflash-decay-gamma 7 --loss-fn ce
                       --full-attention-indices $(seq 0 $((SPEC_LAYERS - 1)))) ;;
    spec_adamw) flags=(--optimizer adamw --lr 8e-4 --weight-decay 0 --scheduler-type cosine --scheduler-warmup-ratio 0.04) ;;
    ours_recipe) flags=() ;;
    ours_best) read -ra flags <<< "$BEST_ARGS" ;;
    *) echo "speculators_compare.sh: unknown row $row (spec_default spec_paper spec_adamw ours_recipe ours_best)" >&2; exit 2 ;;
  esac
  if [[ $row == spec_* ]]; then
    if [[ ! -f $OUT/$row/summary.json ]]; then
      enough $NEED_SPEC "train_$row" || finish 3
      # It stops itself after the last checkpoint that ends before the call's end (exit code 3; the next call
      # resumes from it); the timeout is the backstop, a few seconds later (the steps since the last checkpoint lost).
      rc=0
      timed "train_$row" timeout -s KILL $(($(left) - 5)) "${SPEC_PYTHON[@]}" tools/speculators_compare.py train "$OUT/$row" \
        --data "$FEAT" --steps "$STEPS" --batch_samples "$BATCH" --checkpoint_steps "$CHECKPOINT_STEPS" \
        --deadline $((CALL_END - 20)) -- "${SPEC_COMMON[@]}" "${flags[@]}" >> "$OUT/$row.log" 2>&1 || rc=$?
      if ((rc == 3 || rc == 137)); then tail -n 3 "$OUT/$row.log"; finish 3; fi
      ((rc == 0)) || { tail -n 30 "$OUT/$row.log"; continue; }
    fi
    drafter=$OUT/$row/zlab
    if [[ ! -f $drafter/model.safetensors ]]; then
      checkpoint=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['checkpoint'])" "$OUT/$row/summary.json")
      # --max_seq_len: the held-out prompts plus EVAL_MAX_NEW tokens stay far inside the 2,048 window, where
      # speculators' window (per block) and the engines' (per query) agree (convert_dflash.py).
      python3 convert_dflash.py "$checkpoint" "$drafter" --to zlab --target "$SMOLLM2" --max_seq_len 1024 --overwrite \
        > "$OUT/convert_$row.log" 2>&1 || { tail -n 20 "$OUT/convert_$row.log"; continue; }
    fi
  else
    if [[ ! -f $OUT/$row/final/model.safetensors ]]; then
      enough $NEED_OURS "train_$row" || finish 3
      # shellcheck disable=SC2086  # MAX_SAMPLES: a flag and its value, or nothing
      timed "train_$row" timeout -s KILL $(($(left) - 5)) "${OURS_LAUNCH[@]}" --config "$CONFIG" --target_model "$SMOLLM2" --train_data "$REPLIES" \
        --eval_data "" --eval_steps 0 --save_steps 0 --per_device_batch_size "$BATCH" --num_anchors "$ANCHORS" \
        --max_steps "$STEPS" ${MAX_SAMPLES:+--max_samples $MAX_SAMPLES} --output_dir "$OUT/$row" --overwrite_output_dir \
        "${ABLATION_BASE[@]}" "${OURS_EXTRA[@]}" "${flags[@]}" > "$OUT/$row.log" 2>&1 || { tail -n 30 "$OUT/$row.log"; continue; }
    fi
    drafter=$OUT/$row/final
  fi
  # The temperatures side by side: a 135M target's decode leaves the GPU mostly idle (tau is unaffected;
  # the tokens/s in the JSON are then not speeds). Each drafter verifies every draft of a pass, eval_dflash.py's
  # default: a DFlash drafter's block (BLOCK, 16: 15 drafts, unless BEST_ARGS sets another), gamma + 1 for DSpark's.
  todo=0
  for t in $TEMPS; do [[ -f $OUT/eval_${row}_t$t.json ]] || todo=1; done
  ((todo)) && { enough $NEED_EVAL "eval_$row" || finish 3; }
  for t in $TEMPS; do
    [[ -f $OUT/eval_${row}_t$t.json ]] && continue
    # At T > 0 without the target-only decoding beside each question: it gives only a speedup, and side by side
    # that is not a speed; the evaluation takes ~40% of the GPU time without it.
    reference=()
    [[ $t == 0 ]] || reference=(--target_reference false)
    timed "eval_${row}_t$t" timeout -s KILL $(($(left) - 5)) python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$drafter" --data "$HELDOUT" \
      --num_prompts "$EVAL_PROMPTS" --max_new_tokens "$EVAL_MAX_NEW" --baseline none "${reference[@]}" \
      --temperature "$t" --top_p 1.0 --seed 0 --output "$OUT/eval_${row}_t$t.json" > "$OUT/eval_${row}_t$t.log" 2>&1 &
  done
  wait
  for t in $TEMPS; do [[ -f $OUT/eval_${row}_t$t.json ]] || tail -n 20 "$OUT/eval_${row}_t$t.log"; done
done

# Every row with results so far, whichever ROWS this call ran.
finish 0
