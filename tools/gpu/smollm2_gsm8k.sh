#!/usr/bin/env bash
# The SmolLM2 GSM8K quality recipe on one GPU: regenerate -> train -> evaluate (greedy, then sampled), each step resumable
# (rerun the script after a crash: finished steps are skipped, unfinished ones continue).
#
#   bash tools/gpu/smollm2_gsm8k.sh [OUT_DIR]        # default outputs/smollm2-gsm8k-gpu
#   TRAIN_ARGS="--learning_rate 1e-3" bash tools/gpu/smollm2_gsm8k.sh   # extra train_dflash.py settings
#   SAMPLES=7 TRAIN_ARGS="--num_train_epochs 3 --eval_steps 872" bash tools/gpu/smollm2_gsm8k.sh OUT   # more replies, fewer epochs
#
# GSM8K: $DATA_DIR/gsm8k/train.jsonl (../shared/data here; elsewhere the public GSM8K train split,
# 7,473 questions in its published order, as {"question", "answer"} JSON lines). The last 500 lines are
# held out. Step times go to OUT_DIR/timings.tsv.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-outputs/smollm2-gsm8k-gpu}
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
D=$OUT/data
SAMPLES=${SAMPLES:-4}  # sampled replies per question (sample k has the same seed whatever SAMPLES is)

# 1. SmolLM2 answers every training question: once greedily (recipe_greedy_replies, tools/gpu/helpers.sh),
# $SAMPLES times sampled, 1024 rows decoding together.
recipe_greedy_replies "$D"
timed regenerate_sampled python3 regenerate_data.py --target_model "$SMOLLM2" --prompts "$D/train_questions.jsonl" \
  --output "$D/sampled$SAMPLES.jsonl" --num_samples_per_prompt "$SAMPLES" --temperature 0.8 --top_p 0.95 --max_new_tokens 320 --batch_size 1024

# 2. Train (continues from the latest checkpoint when rerun).
if [[ ! -f $OUT/train/final/model.safetensors ]]; then
  timed train accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --train_data "$D/greedy.jsonl" "$D/sampled$SAMPLES.jsonl" --eval_data "$D/heldout_questions.jsonl" \
    --output_dir "$OUT/train" --resume_from_checkpoint latest ${TRAIN_ARGS:-}
fi

# 3. Held-out tau: 100 questions, block size 16, temperature 0 (add --baseline prompt_lookup for
# transformers' prompt lookup beside it: it decodes without CUDA graphs, ~3 s a question).
if [[ ! -f $OUT/eval.json ]]; then
  timed evaluate python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$OUT/train/final" \
    --data "$D/heldout_questions.jsonl" --num_prompts 100 --max_new_tokens 256 --block_size 16 --baseline none \
    --output "$OUT/eval.json"
fi
# 4. The same questions sampled: temperature 0.8, top_p 1.0, seed 0 (lossless in distribution).
if [[ ! -f $OUT/eval_t0.8.json ]]; then
  timed evaluate_t0.8 python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$OUT/train/final" \
    --data "$D/heldout_questions.jsonl" --num_prompts 100 --max_new_tokens 256 --block_size 16 --baseline none \
    --temperature 0.8 --top_p 1.0 --seed 0 --output "$OUT/eval_t0.8.json"
fi
cat "$OUT/timings.tsv"
