#!/usr/bin/env bash
# Decode speed of regeneration and evaluation, this checkout against an earlier one (BEFORE_DIR), on a
# random-weight target with the shape and tokenizer of TARGET_FILES (a folder with config.json and the
# tokenizer files, e.g. SmolLM2-135M-Instruct's): random weights never stop early, so every reply has
# the full --max_new_tokens and both sides decode the same number of tokens. A random drafter drafts
# nothing useful (tau ~1), so evaluation times the target-only and verify forwards, not the speedup.
#
#   bash tools/gpu/decode_speed.sh OUT_DIR BEFORE_DIR TARGET_FILES
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); BEFORE=$(realpath "$2"); FILES=$(realpath "$3")
mkdir -p "$OUT"
source tools/gpu/setup.sh
T=$ROOT/random_target
python3 - "$FILES" "$T" <<'PY'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from dflash_model import DFlashConfig, DFlashDraftModel
files, out = Path(sys.argv[1]), Path(sys.argv[2])
config = AutoConfig.from_pretrained(files)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
for f in files.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
DFlashDraftModel(DFlashConfig.from_target_config(config, mask_token_id=16)).save_pretrained(out / "drafter")
PY
step() {  # name, seconds cap, command...: log to OUT/name.log, "name seconds rc" to OUT/steps.tsv
  local name=$1 cap=$2 start ms rc=0
  shift 2
  start=$(date +%s%N)
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  printf '%s\t%d.%03d\t%d\n' "$name" $((ms / 1000)) $((ms % 1000)) "$rc" | tee -a "$OUT/steps.tsv"
}
head -n 4096 "$DATA_DIR/gsm8k/train.jsonl" > "$OUT/questions.jsonl"
evaluate=(--target_model "$T" --draft_model "$T/drafter" --data "$OUT/questions.jsonl" --max_new_tokens 128)
step eval_after 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts 5 --output "$OUT/eval_after.json"
step eval_before 60 python3 "$BEFORE/eval_dflash.py" "${evaluate[@]}" --num_prompts 2 --baseline none --output "$OUT/eval_before.json"
regen=(--target_model "$T" --prompts "$OUT/questions.jsonl" --temperature 0 --max_new_tokens 320)
step regen_before 90 python3 "$BEFORE/regenerate_data.py" "${regen[@]}" --output "$OUT/regen_before.jsonl" --num_prompts 512 --batch_size 512
step regen_after 150 python3 regenerate_data.py "${regen[@]}" --output "$OUT/regen_after.jsonl" --num_prompts 4096 --batch_size 2048
step eval_after_dynamic 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts 2 --baseline none --kv_cache dynamic --output "$OUT/eval_after_dynamic.json"
