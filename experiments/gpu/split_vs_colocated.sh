#!/usr/bin/env bash
# Target/drafter split against colocated training on 2 GPUs, at Qwen3-8B shapes (random target, 256
# anchors, every sample 768 tokens, batch 2; bench_dflash.py's headline shape): colocated
# (--target_ranks 0), one target rank feeding one drafter rank (--target_ranks 1), and what
# --target_ranks auto measures and picks. 30 steps each; the means of the log windows after the
# first (which holds the flex compile) go to OUT_DIR/table.md, what auto picked to OUT_DIR/auto.txt.
#
#   bash experiments/gpu/split_vs_colocated.sh OUT_DIR      (about 10 minutes on 2 H200s)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: bash experiments/gpu/split_vs_colocated.sh OUT_DIR}")
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
W=$ROOT/shaped
python3 experiments/gpu/shaped_targets.py "$W" "$DATA_DIR/gsm8k/train.jsonl"
args=(--target_model "$W/q8b" --target_random_init --train_data "$W/conv8.jsonl" --max_samples 400 --max_seq_length 768
      --per_device_batch_size 2 --num_anchors 256 --max_steps 30 --logging_steps 10 --save_steps 0 --attention_backend flex
      --report_to none --num_proc 8)
launch=(accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py)
step colocated 240 "${launch[@]}" "${args[@]}" --target_ranks 0 --output_dir "$OUT/colocated"
step split 240 "${launch[@]}" "${args[@]}" --target_ranks 1 --output_dir "$OUT/split"
step auto 300 "${launch[@]}" "${args[@]}" --target_ranks auto --output_dir "$OUT/auto"
grep -h -A4 "target_ranks auto over" "$OUT/auto.log" | cut -c1-300 > "$OUT/auto.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
keys = ["samples_per_s", "target_samples_per_s", "target_tokens_per_s", "drafter_samples_per_s", "drafter_wait_s",
        "target_idle_frac", "step_time_s", "peak_memory_gb"]
print("| run | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
for name in ("colocated", "split", "auto"):
    log = out / name / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if '"loss"' in line][1:] if log.is_file() else []
    mean = lambda k: sum(r[k] for r in rows) / len(rows) if rows and k in rows[0] else float("nan")
    print(f"| {name} | " + (" | ".join(f"{mean(k):.3g}" for k in keys) if rows else "(no log)") + " |")
PY
cat "$OUT/auto.txt"
