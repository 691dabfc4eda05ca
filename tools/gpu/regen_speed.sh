#!/usr/bin/env bash
# Regeneration speed on the quality recipe's own steps, with SmolLM2-135M-Instruct: this checkout
# against earlier ones (BEFORE_DIR..., e.g. `git worktree add /tmp/before <commit>`), one run after
# the other on one GPU. Each answers the 6,973 training questions greedily (batch 1024, <= 320 new
# tokens, as tools/gpu/smollm2_gsm8k.sh), then once sampled (T 0.8, top-p 0.95) with SAMPLED=1.
# Logs in OUT_DIR; OUT_DIR/table.md holds each run's seconds generating, new tokens/s and the
# decoder's own line (decode steps, rows busy, host seconds at checks and waiting for the GPU).
#
#   bash tools/gpu/regen_speed.sh OUT_DIR [BEFORE_DIR ...]
#   SAMPLED=1 bash tools/gpu/regen_speed.sh OUT_DIR /tmp/before
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); shift
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
head -n -500 "$DATA_DIR/gsm8k/train.jsonl" > "$OUT/train_questions.jsonl"
regen=(--target_model "$SMOLLM2" --prompts "$OUT/train_questions.jsonl" --max_new_tokens 320 --batch_size 1024)
modes=(greedy)
[[ ${SAMPLED:-0} != 0 ]] && modes+=(sampled)
for mode in "${modes[@]}"; do
  flags=(--temperature 0)
  [[ $mode == sampled ]] && flags=(--temperature 0.8 --top_p 0.95)
  for dir in . "$@"; do
    label=this
    [[ $dir != . ]] && label=$(basename "$(realpath "$dir")")
    name=${mode}_$label
    rm -f "$OUT/$name.jsonl"  # timed from scratch, not resumed
    step "$name" 300 python3 "$dir/regenerate_data.py" "${regen[@]}" "${flags[@]}" --output "$OUT/$name.jsonl"
  done
done
python3 - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| run | process seconds | seconds generating | new tokens/s | the decoder's line |")
print("|---|---|---|---|---|")
walls = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
for name, wall in walls.items():
    lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
    summary = next((json.loads(line) for line in reversed(lines) if line.startswith("{")), {})
    decoder = next((line.split(": ", 1)[-1] for line in lines if "decode steps of" in line), "")
    print(f"| {name} | {wall} | {summary.get('seconds', '-')} | {summary.get('new_tokens_per_s', '-')} | {decoder} |")
EOF
