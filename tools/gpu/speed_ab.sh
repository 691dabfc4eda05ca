#!/usr/bin/env bash
# One speed of this checkout against earlier checkouts of this repository (BEFORE_DIR, e.g.
# `git worktree add /tmp/before <commit>`), one run after the other on one GPU. Every step is time-capped
# and writes its log to OUT_DIR/NAME.log and "NAME<TAB>seconds<TAB>exit code" to OUT_DIR/steps.tsv;
# loop, regen and train end with their table in OUT_DIR/table.md. WHICH speed:
#
#   loop    the three tools of the quality loop with SmolLM2-135M-Instruct (table: tools/gpu/bench_table.py):
#             regeneration  tokens/s: BEFORE_DIR's regenerate_data.py on 1,024 GSM8K questions vs this one on all
#                           6,973 training questions (static cache, batch 512), and `transformers serve`
#                           (continuous batching) through --server_url on the same 1,024
#             training      150 steps of 256 anchors x 16 samples x <= 512 tokens, wall time and samples/s, and a
#                           torch.profiler table of 5 steps of this checkout
#             evaluation    seconds per prompt (256 new tokens), BEFORE_DIR's eval_dflash.py vs this one
#           RECIPE_DIR (default outputs/smollm2-gsm8k-gpu): the greedy replies are written where the quality
#           recipe (tools/gpu/smollm2_gsm8k.sh) expects them, which then skips that step.
#   decode  decode speed of regeneration and evaluation on a random-weight target with the shape and tokenizer
#           of TARGET_FILES (a folder with config.json and the tokenizer files, e.g. SmolLM2-135M-Instruct's):
#           random weights never stop early, so every reply has the full --max_new_tokens and both sides
#           decode the same number of tokens. A random drafter drafts nothing useful (tau ~1), so evaluation
#           times the target-only and verify forwards, not the speedup. Regeneration: the earlier checkout,
#           then this one with the decode step eager and compiled (--compile_decode off / on); each batch's
#           tokens/s is in the step's log. EVAL=0: regeneration only.
#   regen   regeneration on the quality recipe's own steps, with SmolLM2-135M-Instruct, against any number of
#           earlier checkouts (or none). Each answers the 6,973 training questions greedily (batch 1024,
#           <= 320 new tokens, as tools/gpu/smollm2_gsm8k.sh), then once sampled (T 0.8, top-p 0.95) with
#           SAMPLED=1. The table: each run's seconds generating, new tokens/s and the decoder's own line
#           (decode steps, rows busy, host seconds at checks and waiting for the GPU).
#   train   training speed of a small target: the earlier checkout (optional) against this one, 100
#           optimizer steps per variant (256 anchors, <= 512 tokens, GSM8K question/answer pairs); samples/s
#           in 20-step windows (median of the windows after the first, which compiles) and the wall time
#           of the whole run (load, tokenize, compile, train). Target: $TARGET, default SmolLM2 as an HF
#           folder (tools/gpu/setup.sh). BEFORE_DIR runs with its own defaults.
#             before        BEFORE_DIR, batch 16
#             b32           this checkout, batch 32, one padded shape, the target's forward from CUDA graphs,
#                           a short held-out evaluation at the end (as the quality recipe runs)
#             b64           the same at batch 64
#             b64_trim      b64 with --anchor_slots_multiple 32: micro-batches grouped by assistant length,
#                           each keeping only the anchor slots its longest reply fills (GSM8K answers fill
#                           about half of 256), rounded up to 32
#             b128_trim     the same at batch 128
#             profile       (PROFILE=0 skips it) b32 for 30 steps with --profile_steps 5: profile/profile.txt,
#                           ops by GPU and by host time
#           VARIANTS="before b128_trim" runs only those (default: every one above but the profile, which
#           PROFILE sets). If the CUDA-graph target fails in b32, b32 and b64 run without it (b32_eager,
#           b64_eager) instead of the rest.
#
#   bash tools/gpu/speed_ab.sh loop OUT_DIR BEFORE_DIR [RECIPE_DIR]
#   bash tools/gpu/speed_ab.sh decode OUT_DIR BEFORE_DIR TARGET_FILES
#   bash tools/gpu/speed_ab.sh regen OUT_DIR [BEFORE_DIR ...]
#   bash tools/gpu/speed_ab.sh train OUT_DIR [BEFORE_DIR]
#   TINY=1 bash tools/gpu/speed_ab.sh WHICH OUT_DIR ...   (the same steps on a CPU: a tiny random Qwen3 target,
#                                                         60 GSM8K questions, a few tokens and steps each, no
#                                                         compiles; decode's TARGET_FILES defaults to that
#                                                         target's files, loop's RECIPE_DIR to OUT_DIR/recipe.
#                                                         Checks the plumbing, not the speed)
set -uo pipefail
cd "$(dirname "$0")/../.."
WHICH=${1:-}
TINY=${TINY:-0}
case $WHICH in  # each speed's arguments: the fewest and the most, with WHICH
  loop) arguments="OUT_DIR BEFORE_DIR [RECIPE_DIR]" fewest=3 most=4 ;;
  decode) arguments="OUT_DIR BEFORE_DIR TARGET_FILES" fewest=$(( TINY == 1 ? 3 : 4 )) most=4 ;;
  regen) arguments="OUT_DIR [BEFORE_DIR ...]" fewest=2 most=$# ;;
  train) arguments="OUT_DIR [BEFORE_DIR]" fewest=2 most=3 ;;
  *) echo "error: the first argument names the speed: loop, decode, regen or train, got '$WHICH' (usage in tools/gpu/speed_ab.sh's header)" >&2
     exit 2 ;;
esac
if (( $# < fewest || $# > most )); then
  echo "error: usage: bash tools/gpu/speed_ab.sh $WHICH $arguments, got $(($# - 1)) arguments after '$WHICH'" >&2
  exit 2
fi
OUT=$(realpath -m "$2"); shift 2
mkdir -p "$OUT"
source tools/gpu/helpers.sh
if [[ $TINY == 1 ]]; then
  tiny_target "$OUT" 60
  export TORCHDYNAMO_DISABLE=1  # torch.compile runs eagerly: the steps without minutes of C++ compiles
  launch=(python3 launch.py)
else
  launch=(accelerate launch --config_file accelerate_configs/1gpu.yaml)
fi
source tools/gpu/setup.sh

pick() { [[ $TINY == 1 ]] && echo "$2" || echo "$1"; }  # a setting: its GPU value, its value in a CPU trial
run() {  # as `step` (helpers.sh), with a cap of 900 s in a CPU trial
  local name=$1 cap=$2
  shift 2
  step "$name" "$(pick "$cap" 900)" "$@"
}

speed_loop() {  # BEFORE_DIR [RECIPE_DIR]
  local before recipe
  before=$(realpath "$1"); recipe=${2:-$(pick outputs/smollm2-gsm8k-gpu "$OUT/recipe")}
  local D=$recipe/data held=$(pick 500 10)
  mkdir -p "$D"
  head -n -$held "$DATA_DIR/gsm8k/train.jsonl" > "$D/train_questions.jsonl"
  tail -n $held "$DATA_DIR/gsm8k/train.jsonl" > "$D/heldout_questions.jsonl"
  local regen=(--prompts "$D/train_questions.jsonl" --temperature 0 --max_new_tokens $(pick 320 16))
  run regen_before 90 python3 "$before/regenerate_data.py" --target_model "$SMOLLM2" "${regen[@]}" \
    --output "$OUT/regen_before.jsonl" --num_prompts $(pick 1024 8) --batch_size $(pick 512 8)
  run regen_after 150 python3 regenerate_data.py --target_model "$SMOLLM2" "${regen[@]}" --output "$D/greedy.jsonl" --batch_size $(pick 512 8)

  local train=(--target_model "$SMOLLM2" --mask_token_id 16 --train_data "$D/greedy.jsonl" --num_anchors $(pick 256 8)
               --per_device_batch_size $(pick 16 2) --max_seq_length $(pick 512 128) --max_steps $(pick 150 3)
               --logging_steps $(pick 25 1) --save_steps 0 --report_to none --num_proc $(pick 8 1))
  # Each run compiles into its own cold cache: neither profits from the other's compiles.
  run train_before 200 "${launch[@]}" "$before/train_dflash.py" "${train[@]}" \
    --output_dir "$OUT/train_before" --compile_cache_dir "$ROOT/compile_cache_before"
  run train_after 150 "${launch[@]}" train_dflash.py "${train[@]}" \
    --output_dir "$OUT/train_after" --compile_cache_dir "$ROOT/compile_cache_after" --pad_to_multiple_of $(pick 512 128) --profile_steps 5

  local evaluate=(--target_model "$SMOLLM2" --draft_model "$OUT/train_after/final" --data "$D/heldout_questions.jsonl"
                  --num_prompts $(pick 3 1) --max_new_tokens $(pick 256 8))
  run eval_before 45 python3 "$before/eval_dflash.py" "${evaluate[@]}" --baseline none --output "$OUT/eval_before.json"
  run eval_after 60 python3 eval_dflash.py "${evaluate[@]}" --output "$OUT/eval_after.json"

  local port=8123 server
  python3 -m transformers.cli.transformers serve "$SMOLLM2" --continuous-batching --dtype bfloat16 --device $(pick cuda cpu) \
    --port $port > "$OUT/serve_server.log" 2>&1 &
  server=$!
  for _ in $(seq $(pick 40 300)); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
  run regen_serve 60 python3 regenerate_data.py --server_url "http://localhost:$port/v1" --server_model "$SMOLLM2" "${regen[@]}" \
    --output "$OUT/regen_serve.jsonl" --num_prompts $(pick 1024 8) --server_concurrency $(pick 512 8)
  kill $server; wait $server 2>/dev/null
  python3 tools/gpu/bench_table.py "$OUT" | tee "$OUT/table.md"
}

speed_decode() {  # BEFORE_DIR TARGET_FILES
  local before files T=$ROOT/random_target
  before=$(realpath "$1")
  if [[ -n ${2:-} ]]; then
    files=$(realpath "$2")
  else  # a CPU trial: the tiny target's config and tokenizer files
    files=$OUT/tiny_files
    mkdir -p "$files"
    find "$SMOLLM2" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$files/" \;
  fi
  python3 tools/gpu/random_target.py "$files" "$T"
  head -n 4096 "$DATA_DIR/gsm8k/train.jsonl" > "$OUT/questions.jsonl"
  local evaluate=(--target_model "$T" --draft_model "$T/drafter" --data "$OUT/questions.jsonl" --max_new_tokens $(pick 128 8))
  if [[ ${EVAL:-1} != 0 ]]; then
    run eval_after 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts $(pick 5 2) --output "$OUT/eval_after.json"
    run eval_before 60 python3 "$before/eval_dflash.py" "${evaluate[@]}" --num_prompts 2 --baseline none --output "$OUT/eval_before.json"
  fi
  local regen=(--target_model "$T" --prompts "$OUT/questions.jsonl" --temperature 0 --max_new_tokens $(pick 320 16))
  run regen_before 90 python3 "$before/regenerate_data.py" "${regen[@]}" --output "$OUT/regen_before.jsonl" --num_prompts $(pick 512 8) \
    --batch_size $(pick 512 8)
  # The static-cache decode step eager (graphed) against compiled (and graphed), 4 batches of 512 each.
  run regen_eager 150 python3 regenerate_data.py "${regen[@]}" --output "$OUT/regen_eager.jsonl" --num_prompts $(pick 2048 16) \
    --batch_size $(pick 512 8) --compile_decode off
  run regen_compiled 240 python3 regenerate_data.py "${regen[@]}" --output "$OUT/regen_compiled.jsonl" --num_prompts $(pick 2048 16) \
    --batch_size $(pick 512 8) --compile_decode on
  if [[ ${EVAL:-1} != 0 ]]; then
    run eval_after_dynamic 60 python3 eval_dflash.py "${evaluate[@]}" --num_prompts 2 --baseline none --kv_cache dynamic \
      --output "$OUT/eval_after_dynamic.json"
  fi
}

speed_regen() {  # [BEFORE_DIR ...]
  head -n -$(pick 500 10) "$DATA_DIR/gsm8k/train.jsonl" > "$OUT/train_questions.jsonl"
  local regen=(--target_model "$SMOLLM2" --prompts "$OUT/train_questions.jsonl" --max_new_tokens $(pick 320 16) --batch_size $(pick 1024 8))
  local modes=(greedy) mode dir label name flags
  [[ ${SAMPLED:-0} != 0 ]] && modes+=(sampled)
  for mode in "${modes[@]}"; do
    flags=(--temperature 0)
    [[ $mode == sampled ]] && flags=(--temperature 0.8 --top_p 0.95)
    for dir in . "$@"; do
      label=this
      [[ $dir != . ]] && label=$(basename "$(realpath "$dir")")
      name=${mode}_$label
      rm -f "$OUT/$name.jsonl"  # timed from scratch, not resumed
      run "$name" 300 python3 "$dir/regenerate_data.py" "${regen[@]}" "${flags[@]}" --output "$OUT/$name.jsonl"
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
}

speed_train() {  # [BEFORE_DIR]
  local before=${1:+$(realpath "$1")} T=${TARGET:-$SMOLLM2} batch
  local common=(--target_model "$T" --mask_token_id 16 --train_data "$DATA_DIR/gsm8k/train.jsonl" --num_anchors $(pick 256 8)
                --max_seq_length $(pick 512 128) --max_steps $(pick 100 3) --logging_steps $(pick 20 1) --save_steps 0 --report_to none
                --num_proc $(pick 8 1))
  want() { [[ " ${VARIANTS:-before b32 b64 b64_trim b128_trim} " == *" $1 "* ]]; }
  if [[ -n $before ]] && want before; then
    run before 240 "${launch[@]}" "$before/train_dflash.py" "${common[@]}" --per_device_batch_size $(pick 16 1) --output_dir "$OUT/before" \
      --compile_cache_dir "$ROOT/compile_cache_before"  # a cold cache of its own: neither checkout profits from the other's compiles
  fi
  # As the quality recipe trains: one padded shape, and the target kept whole for a held-out evaluation
  # (here a short one after the last step, outside the timed windows).
  local ours=("${common[@]}" --pad_to_multiple_of $(pick 512 128) --eval_data "$DATA_DIR/gsm8k/train.jsonl" --eval_num_prompts $(pick 4 1)
              --eval_max_new_tokens $(pick 64 8))
  want b32 && run b32 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $(pick 32 2) --target_cuda_graphs --output_dir "$OUT/b32"
  local graphs
  if ! grep -qs $'^b32\t' "$OUT/steps.tsv" || grep -q $'^b32\t[0-9.]*\t0$' "$OUT/steps.tsv"; then  # b32 not run, or its graphs worked
    want b64 && run b64 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $(pick 64 4) --target_cuda_graphs \
      --output_dir "$OUT/b64"
    for batch in 64 128; do
      want b${batch}_trim && run b${batch}_trim 240 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $(pick $batch $((batch / 16))) \
        --target_cuda_graphs --anchor_slots_multiple $(pick 32 4) --output_dir "$OUT/b${batch}_trim"
    done
    graphs=(--target_cuda_graphs)
  else
    run b32_eager 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $(pick 32 2) --output_dir "$OUT/b32_eager"
    run b64_eager 180 "${launch[@]}" train_dflash.py "${ours[@]}" --per_device_batch_size $(pick 64 4) --output_dir "$OUT/b64_eager"
    graphs=()
  fi
  # The profile starts after the first 20 steps, so the CPU trial runs 25.
  [[ ${PROFILE:-1} == 1 ]] && run profile 150 "${launch[@]}" train_dflash.py "${common[@]}" --max_steps $(pick 30 25) \
    --pad_to_multiple_of $(pick 512 128) --per_device_batch_size $(pick 32 2) "${graphs[@]}" --profile_steps 5 --output_dir "$OUT/profile"
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
}

speed_$WHICH "$@"
