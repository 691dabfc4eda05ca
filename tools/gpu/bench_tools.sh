#!/usr/bin/env bash
# Speed of the three tools of the quality loop on one GPU, with SmolLM2-135M-Instruct, against an
# earlier checkout of this repository (BEFORE_DIR, e.g. `git worktree add /tmp/before <commit>`):
#   regeneration  tokens/s: BEFORE_DIR's regenerate_data.py on 1,024 GSM8K questions vs this one on all
#                 6,973 training questions (static cache, batch 512), and `transformers serve`
#                 (continuous batching) through --server_url on the same 1,024
#   training      150 steps of 256 anchors x 16 samples x <= 512 tokens, wall time and samples/s, and a
#                 torch.profiler table of 5 steps of this checkout
#   evaluation    seconds per prompt (256 new tokens), BEFORE_DIR's eval_dflash.py vs this one
# Every step is time-capped; logs and results land in OUT_DIR, and the table in OUT_DIR/table.md.
#
#   bash tools/gpu/bench_tools.sh OUT_DIR BEFORE_DIR [RECIPE_DIR]
# RECIPE_DIR (default outputs/smollm2-gsm8k-gpu): the greedy replies are written where the quality
# recipe (tools/gpu/smollm2_gsm8k.sh) expects them, which then skips that step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); BEFORE=$(realpath "$2"); RECIPE=${3:-outputs/smollm2-gsm8k-gpu}
mkdir -p "$OUT"
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
D=$RECIPE/data
mkdir -p "$D"
head -n -500 "$DATA_DIR/gsm8k/train.jsonl" > "$D/train_questions.jsonl"
tail -n 500 "$DATA_DIR/gsm8k/train.jsonl" > "$D/heldout_questions.jsonl"
regen=(--prompts "$D/train_questions.jsonl" --temperature 0 --max_new_tokens 320)
step regen_before 90 python3 "$BEFORE/regenerate_data.py" --target_model "$SMOLLM2" "${regen[@]}" \
  --output "$OUT/regen_before.jsonl" --num_prompts 1024 --batch_size 512
step regen_after 150 python3 regenerate_data.py --target_model "$SMOLLM2" "${regen[@]}" --output "$D/greedy.jsonl" --batch_size 512

train=(--target_model "$SMOLLM2" --mask_token_id 16 --train_data "$D/greedy.jsonl" --num_anchors 256 --per_device_batch_size 16
       --max_seq_length 512 --max_steps 150 --logging_steps 25 --save_steps 0 --report_to none --num_proc 8)
# Each run compiles into its own cold cache: neither profits from the other's compiles.
step train_before 200 accelerate launch --config_file accelerate_configs/1gpu.yaml "$BEFORE/train_dflash.py" "${train[@]}" \
  --output_dir "$OUT/train_before" --compile_cache_dir "$ROOT/compile_cache_before"
step train_after 150 accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py "${train[@]}" \
  --output_dir "$OUT/train_after" --compile_cache_dir "$ROOT/compile_cache_after" --pad_to_multiple_of 512 --profile_steps 5

evaluate=(--target_model "$SMOLLM2" --draft_model "$OUT/train_after/final" --data "$D/heldout_questions.jsonl" --num_prompts 3
          --max_new_tokens 256)
step eval_before 45 python3 "$BEFORE/eval_dflash.py" "${evaluate[@]}" --baseline none --output "$OUT/eval_before.json"
step eval_after 60 python3 eval_dflash.py "${evaluate[@]}" --output "$OUT/eval_after.json"

port=8123
python3 -m transformers.cli.transformers serve "$SMOLLM2" --continuous-batching --dtype bfloat16 --device cuda --port $port \
  > "$OUT/serve_server.log" 2>&1 &
server=$!
for _ in $(seq 40); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
step regen_serve 60 python3 regenerate_data.py --server_url "http://localhost:$port/v1" --server_model "$SMOLLM2" "${regen[@]}" \
  --output "$OUT/regen_serve.jsonl" --num_prompts 1024 --server_concurrency 512
kill $server; wait $server 2>/dev/null
python3 tools/gpu/bench_table.py "$OUT" | tee "$OUT/table.md"
