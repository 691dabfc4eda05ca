#!/usr/bin/env bash
# Training speed of a small target, one lever at a time, on one GPU: 120 optimizer steps per variant
# (256 anchors, <= 512 tokens, GSM8K question/answer pairs), samples/s in 20-step windows and the wall
# time of the whole run. The target has random weights and the shape and tokenizer of TARGET_FILES
# (speed does not depend on the weights). BEFORE_DIR: an earlier checkout, run with its defaults.
#
#   bash tools/gpu/train_speed.sh OUT_DIR TARGET_FILES [BEFORE_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); FILES=$(realpath "$2"); BEFORE=${3:+$(realpath "$3")}
mkdir -p "$OUT"
source tools/gpu/setup.sh
T=$ROOT/random_target
[[ -f $T/config.json ]] || python3 tools/gpu/random_target.py "$FILES" "$T"
common=(--target_model "$T" --mask_token_id 16 --train_data "$DATA_DIR/gsm8k/train.jsonl" --num_anchors 256
        --max_seq_length 512 --max_steps 120 --logging_steps 20 --save_steps 0 --report_to none --num_proc 8)
launch=(accelerate launch --config_file accelerate_configs/1gpu.yaml)
if [[ -n $BEFORE ]]; then
  step before 200 "${launch[@]}" "$BEFORE/train_dflash.py" "${common[@]}" --per_device_batch_size 16 --output_dir "$OUT/before"
fi
step one_shape 150 "${launch[@]}" train_dflash.py "${common[@]}" --per_device_batch_size 16 --pad_to_multiple_of 512 --output_dir "$OUT/one_shape"
step target_graphs 150 "${launch[@]}" train_dflash.py "${common[@]}" --per_device_batch_size 16 --pad_to_multiple_of 512 \
  --target_cuda_graphs --output_dir "$OUT/target_graphs"
step loss_chunk_16k 150 "${launch[@]}" train_dflash.py "${common[@]}" --per_device_batch_size 16 --pad_to_multiple_of 512 \
  --target_cuda_graphs --loss_chunk_size 16384 --output_dir "$OUT/loss_chunk_16k"
step batch32 150 "${launch[@]}" train_dflash.py "${common[@]}" --per_device_batch_size 32 --pad_to_multiple_of 512 \
  --target_cuda_graphs --loss_chunk_size 16384 --profile_steps 5 --output_dir "$OUT/batch32"
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| variant | samples/s (median of 20-step windows after the first) | wall time (s) |\n|---|---|---|")
times = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
for name, seconds in times.items():
    log = out / name / "train_log.jsonl"
    rates = [json.loads(l)["samples_per_s"] for l in log.read_text().splitlines() if "samples_per_s" in l] if log.is_file() else []
    print(f"| {name} | {statistics.median(rates[1:]) if len(rates) > 1 else '-'} | {seconds} |")
PY
