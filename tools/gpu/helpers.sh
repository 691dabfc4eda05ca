# Shell helpers of the GPU scripts (tools/gpu/, experiments/gpu/), sourced from the repository root beside
# tools/gpu/setup.sh (which stages the machine): the timed steps and the recipe's greedy replies. They
# define functions and ABLATION_BASE; `step` and `timed` write to $OUT, recipe_greedy_replies reads setup.sh's
# DATA_DIR and SMOLLM2 when called.

# Where the previous recipe differed from configs/smollm2-gsm8k-gpu.yaml, which now trains DFlash2 with Muon:
# DFlash, AdamW 8e-4, cosine with 4% warm-up, the paper's exponential position weights, length-grouped batches,
# 6 epochs. With the config they give back the DFlash/AdamW recipe that the rows of quality_ablations.sh,
# speculators_compare.sh (optimizer_ablation.sh's rows), long_context_tau.sh and experiments/gpu/sliding_window.sh
# were measured on. A row's own flags come later and win (their --max_steps over the 6 epochs).
ABLATION_BASE=(--drafter dflash --optimizer adamw --learning_rate 8e-4 --lr_scheduler cosine --warmup_ratio 0.04
  --loss_weighting exp --batch_order length_grouped --num_train_epochs 6)

# For the benchmark scripts: run a step with a time cap, its output in $OUT/NAME.log, and append
# "NAME<TAB>seconds<TAB>exit code" to $OUT/steps.tsv (a failed or capped step does not stop the script).
step() {  # name, seconds cap, command...: log to OUT/name.log, "name seconds rc" to OUT/steps.tsv
  local name=$1 cap=$2 start ms rc=0
  shift 2
  start=$(date +%s%N)
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  printf '%s\t%d.%03d\t%d\n' "$name" $((ms / 1000)) $((ms % 1000)) "$rc" | tee -a "$OUT/steps.tsv"
}

# For the pipelines: run a step (its output where it goes), print and append "NAME<TAB>seconds<TAB>exit
# code" to $OUT/timings.tsv, and return its exit code.
timed() {  # name, command...
  local name=$1 start ms rc=0
  shift
  start=$(date +%s%N)
  "$@" || rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  printf '%s\t%d.%03d\t%d\n' "$name" $((ms / 1000)) $((ms % 1000)) "$rc" | tee -a "$OUT/timings.tsv"
  return $rc
}

# The recipe's questions and greedy replies in folder $1: the GSM8K training split less its last 500
# questions (train_questions.jsonl, answered by SmolLM2 into greedy.jsonl; regenerate_data.py skips
# replies already written) and those 500 (heldout_questions.jsonl: never regenerated or trained on).
# 1024 rows decode together (each takes the next question when its reply ends): more rows spread a
# decode step's fixed cost (the kernels of a 135M target are small, BENCHMARKS.md) over more replies.
# RECIPE_HELDOUT, RECIPE_MAX_NEW_TOKENS and RECIPE_BATCH (default 500, 320, 1024) shrink it for a tiny CPU run.
recipe_greedy_replies() {  # data folder
  local d=$1 questions=$DATA_DIR/gsm8k/train.jsonl held=${RECIPE_HELDOUT:-500}
  mkdir -p "$d"
  head -n -"$held" "$questions" > "$d/train_questions.jsonl"  # 6,973 questions
  tail -n "$held" "$questions" > "$d/heldout_questions.jsonl"
  timed regenerate_greedy python3 regenerate_data.py --target_model "$SMOLLM2" --prompts "$d/train_questions.jsonl" \
    --output "$d/greedy.jsonl" --temperature 0 --max_new_tokens "${RECIPE_MAX_NEW_TOKENS:-320}" --batch_size "${RECIPE_BATCH:-1024}"
}

# For a CPU trial (TINY=1): the first $2 GSM8K questions in $1/tinydata/gsm8k/train.jsonl and a tiny random
# Qwen3 target with the Qwen3 tokenizer (hidden 32, 4 layers, its whole vocabulary) in $1/tiny_target.
# Exports DATA_DIR, ROOT and SMOLLM2 at them: call it before sourcing setup.sh, which then keeps them.
tiny_target() {  # folder, questions
  mkdir -p "$1/tinydata/gsm8k"
  head -n "$2" "${DATA_DIR:-../shared/data}/gsm8k/train.jsonl" > "$1/tinydata/gsm8k/train.jsonl"
  export DATA_DIR=$1/tinydata ROOT=$1/root SMOLLM2=$1/tiny_target
  [[ -f $SMOLLM2/config.json ]] || python3 -c "
import sys, torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from dflash_target import find_qwen3_tokenizer_dir
tokenizer = AutoTokenizer.from_pretrained(find_qwen3_tokenizer_dir())
torch.manual_seed(0)
config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, vocab_size=151936, max_position_embeddings=1024, initializer_range=0.25,
                     eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'), pad_token_id=tokenizer.pad_token_id)
Qwen3ForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])" "$SMOLLM2"
}
