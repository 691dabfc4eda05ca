#!/usr/bin/env bash
# The levers that may explain speculators' lead, side by side on one GPU, each trained and evaluated as
# tools/gpu/speculators_compare.sh does (654 steps at batch 64 x 128 anchors on the recipe's greedy replies,
# the recipe's 100 held-out questions at T=0 and T=0.8), each in its own folder OUT/RUN:
#   spec_default          speculators 0.9.0 with its defaults (speculators_compare.sh's row)
#   base                  ours, --loss_weighting dpace (8 layers, AdamW 8e-4, cosine, 4% warmup)
#   muon                  + --optimizer muon at speculators' lr 1e-3 (weight decay 0.1 on the matrices, 0.01 on the gains)
#   muon_linear           + --lr_scheduler linear --warmup_ratio 0.01 (speculators' schedule)
#   muon_linear_sliding   + every layer sliding, window 2048 (causal inside the block, as speculators trains
#                         and as the engines serve sliding layers; the window never binds at 512 tokens)
#   muon_linear_5layers   muon_linear at speculators' 5 layers
#   dflash2_muon_linear   --drafter dflash2 with muon_linear
#   muon_linear_seed1     muon_linear with --seed 1 (a second seed for a lever worth < 0.15)
#   muon_linear_random    muon_linear with --batch_order random: each micro-batch a fresh random mix of replies, as
#                         speculators packs them, instead of replies of similar length together
#   muon_linear_wd1       muon_linear with weight decay 1.0 on the matrices (10x; the gains keep 0.01): over the run
#                         the matrices shrink by ~28% instead of ~3%, a regulariser for drafters that fit their
#                         training replies far better than held-out ones
#   muon_linear_count     muon_linear with --loss_normalize count: the weighted CE sum over the valid positions, as
#                         speculators reduces it, instead of over the sum of D-PACE weights (a per-step scale)
#   muon_linear_eager_target  muon_linear with the target eager and without CUDA graphs (--compile_target off
#                         --target_cuda_graphs false): features and labels from the kernels evaluation runs, as
#                         speculators computes them
#   muon_linear_pooled    muon_linear with --anchor_sampling pooled: 64 x 128 anchors drawn over each step's replies at
#                         once, every position with the same chance (speculators' draw over its packed row), instead
#                         of 128 per reply (all of a short one's); 256 slots a reply: ~2x the drafter's work a step
#   muon_linear_clip      muon_linear with --max_grad_norm 1.0: the raw gradient clipped before Muon's momentum, as
#                         speculators clips it (clip_grad_norm_ before torch.optim.Muon)
#   spec_adamw            speculators' row with our optimizer and schedule (AdamW 8e-4, no decay, cosine, 4% warmup):
#                         what speculators' lead owes to its optimizer, seen from its side
#   dspark_muon_linear    --drafter dspark with muon_linear's optimizer and schedule, gamma 15: the DFlash rows' 15 drafts
#                         per verify (16 tokens verified); DSpark's own loss (0.1 CE on the replies' tokens, 0.9 L1
#                         against the target, 1.0 BCE, weights exp(-k/4)), so no D-PACE and --label_source data (the
#                         replies are the target's greedy ones); its Markov and confidence heads on AdamW
#   dspark_noheads_muon_linear  the same without the Markov and confidence heads (--markov_rank 0
#                         --enable_confidence_head false): DFlash's backbone with the anchor as the first prediction
#                         slot, trained with DSpark's loss. Against dspark_muon_linear: what the heads add; against
#                         muon_linear: what the loss (and the anchor's slot) add
#   dspark_equal_minutes  dspark_muon_linear at muon_linear's minutes: 405 steps instead of 654, its schedule over
#                         those (a DSpark step costs 1.6x a DFlash one at these shapes: 4.2 against 2.6 ms/sample,
#                         BENCHMARKS.md 2026-12-07 10:13; side by side on one GPU the minutes themselves don't compare)
# Predictions, written before the first run (T=0, 100 held-out questions): spec_default 3.2-3.3; base 2.95
# (+-0.06, its repeats); muon +0.20 to +0.35 over base; muon_linear +0.0 to +0.1 over muon; sliding -0.05 to
# +0.05; 5 layers 0.10-0.18 below 8; at T=0.8 the argmax proposal +0.3 to +0.5 over sampled drafts.
# Measured (2026-12-07 09:49): spec_default 3.24, muon_linear 3.02, argmax -0.04 against sampled drafts at T=0.8.
# Predictions for the rows after it, written before their first run (T=0, same questions): muon_linear_sliding
# +0.05 to +0.15 over muon_linear; muon_linear_random -0.05 to +0.10; muon_linear_5layers -0.05 to +0.10 (fewer
# weights to fit 6,973 replies with); spec_adamw 0.10-0.25 below spec_default.
# Measured (2026-12-07 12:51): muon_linear_sliding 3.04 (+0.04 +- 0.03 paired over muon_linear); dflash2_muon_linear
# 3.35 (its selector codebooks and conv base kernels then on Muon; AdamW trains them now), its argmax proposal at
# T=0.8 -0.18 against sampled drafts. Prediction for dflash2_muon_linear rerun with them on AdamW: +0.0 to +0.15 over 3.35.
# Measured (2026-12-07 16:00): muon_linear_random 3.09 (+0.07 +- 0.03 paired over muon_linear), muon_linear_5layers
# 2.97 (-0.06 +- 0.03); dflash2_muon_linear ran out of memory beside them (GPU_GB since).
# Prediction for muon_linear_wd1, written before its first run (T=0, same questions): -0.05 to +0.10 over
# muon_linear; its training estimate lower (fits its training replies less).
# Predictions for muon_linear_count and muon_linear_eager_target, written before their first run (T=0, same
# questions): each within +-0.03 of muon_linear (Muon's update size does not follow the loss's scale; an fp32
# evaluation, a larger numeric change than eager kernels, moved tau by 0.03). muon_linear_pooled +0.0 to +0.12 over
# muon_linear (short replies' blocks stop repeating every epoch; long replies, which held-out decoding resembles
# more, get more of the anchors); both with --batch_order random would tell whether the two add up.
# Prediction for muon_linear_clip, written before its first run (T=0, same questions): -0.03 to +0.06 over muon_linear
# (Muon's update size ignores the norm; only the momentum's mix of steps changes, most in the first ~50 steps, when
# the gradient's norm falls fastest).
# Predictions for the DSpark rows, written before their first run (same questions, tau against muon_linear's 3.02
# and 2.05): the paper claims +16-18% over DFlash at T=1, llama.cpp saw no gain, and here a loss against the
# target's distribution (--loss lk) gave -0.06 at T=0 and +0.08 at T=0.8 beside CE (docs/quality.md). So:
# dspark_noheads_muon_linear -0.20 to +0.05 at T=0, -0.05 to +0.15 at T=0.8; dspark_muon_linear +0.05 to +0.30
# over dspark_noheads_muon_linear at both temperatures (the Markov term conditions each draft on the one before,
# where parallel drafts disagree most), its argmax proposal at T=0.8 within 0.1 of its sampled drafts; training
# ~1.6x muon_linear's minutes (BENCHMARKS.md, DSpark at SmolLM2 shapes: 4.2 against 2.6 ms/sample).
# dspark_equal_minutes 0.05-0.15 below dspark_muon_linear (62% of its steps; in the full recipe the 24-question
# tau rose 3.80 -> 3.91 from epoch 4 to 6).
#
#   RUNS="spec_default base muon" bash tools/gpu/optimizer_ablation.sh [OUT] [RECIPE_DIR]
#   ARGMAX_RUNS="base muon"   also evaluate these at T=0.8 with --proposal argmax (OUT/RUN/eval_argmax_t0.8.json)
#   DRAFT_TEMP_RUNS="dflash2_muon_linear" DRAFT_TEMPS="0.6 1.0"   also evaluate these at T=0.8 with the drafter's q at
#                             each draft temperature (eval_dflash.py --draft_temperature; OUT/RUN/eval_t0.8_td<T_d>.json)
#                             Every evaluation of a 135M target runs its own decode loop: two side by side cost little, five
#                             took 3-5x as long each (BENCHMARKS.md 2026-12-08 01:08)
#   FP32_RUNS="muon"          also evaluate these at T=0 in float32 (OUT/RUN/eval_fp32_t0.json): the strict lossless check
#   AT_ONCE=2                 at most this many runs at a time, started in RUNS order (default: as many as GPU_GB holds)
#   GPU_GB=76                 a run starts only when the peaks of the runs in flight (gb_of below, measured) and its own
#                             fit in this many GB (default: the first GPU's memory less 3 GB; 3 rows of 34 + 18 + 25 GB
#                             ran out of memory on an H100's 79)
#   EVAL_PROMPTS=50           evaluate on the first 50 held-out questions (default 100), every run alike
#   TINY=1 ...                the CPU trial (speculators_compare.sh's TINY settings)
# A 135M target leaves the GPU mostly idle, so runs share it; the replies are regenerated first when missing. Rerun the same command to finish what a lost machine left:
# each step skips what exists. OUT/table.md gathers every run's numbers (tools/gpu/ablation_table.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-outputs/optimizer-ablation}")
RECIPE=$(realpath -m "${2:-outputs/smollm2-gsm8k-gpu}")
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
mkdir -p "$OUT"
RUNS=${RUNS:-spec_default base muon muon_linear muon_linear_sliding}
ARGMAX_RUNS=${ARGMAX_RUNS:-}
FP32_RUNS=${FP32_RUNS:-}
DRAFT_TEMP_RUNS=${DRAFT_TEMP_RUNS:-}
TINY=${TINY:-0}
MUON_ONLY="--optimizer muon --learning_rate 1e-3"
MUON="--loss_weighting dpace $MUON_ONLY"
LINEAR="--lr_scheduler linear --warmup_ratio 0.01"
# DSpark's block of gamma drafts gamma tokens (DFlash's of B, B - 1): gamma 15 drafts as many per verify as the recipe's B 16.
# Its loss weighs its slots itself and takes CE on the data's tokens (train_dflash.py refuses dpace, target_argmax).
DSPARK="--drafter dspark --block_size 15 --label_source data"
args_of() {  # run name: our trainer's flags on top of the recipe
  case $1 in
    base) echo "--loss_weighting dpace" ;;
    muon) echo "$MUON" ;;
    muon_linear) echo "$MUON $LINEAR" ;;
    muon_linear_sliding) echo "$MUON $LINEAR --layer_types all_sliding --sliding_window 2048" ;;
    muon_linear_5layers) echo "$MUON $LINEAR --num_draft_layers 5" ;;
    dflash2_muon_linear) echo "--drafter dflash2 $MUON $LINEAR" ;;
    muon_linear_seed1) echo "$MUON $LINEAR --seed 1" ;;
    muon_linear_random) echo "$MUON $LINEAR --batch_order random" ;;
    muon_linear_wd1) echo "$MUON $LINEAR --weight_decay 1.0" ;;
    muon_linear_count) echo "$MUON $LINEAR --loss_normalize count" ;;
    muon_linear_pooled) echo "$MUON $LINEAR --anchor_sampling pooled" ;;
    muon_linear_clip) echo "$MUON $LINEAR --max_grad_norm 1.0" ;;
    muon_linear_eager_target) echo "$MUON $LINEAR --compile_target off --target_cuda_graphs false" ;;
    dspark_muon_linear) echo "$DSPARK $MUON_ONLY $LINEAR" ;;
    # after speculators_compare.sh's own --max_steps, so it wins; 62% of the TINY trial's 3 steps: 2
    dspark_equal_minutes) echo "$DSPARK $MUON_ONLY $LINEAR --max_steps $([[ $TINY == 1 ]] && echo 2 || echo 405)" ;;
    dspark_noheads_muon_linear) echo "$DSPARK --markov_rank 0 --enable_confidence_head false $MUON_ONLY $LINEAR" ;;
    *) echo "optimizer_ablation.sh: unknown run $1" >&2; return 2 ;;
  esac
}
for run in $RUNS; do [[ $run == spec_* ]] || args_of "$run" > /dev/null || exit 2; done
gb_of() {  # run name: its training's peak GPU memory in GB, as measured at these shapes (BENCHMARKS.md), rounded up
  case $1 in
    spec_*) echo 40 ;;
    dflash2_*) echo 35 ;;
    dspark_*) echo 30 ;;
    *5layers*) echo 17 ;;
    *pooled*) echo 40 ;;  # twice the anchor slots: not yet measured, the block stream's memory doubled
    *) echo 25 ;;
  esac
}
if [[ -z ${GPU_GB:-} ]]; then
  total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -1)
  GPU_GB=$([[ $TINY == 1 || -z $total_mib ]] && echo 1000000 || echo $((total_mib / 1024 - 3)))
fi

# 1. The replies, once, before the runs that all read them.
if [[ $TINY != 1 && ! -f $RECIPE/data/greedy.jsonl ]]; then
  recipe_greedy_replies "$RECIPE/data" || exit 1
fi

# 2. Every run side by side; a run's extra evaluations follow its own training.
MAX_NEW=$([[ $TINY == 1 ]] && echo 24 || echo 256)
PROMPTS=$([[ $TINY == 1 ]] && echo 2 || echo "${EVAL_PROMPTS:-100}")  # speculators_compare.sh reads EVAL_PROMPTS too
HELDOUT=$([[ $TINY == 1 ]] && echo data/demo_heldout_prompts.jsonl || echo "$RECIPE/data/heldout_questions.jsonl")
extra_eval() {  # run, name, eval_dflash.py flags...
  local run=$1 name=$2 drafter
  shift 2
  drafter=$([[ $run == spec_* ]] && echo "$OUT/$run/$run/zlab" || echo "$OUT/$run/ours_best/final")
  [[ -f $OUT/$run/eval_$name.json || ! -d $drafter ]] && return 0
  python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$drafter" --data "$HELDOUT" --num_prompts "$PROMPTS" \
    --max_new_tokens "$MAX_NEW" --baseline none --seed 0 --output "$OUT/$run/eval_$name.json" "$@" > "$OUT/$run/eval_$name.log" 2>&1
}
declare -A run_gb=()  # pid of a run in flight -> its peak GB
for run in $RUNS; do
  need=$(gb_of "$run")
  while :; do  # wait until the runs in flight leave room for this one (and AT_ONCE allows one more)
    in_flight=0
    for pid in "${!run_gb[@]}"; do
      if kill -0 "$pid" 2> /dev/null; then in_flight=$((in_flight + run_gb[$pid])); else unset "run_gb[$pid]"; fi
    done
    ((${#run_gb[@]} == 0 || (in_flight + need <= GPU_GB && ${#run_gb[@]} < ${AT_ONCE:-1000}))) && break
    sleep 1
  done
  (
    if [[ $run == spec_* ]]; then
      ROWS=$run CALL_SECONDS=100000 bash tools/gpu/speculators_compare.sh "$OUT/$run" "$RECIPE"
    else
      ROWS=ours_best BEST_ARGS="$(args_of "$run")" CALL_SECONDS=100000 bash tools/gpu/speculators_compare.sh "$OUT/$run" "$RECIPE"
    fi
    [[ " $ARGMAX_RUNS " == *" $run "* ]] && extra_eval "$run" argmax_t0.8 --temperature 0.8 --top_p 1.0 --proposal argmax &
    [[ " $FP32_RUNS " == *" $run "* ]] && extra_eval "$run" fp32_t0 --temperature 0 --dtype float32 &
    if [[ " $DRAFT_TEMP_RUNS " == *" $run "* ]]; then
      for td in ${DRAFT_TEMPS:-0.6 1.0}; do extra_eval "$run" "t0.8_td$td" --temperature 0.8 --top_p 1.0 --draft_temperature "$td" --target_reference false & done
    fi
    wait
  ) > "$OUT/$run.log" 2>&1 &
  run_gb[$!]=$need
  echo "optimizer_ablation.sh: $run started ($need GB expected; $((in_flight + need)) of $GPU_GB GB in flight)"
done
wait
python3 tools/gpu/ablation_table.py --runs "$OUT" $RUNS | tee "$OUT/table.md"
