#!/usr/bin/env bash
# What --cache_target_outputs buys on one GPU: the same 80 training steps with the target run on every
# step and with its outputs read from the cache, at 5 and at 8 drafter layers. Target: a random-weight
# model with the shape and tokenizer of TARGET_FILES (a folder with config.json and the tokenizer files,
# e.g. SmolLM2-135M-Instruct's). 1,280 GSM8K question/answer pairs make an epoch of 20 steps at batch 64,
# so steps 21-80 of a cached run read every sample from the cache; samples/s in 20-step windows.
# The 8-layer cached run also profiles 5 steps (OUT_DIR/l8c/profile.txt).
#
#   bash experiments/gpu/cache_speed.sh OUT_DIR TARGET_FILES
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); FILES=$(realpath "$2")
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
T=$ROOT/random_target
python3 tools/gpu/random_target.py "$FILES" "$T" > "$OUT/random_target.log" 2>&1
common=(--target_model "$T" --mask_token_id 16 --train_data "$DATA_DIR/gsm8k/train.jsonl" --max_samples 1280 --num_anchors 128
        --max_seq_length 512 --pad_to_multiple_of 512 --per_device_batch_size 64 --target_cuda_graphs --label_source target_argmax
        --max_steps 80 --logging_steps 20 --save_steps 0 --report_to none --num_proc 8 --target_layer_ids 1 8 14 20 27)
launch=(accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py)
step l5 120 "${launch[@]}" "${common[@]}" --num_draft_layers 5 --output_dir "$OUT/l5"
step l5c 120 "${launch[@]}" "${common[@]}" --num_draft_layers 5 --cache_target_outputs --output_dir "$OUT/l5c"
step l8c 120 "${launch[@]}" "${common[@]}" --num_draft_layers 8 --cache_target_outputs --profile_steps 5 --output_dir "$OUT/l8c"
step l8 120 "${launch[@]}" "${common[@]}" --num_draft_layers 8 --output_dir "$OUT/l8"
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| run | samples/s (median of the windows after the first) | windows | s per step (last) | peak GB |\n|---|---|---|---|---|")
for name in ("l5", "l5c", "l8", "l8c"):
    log = out / name / "train_log.jsonl"
    rows = [json.loads(l) for l in log.read_text().splitlines() if "samples_per_s" in l] if log.is_file() else []
    if not rows:
        print(f"| {name} | - | - | - | - |")
        continue
    rates = [r["samples_per_s"] for r in rows]
    median = statistics.median(rates[1:]) if len(rates) > 1 else rates[0]
    print(f"| {name} | {median:.1f} | {', '.join(f'{r:.1f}' for r in rates)} | {rows[-1]['step_time_s']:.3f} | {rows[-1].get('peak_memory_gb', 0):.1f} |")
PY
