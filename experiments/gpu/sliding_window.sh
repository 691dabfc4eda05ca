#!/usr/bin/env bash
# Sliding-window drafter layers on one GPU (about 20 minutes of an H200):
#  1. quality: the short SmolLM2 GSM8K recipe (as tools/gpu/quality_ablations.sh's base: greedy replies,
#     654 steps, held-out tau on 100 questions at the end) with all layers full against 4 sliding + 1 full
#     at window 2048 (GSM8K samples are <= 512 tokens: it never binds, so tau should match the full run),
#     128 and 64 (windows that bind). Four trainings at once: a 135M target leaves the GPU mostly idle.
#  2. speed: bench_dflash.py's drafter step at Qwen3-8B shapes (--quick: 256 anchors / seq 768 / batch 2
#     and 512 / 3072 / 1), compiled layers and loss as training runs them, all full vs 4 sliding + 1 full
#     at window 2048.
# Needs the recipe's data (tools/gpu/smollm2_gsm8k.sh, step 1). Writes OUT/table.md and the benchmark
# tables OUT/bench_*.md.
#
#   bash experiments/gpu/sliding_window.sh OUT_DIR [RECIPE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); RECIPE=${2:-outputs/smollm2-gsm8k-gpu}
source tools/gpu/setup.sh
source tools/gpu/helpers.sh  # ABLATION_BASE: the previous recipe's optimisation, which these runs were measured on
D=$RECIPE/data
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
train() {  # name, flags...: one run in the background, its log in OUT/name.log
  local name=$1
  shift
  nice -n 5 accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --train_data "$D/greedy.jsonl" --eval_data "$D/heldout_questions.jsonl" --eval_num_prompts 100 \
    --max_steps 654 --eval_steps 0 --save_steps 0 --output_dir "$OUT/$name" --overwrite_output_dir "${ABLATION_BASE[@]}" "$@" > "$OUT/$name.log" 2>&1 &
}
train full
train last_full_w2048 --layer_types last_full --sliding_window 2048
train last_full_w128 --layer_types last_full --sliding_window 128
train last_full_w64 --layer_types last_full --sliding_window 64
wait
python3 tools/gpu/ablation_table.py "$OUT" | tee "$OUT/table.md"

for layout in full last_full; do
  flags=()
  [[ $layout == last_full ]] && flags=(--layer_types last_full --sliding_window 2048)
  python3 bench_dflash.py --quick --variant compile_layers+fused_ce_compiled --no_append "${flags[@]}" \
    > "$OUT/bench_$layout.md" 2> "$OUT/bench_$layout.log"
done
tail -n 30 "$OUT"/bench_*.md
