#!/usr/bin/env bash
# One lever at a time against a short base run of the SmolLM2 GSM8K recipe on one GPU. Base: the
# greedy replies only, 654 steps (1.5 epochs), configs/smollm2-gsm8k-gpu.yaml otherwise. The trainings
# run side by side (a 135M target leaves most of the GPU idle); the evaluations run after them, a few
# at a time (they are latency-bound and crawl next to trainings): held-out tau on 64 questions, block
# size as trained. Needs the recipe's replies (tools/gpu/smollm2_gsm8k.sh, step 1): the greedy ones,
# and the sampled ones for the run that trains on the first sampled reply of each question.
#
#   bash tools/gpu/quality_ablations.sh OUT_DIR [RECIPE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); RECIPE=${2:-outputs/smollm2-gsm8k-gpu}
source tools/gpu/setup.sh
D=$RECIPE/data
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import json, sys; [print(line, end='') for line in open(sys.argv[1]) if json.loads(line).get('sample') == 0]" \
  "$D/sampled4.jsonl" > "$OUT/sampled1.jsonl"
train() {  # name, flags...: one training in the background, its log in OUT/name.log
  local name=$1
  shift
  accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --train_data "$D/greedy.jsonl" --eval_data "" --max_steps 654 --save_steps 0 \
    --output_dir "$OUT/$name" --overwrite_output_dir "$@" > "$OUT/$name.log" 2>&1 &
}
train base
train layers8 --num_draft_layers 8
train lr1.2e-3 --learning_rate 1.2e-3
train block8 --block_size 8
train late_layers --target_layer_ids 4 10 16 22 28
train sampled1 --train_data "$OUT/sampled1.jsonl"
wait
for run in "$OUT"/*/final; do
  name=$(basename "$(dirname "$run")")
  python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$run" --data "$D/heldout_questions.jsonl" --num_prompts 64 \
    --max_new_tokens 256 --baseline none --output "$OUT/eval_$name.json" > "$OUT/eval_$name.log" 2>&1 &
  while (($(jobs -rp | wc -l) >= 3)); do sleep 2; done
done
wait
python3 tools/gpu/ablation_table.py "$OUT" | tee "$OUT/table.md"
