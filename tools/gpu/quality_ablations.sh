#!/usr/bin/env bash
# One lever at a time against a short base run of the SmolLM2 GSM8K recipe, several trainings at once on
# one GPU (a 135M target leaves most of it idle). Base: the greedy replies only, 654 steps (1.5 epochs),
# configs/smollm2-gsm8k-gpu.yaml otherwise; held-out tau on 100 questions at the end of each run (at
# steps 218 / 436 / 654 for the base). Needs the recipe's data (tools/gpu/smollm2_gsm8k.sh, step 1); the
# run on sampled replies starts once the recipe's sampled replies are complete.
#
#   bash tools/gpu/quality_ablations.sh OUT_DIR [RECIPE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); RECIPE=${2:-outputs/smollm2-gsm8k-gpu}
source tools/gpu/setup.sh
D=$RECIPE/data
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
train() {  # name, flags...: one run in the background, its log in OUT/name.log
  local name=$1
  shift
  nice -n 5 accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --train_data "$D/greedy.jsonl" --eval_data "$D/heldout_questions.jsonl" --eval_num_prompts 100 \
    --max_steps 654 --eval_steps 0 --save_steps 0 --output_dir "$OUT/$name" --overwrite_output_dir "$@" > "$OUT/$name.log" 2>&1 &
}
train base --eval_steps 218
train layers8 --num_draft_layers 8
train lr1.2e-3 --learning_rate 1.2e-3
train block8 --block_size 8
train late_layers --target_layer_ids 4 10 16 22 28
until grep -qs "^regenerate_sampled" "$RECIPE/timings.tsv"; do sleep 5; done
python3 -c "import json, sys; [print(line, end='') for line in open(sys.argv[1]) if json.loads(line).get('sample') == 0]" \
  "$D/sampled4.jsonl" > "$OUT/sampled1.jsonl"
train sampled1 --train_data "$OUT/sampled1.jsonl"
wait
python3 tools/gpu/ablation_table.py "$OUT" | tee "$OUT/table.md"
