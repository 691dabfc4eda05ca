#!/usr/bin/env bash
# tau against the context length, for the SmolLM2 GSM8K recipe (SmolLM2-135M reads up to 8,192 tokens).
# Prompts: k-shot GSM8K prompts made of the recipe's own training questions and SmolLM2's greedy replies
# to them (tools/long_prompts.py), at ~0.2k (the bare question), 2k, 4k and 7k tokens, on 16 held-out
# questions each. Drafters, each evaluated at every length at temperature 0 and 0.8 (eval_dflash.py,
# 128 new tokens, block size 16), then tabulated by tools/gpu/tau_by_length.py into OUT_DIR/table.md
# and drawn into OUT_DIR/tau_by_length.png (tau against prompt tokens, solid T=0, dashed T=0.8):
#   recipe        configs/smollm2-gsm8k-gpu.yaml with the previous recipe's optimisation (ABLATION_BASE,
#                 tools/gpu/helpers.sh: DFlash, AdamW 8e-4 cosine) on the greedy replies, 600 steps (a full
#                 recipe's sampled replies and epochs cost ~15 more minutes, so the base is this short run).
#   long          the same, with 700 long samples in the mix (train_long.jsonl: the same greedy replies
#                 after k-shot prompts, 2,048 / 4,096 / 7,680 tokens in all, 9% of the samples),
#                 --max_seq_length 8192, at recipe's GPU-minutes: STEPS_LONG steps (below).
#   long_sliding  long with 7 sliding-window (2,048) layers + 1 full (--layer_types last_full).
#   recipe_dflash2, long_sliding_dflash2
#                 recipe and long_sliding with --drafter dflash2, at the same steps (not the same minutes:
#                 a DFlash2 step costs ~1.6x a DFlash one, docs/drafters.md).
# Every step is skipped when its output exists, so a call cut off by the 10-minute limit resumes (a
# training cut off starts over, an evaluation too). RUNS (default "recipe long long_sliding"; any of the
# five, in the order given) trains and evaluates only those; the table and the plot cover every run
# evaluated so far. AT_ONCE=N (default 1) trains up to N of RUNS side by side on the one GPU: side-by-side
# trainings share it, so their minutes in timings.tsv (marked "AT_ONCE=N") are not comparable to solo
# minutes, and the equal-minutes check (recipe against long and long_sliding) needs AT_ONCE=1. What
# sharing buys is mostly the overlap of one training's start-up and compiles with another's steps: six
# batch-32 trainings of this recipe side by side ran at ~240 samples/s together against 234 for one alone
# (BENCHMARKS.md), so the steps themselves gain little. Peak memory of a long run is not measured yet (a
# recipe training: 15.7-22.5 GB; DFlash2's 32 GB at batch 32 x 256 anchors); one that runs out of memory
# fails alone, and a later call with AT_ONCE=1 trains it again. Each drafter's two evaluations (T=0,
# T=0.8) run side by side: tau counts tokens, not time, so sharing leaves it as it is. On one warm
# machine, calls of ~5-7 minutes each:
#
#   RUNS=recipe bash tools/gpu/long_context_tau.sh ~/long_tau        (replies, prompts, recipe: ~6.5 min)
#   RUNS=long bash tools/gpu/long_context_tau.sh ~/long_tau          (~5 min)
#   RUNS=long_sliding bash tools/gpu/long_context_tau.sh ~/long_tau  (~5 min; then copy table.md, timings.tsv,
#                                                                     tau_by_length.png, eval_*.json and the logs to $OUT)
#   RUNS=recipe_dflash2 bash tools/gpu/long_context_tau.sh ~/long_tau        (~6 min)
#   RUNS=long_sliding_dflash2 bash tools/gpu/long_context_tau.sh ~/long_tau  (~5.5 min)
#   AT_ONCE=2 RUNS="recipe_dflash2 long_sliding_dflash2" bash tools/gpu/long_context_tau.sh ~/long_tau
#                                                       (both DFlash2 trainings side by side, ~7.5 min predicted, then
#                                                        ~3 min of evaluations: they may finish in a second call)
#   bash tools/gpu/long_context_tau.sh OUT_DIR          (the default three: ~17 GPU-minutes)
#   TINY=1 bash tools/gpu/long_context_tau.sh OUT_DIR   (the whole pipeline on a CPU: a tiny random target,
#                                                        2 questions per length, 3 training steps; 10 min on a busy 2-core CPU;
#                                                        AT_ONCE=2 RUNS="recipe long_sliding_dflash2": 3.6 min)
#
# Cost (H200, predicted from the recipe's timings.tsv and train_log.jsonl: greedy replies 59 s; a recipe
# step 0.24 s at batch 64 of 512-token rows; ~45 s of start-up and compiles per training):
#   replies 1 min; recipe 600 x 0.24 s + 45 s = ~3.2 min; each long run ~3.2 min: a batch of 64 long
#   samples takes ~0.7 s on average (the target's forward over up to 491k tokens, the drafter's attention
#   over 7k contexts), 11 of the ~120 batches an epoch, so ~0.28 s a step, and its 3 new lengths compile
#   ~60 s more: STEPS_LONG = (190 - 45 - 60) / 0.28 = ~300; the 6 evaluations ~1 min each (64 prompts).
#   Total ~16 min, plus start-up. DFlash2 (its step ~1.6x DFlash's, measured with two trainings sharing
#   the GPU): recipe_dflash2 600 x 0.38 s + 45 s = ~4.6 min; long_sliding_dflash2 at most 300 x 0.45 s
#   + 105 s = ~4 min (only the drafter's share of a long step grows); each drafter's two evaluations side
#   by side ~1.5 min (the selector adds a little to every drafted block).
#
# PREDICTIONS, written before the runs (held-out tau, temperature 0; at 0.8 about 0.4 lower, the same pattern):
#   recipe        ~2.5 at ~0.2k; 2.1 at 2k, 1.9 at 4k, 1.7 at 7k (-0.8). It never saw a context past 512
#                 tokens: RoPE positions it never trained at, and full attention spread over thousands of
#                 prompt tokens it learned to read in hundreds. The target's replies after k-shot prompts
#                 also differ from its bare replies (fewer tokens predictable from its training data).
#   long          -0.1 at ~0.2k against recipe (half the steps); at 7k within 0.3 of its own ~0.2k tau.
#   long_sliding  as long at ~0.2k (a 2,048 window never binds there); at 7k within 0.15 of its ~0.2k tau:
#                 7 of 8 layers see at most 2,048 tokens, so a 7k context looks to them as a 2k one does.
#   Goal: tau at ~7k within 0.2 of tau at ~0.2k at equal minutes: met by long_sliding, not by long (predicted).
#   recipe_dflash2  +0.3 to +0.5 over recipe at ~0.2k (~2.9; the project's 654-step runs: +0.54 at T=0,
#                 2.91 against 2.37, and +0.39 / +0.26 at T=0 / T=0.8 with D-PACE), so at T=0.8 about
#                 two thirds of the T=0 gain. At 7k ~2.0: it drops as much as recipe (-0.8 to -0.9), the gain
#                 shrinking to +0.2 to +0.4. Its convolutions (2 taps) and its selector (which rescores the
#                 top-16 draft tokens by the tokens before them) are local, so they neither break nor help at
#                 7k; its attention is DFlash's, with the same unseen positions and the same dilution. A
#                 local gain buys less tau where the first positions are accepted less often (tau adds up
#                 products of per-position acceptance).
#   long_sliding_dflash2  +0.3 to +0.5 over long_sliding at ~0.2k; at 7k within 0.2 of its own ~0.2k tau,
#                 as long_sliding (the windows, not the drafter's layers, decide what a 7k context looks
#                 like), so the gain over long_sliding holds at 7k (+0.3 to +0.4).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: bash tools/gpu/long_context_tau.sh OUT_DIR}")
all_runs="recipe long long_sliding recipe_dflash2 long_sliding_dflash2"
runs=${RUNS:-recipe long long_sliding}
for name in $runs; do
  [[ " $all_runs " == *" $name "* ]] || { echo "error: RUNS: no run '$name': pick from $all_runs" >&2; exit 2; }
done
at_once=${AT_ONCE:-1}
[[ $at_once =~ ^[1-9][0-9]*$ ]] || { echo "error: AT_ONCE must be a whole number >= 1 (trainings side by side), got '$at_once'" >&2; exit 2; }
mkdir -p "$OUT"
source tools/gpu/helpers.sh
if [[ ${TINY:-0} == 1 ]]; then  # a tiny random Qwen3 target with the Qwen3 tokenizer, 60 GSM8K questions
  tiny_target "$OUT" 60
  export RECIPE_HELDOUT=10 RECIPE_MAX_NEW_TOKENS=24 RECIPE_BATCH=8
  lengths=100,300,600 num_eval=2 train_lengths=256,512 num_train=8 steps=3 steps_long=3 new_tokens=8 long_seq=640
  launch=(python3 launch.py train_dflash.py)
  tiny=(--target_layer_ids 0 2 --num_draft_layers 2 --mask_token_id 151669 --per_device_batch_size 2 --num_anchors 8
        --target_cuda_graphs false --pad_to_multiple_of 128 --eval_num_prompts 2 --eval_max_new_tokens 8 --num_proc 1 --logging_steps 1)
  window=64
else
  lengths=200,2000,4000,7000 num_eval=16 train_lengths=2048,4096,7680 num_train=700 steps=600 steps_long=${STEPS_LONG:-300}
  new_tokens=128 long_seq=8192 window=2048
  launch=(accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py)
  tiny=()
fi
source tools/gpu/setup.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
D=$OUT/data

# 1. The recipe's questions and SmolLM2's greedy replies (tools/gpu/helpers.sh).
[[ -f $D/greedy.jsonl && -f $D/heldout_questions.jsonl ]] || recipe_greedy_replies "$D" || exit 1
# 2. k-shot prompts: eval.jsonl at every length, train_long.jsonl for the long runs.
if [[ ! -f $D/long/train_long.jsonl ]]; then
  timed long_prompts python3 tools/long_prompts.py --target_model "$SMOLLM2" --replies "$D/greedy.jsonl" \
    --heldout "$D/heldout_questions.jsonl" --out_dir "$D/long" --lengths $lengths --num_eval $num_eval \
    --train_lengths $train_lengths --num_train $num_train | tee "$OUT/long_prompts.log" || exit 1
fi
# 3. The drafters, AT_ONCE at a time in RUNS order (a run whose export exists is skipped; an interrupted
# one starts over). Side by side, a training's timings.tsv row says so: its minutes are not solo minutes.
recipe=(--train_data "$D/greedy.jsonl" --max_steps $steps)
long=(--train_data "$D/greedy.jsonl" "$D/long/train_long.jsonl" --max_seq_length $long_seq --max_steps $steps_long)
sliding=(--layer_types last_full --sliding_window $window)
train() {  # run name
  local name=$1 settings
  [[ -f $OUT/$name/final/model.safetensors ]] && return 0
  case $name in
    recipe) settings=("${recipe[@]}") ;;
    long) settings=("${long[@]}") ;;
    long_sliding) settings=("${long[@]}" "${sliding[@]}") ;;
    recipe_dflash2) settings=("${recipe[@]}" --drafter dflash2) ;;
    long_sliding_dflash2) settings=("${long[@]}" "${sliding[@]}" --drafter dflash2) ;;
  esac
  timed "train_$name$( ((at_once == 1)) || echo " (AT_ONCE=$at_once)")" "${launch[@]}" --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --eval_data "$D/heldout_questions.jsonl" --eval_num_prompts 8 --eval_steps 0 --save_steps 0 \
    --report_to none --output_dir "$OUT/$name" --overwrite_output_dir "${ABLATION_BASE[@]}" "${tiny[@]}" "${settings[@]}" > "$OUT/train_$name.log" 2>&1
}
for name in $runs; do
  train "$name" &
  while (($(jobs -rp | wc -l) >= at_once)); do sleep 2; done
done
wait
# 4. Every drafter at every length, greedy and sampled: a drafter's two evaluations side by side, one
# drafter after another.
evaluate() {  # run name, temperature
  local name=$1 t=$2 result
  result=$OUT/eval_$name$([[ $t == 0 ]] || echo "_t$t").json
  [[ -f $result || ! -f $OUT/$name/final/model.safetensors ]] && return 0
  timed "eval_${name}_t$t" python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$OUT/$name/final" \
    --data "$D/long/eval.jsonl" --max_new_tokens $new_tokens --block_size 16 --baseline none --temperature $t --top_p 1.0 \
    --seed 0 --output "$result" > "${result%.json}.log" 2>&1
}
for name in $runs; do
  evaluate "$name" 0 &
  evaluate "$name" 0.8 &
  wait
done
python3 tools/gpu/tau_by_length.py "$D/long/eval.jsonl" "$OUT" | tee "$OUT/table.md"
cat "$OUT/timings.tsv"  # train_recipe against train_long and train_long_sliding: the equal-minutes check
