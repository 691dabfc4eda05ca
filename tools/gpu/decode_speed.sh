#!/usr/bin/env bash
# Decode speed of regeneration and evaluation, this checkout against an earlier one (BEFORE_DIR), on a
# random-weight target with the shape and tokenizer of TARGET_FILES (a folder with config.json and the
# tokenizer files, e.g. SmolLM2-135M-Instruct's): random weights never stop early, so every reply has
# the full --max_new_tokens and both sides decode the same number of tokens. A random drafter drafts
# nothing useful (tau ~1), so evaluation times the target-only and verify forwards, not the speedup.
# Regeneration: the earlier checkout, then this one with the decode step eager and compiled
# (--compile_decode off / on); each batch's tokens/s is in the step's log.
#
#   bash tools/gpu/decode_speed.sh OUT_DIR BEFORE_DIR TARGET_FILES
#   EVAL=0 bash tools/gpu/decode_speed.sh ...      # regeneration only
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); BEFORE=$(realpath "$2"); FILES=$(realpath "$3")
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
T=$ROOT/random_target
python3 tools/gpu/random_target.py "$FILES" "$T"
head -n 4096 "$DATA_DIR/gsm8k/train.jsonl" > "$OUT/questions.jsonl"
evaluate=(--target_model "$T" --draft_model "$T/drafter" --data "$OUT/questions.jsonl" --max_new_tokens 128)
if [[ ${EVAL:-1} != 0 ]]; then
  step eval_after 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts 5 --output "$OUT/eval_after.json"
  step eval_before 60 python3 "$BEFORE/eval_dflash.py" "${evaluate[@]}" --num_prompts 2 --baseline none --output "$OUT/eval_before.json"
fi
regen=(--target_model "$T" --prompts "$OUT/questions.jsonl" --temperature 0 --max_new_tokens 320)
step regen_before 90 python3 "$BEFORE/regenerate_data.py" "${regen[@]}" --output "$OUT/regen_before.jsonl" --num_prompts 512 --batch_size 512
# The static-cache decode step eager (graphed) against compiled (and graphed), 4 batches of 512 each.
step regen_eager 150 python3 regenerate_data.py "${regen[@]}" --output "$OUT/regen_eager.jsonl" --num_prompts 2048 --batch_size 512 \
  --compile_decode off
step regen_compiled 240 python3 regenerate_data.py "${regen[@]}" --output "$OUT/regen_compiled.jsonl" --num_prompts 2048 --batch_size 512 \
  --compile_decode on
if [[ ${EVAL:-1} != 0 ]]; then
  step eval_after_dynamic 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts 2 --baseline none --kv_cache dynamic \
    --output "$OUT/eval_after_dynamic.json"
fi
