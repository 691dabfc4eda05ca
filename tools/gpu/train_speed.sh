#!/usr/bin/env bash
# Training speed of a small target on one GPU: an earlier checkout against this one, in one run.
# 100 optimizer steps per variant (256 anchors, <= 512 tokens, GSM8K question/answer pairs);
# samples/s in 20-step windows (median of the windows after the first, which compiles) and the
# wall time of the whole run (load, tokenize, compile, train). Target: $TARGET, default SmolLM2 as
# an HF folder (tools/gpu/setup.sh). BEFORE_DIR: an earlier checkout, run with its own defaults.
#   before        BEFORE_DIR, batch 16
#   b32           this checkout, batch 32, one padded shape, the target's forward from CUDA graphs,
#                 a short held-out evaluation at the end (as the quality recipe runs)
#   b64           the same at batch 64
#   b64_trim      b64 with --anchor_slots_multiple 32: micro-batches grouped by assistant length, each
#                 keeping only the anchor slots its longest reply fills (GSM8K answers fill about half
#                 of 256), rounded up to 32
#   b128_trim     the same at batch 128
#   profile       (PROFILE=0 skips it) b32 for 30 steps with --profile_steps 5: profile/profile.txt, ops by GPU and by host time
# VARIANTS="before b128_trim" runs only those (default: every one above but the profile, which
# PROFILE sets). If the CUDA-graph target fails in b32, b32 and b64 run without it (b32_eager,
# b64_eager) instead of the rest.
# Writes OUT_DIR/table.md.
#
#   bash tools/gpu/train_speed.sh OUT_DIR [BEFORE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); BEFORE=${2:+$(realpath "$2")}
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
T=${TARGET:-$SMOLLM2}
common=(--target_model "$T" --mask_token_id 16 --train_data "$DATA_DIR/gsm8k/train.jsonl" --num_anchors 256
        --max_seq_length 512 --max_steps 100 --logging_steps 20 --save_steps 0 --report_to none --num_proc 8)
launch=(accelerate launch --config_file accelerate_configs/1gpu.yaml)
want() { [[ " ${VARIANTS:-before b32 b64 b64_trim b128_trim} " == *" $1 "* ]]; }
if [[ -n $BEFORE ]] && want before; then
  step before 240 "${launch[@]}" "$BEFORE/train_dflash.py" "${common[@]}" --per_device_batch_size 16 --output_dir "$OUT/before" \
    --compile_cache_dir "$ROOT/compile_cache_before"  # a cold cache of its own: neither checkout profits from the other's compiles
fi
# As the quality recipe trains: one padded shape, and the target kept whole for a held-out evaluation
# (here a short one after the last step, outside the timed windows).
ours=("${common[@]}" --pad_to_multiple_of 512 --eval_data "$DATA_DIR/gsm8k/train.jsonl" --eval_num_prompts 4 --eval_max_new_tokens 64)
want b32 && step b32 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size 32 --target_cuda_graphs --output_dir "$OUT/b32"
if ! grep -qs $'^b32\t' "$OUT/steps.tsv" || grep -q $'^b32\t[0-9.]*\t0$' "$OUT/steps.tsv"; then  # b32 not run, or its graphs worked
  want b64 && step b64 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size 64 --target_cuda_graphs --output_dir "$OUT/b64"
  for batch in 64 128; do
    want b${batch}_trim && step b${batch}_trim 240 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $batch --target_cuda_graphs \
      --anchor_slots_multiple 32 --output_dir "$OUT/b${batch}_trim"
  done
  graphs=(--target_cuda_graphs)
else
  step b32_eager 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size 32 --output_dir "$OUT/b32_eager"
  step b64_eager 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size 64 --output_dir "$OUT/b64_eager"
  graphs=()
fi
[[ ${PROFILE:-1} == 1 ]] && step profile 150 "${launch[@]}" train_dflash.py "${common[@]}" --max_steps 30 --pad_to_multiple_of 512 --per_device_batch_size 32 \
  "${graphs[@]}" --profile_steps 5 --output_dir "$OUT/profile"
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| variant | samples/s (median of 20-step windows after the first) | windows | wall time (s) | exit code |\n|---|---|---|---|---|")
for line in (out / "steps.tsv").read_text().splitlines():
    name, seconds, rc = line.split("\t")[:3]
    if name == "profile":
        continue
    log = out / name / "train_log.jsonl"
    rates = [json.loads(l)["samples_per_s"] for l in log.read_text().splitlines() if "samples_per_s" in l] if log.is_file() else []
    median = f"{statistics.median(rates[1:]):.1f}" if len(rates) > 1 else "-"
    print(f"| {name} | {median} | {', '.join(f'{r:.0f}' for r in rates)} | {seconds} | {rc} |")
PY
