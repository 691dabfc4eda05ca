#!/usr/bin/env bash
# One lever at a time against a short base run of the SmolLM2 GSM8K recipe on one GPU. Base: the
# greedy replies only, 654 steps (3 epochs at batch 32, 256 anchors: the base every pass in BENCHMARKS.md
# was measured against), configs/smollm2-gsm8k-gpu.yaml with the previous recipe's optimisation
# (ABLATION_BASE, tools/gpu/helpers.sh: DFlash, AdamW 8e-4 cosine) otherwise.
# The trainings run RUNS_AT_ONCE at a time, default 2 (one batch-32 training already fills an H200:
# six side by side ran at ~240 samples/s together, one alone at 234; two let one's start-up and
# evaluation overlap the other's training, and results come in as runs finish); each evaluates
# itself at its last step on the first 64 held-out questions (block size as trained, temperature 0). Needs the recipe's replies
# (tools/gpu/smollm2_gsm8k.sh, step 1): the greedy ones, and the sampled ones for the data runs.
#
# Predictions, written before the runs (held-out tau against base):
#   epochs6      1,308 steps (6 epochs): +0.3 or more. The base's loss still falls at its end,
#                and the 820-step run of BENCHMARKS.md (tau 2.41) beat the 654-step ones (2.27-2.38).
#   layers8      8 drafter layers instead of 5: +0.1. More capacity, at a small target whose
#                features are easy to use; the step count limits more than the depth.
#   layers3      3 drafter layers: -0.1 to -0.2.
#   lr1.2e-3     learning rate 1.2e-3 instead of 8e-4: +0.0 to +0.1 on so short a schedule.
#   block8       block size 8 (evaluated at 8): -0.1. At tau ~2.4 the cap of 8 rarely binds, but
#                each anchor then trains 7 positions instead of 15.
#   late_layers  target_layer_ids 4 10 16 22 28 instead of the default spread: within +-0.1.
#   sampled1     one sampled reply per question (temperature 0.8) instead of the greedy one: -0.2.
#                Evaluation decodes greedily, so greedy replies are what the drafter must predict.
#   greedy+4     the greedy reply and four sampled ones per question, the same 654 steps: +0.0 to
#                +0.1. The same number of samples seen, more varied; the recipe's 4,360 steps on
#                them is where the volume would pay.
#   data_labels  greedy+4 trained on the replies' own tokens (--label_source data) instead of the
#                target's argmax (the config's target_argmax): -0.1 to -0.3. A sampled token differs
#                from the argmax where the target was unsure; those labels teach what greedy
#                verification rejects. On greedy replies the two label sources nearly agree.
#   The objective, one lever at a time (predictions written 2026-12-04, before the runs):
#   dpace        D-PACE position weights (alpha 0.5) instead of exp(-(k-1)/7), CE: +0.0 to +0.1. At
#                tau ~2.3 the confidences are low, so D-PACE's weights fall faster than the fixed decay
#                and put the short run's steps into the first positions, where acceptance is decided.
#   kl           KL(p||q) against the target's whole distribution instead of CE on its argmax, exp
#                weights: -0.05 to +0.1. More signal per position (the whole distribution), but
#                greedy verification accepts the argmax only.
#   tv           1 - sum min(p, q): -0.1 to 0. Its gradient is weak while q is far from p.
#   nla          -log sum min(p, q): -0.05 to +0.05.
#   lk           KL and TV blended by the acceptance (eta 3): 0 to +0.1.
#   lk_dpace     lk with D-PACE weights (speculators' setting): +0.0 to +0.15.
#   dflash2      a DFlash2 drafter (convolutions along the block, the candidate selector) at the same
#                steps: +0.05 to +0.2 at T=0, at ~10-20% more time per step. The selector conditions
#                each draft on the one before it, which DFlash's parallel argmax cannot.
#   DFlash2 against the best DFlash objective at equal H200-minutes (predictions written 2026-12-05,
#   before the runs; the step ratio 1.6 was measured with two runs sharing the GPU):
#   dflash2_dpace          DFlash2 with D-PACE weights, 654 steps: +0.1 to +0.3 over dpace (DFlash2 gave
#                          +0.54 over base with CE; the two levers overlap, both weight the early positions).
#   dflash2_dpace_minutes  the same at 410 steps (654 / 1.6, dpace's H200-minutes): -0.1 to +0.15 over dpace.
#                          Fewer steps cost (654 -> 1,308 steps gave +0.59, so 654 -> 410 about -0.3) and
#                          the selector's gain may not cover it.
#   Since 2026-12-06 the selector's loss takes the drafter loss's weights (D-PACE here) instead of the
#   fixed decay. Prediction (written before the runs): dflash2_dpace +0.05 over its value with fixed
#   selector weights; the ranking above unchanged.
#
#   bash tools/gpu/quality_ablations.sh OUT_DIR [RECIPE_DIR]        # every run
#   RUNS="base epochs6" bash tools/gpu/quality_ablations.sh OUT_DIR # some of them
#   HELD_OUT="dpace dflash2" ...   # then these runs on the recipe's 100 held-out questions at T=0 and
#                                  # at T=0.8 (top_p 1.0, seed 0), one evaluation at a time
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "$1"); RECIPE=${2:-outputs/smollm2-gsm8k-gpu}
source tools/gpu/setup.sh
source tools/gpu/helpers.sh
D=$RECIPE/data
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# One sampled reply per question: $D/sampled1.jsonl (regenerate_data.py --num_samples_per_prompt 1
# --temperature 0.8 --top_p 0.95), or else sample 0 of each question in $D/sampled4.jsonl.
S1=$D/sampled1.jsonl
if [[ ! -f $S1 && -f $D/sampled4.jsonl ]]; then
  S1=$OUT/sampled1.jsonl
  python3 -c "import json, sys; [print(line, end='') for line in open(sys.argv[1]) if json.loads(line).get('sample') == 0]" \
    "$D/sampled4.jsonl" > "$S1"
fi
declare -A flags=(
  [base]=""
  [epochs6]="--max_steps 1308"
  [layers8]="--num_draft_layers 8"
  [layers3]="--num_draft_layers 3"
  [lr1.2e-3]="--learning_rate 1.2e-3"
  [block8]="--block_size 8"
  [late_layers]="--target_layer_ids 4 10 16 22 28"
  [sampled1]="--train_data $S1"
  [greedy+4]="--train_data $D/greedy.jsonl $D/sampled4.jsonl"
  [data_labels]="--train_data $D/greedy.jsonl $D/sampled4.jsonl --label_source data"
  [dpace]="--loss_weighting dpace"
  [kl]="--loss kl"
  [tv]="--loss tv"
  [nla]="--loss nla"
  [lk]="--loss lk"
  [lk_dpace]="--loss lk --loss_weighting dpace"
  [dflash2]="--drafter dflash2"
  [dflash2_dpace]="--drafter dflash2 --loss_weighting dpace"
  [dflash2_dpace_minutes]="--drafter dflash2 --loss_weighting dpace --max_steps 410"
)
order=(base epochs6 layers8 layers3 lr1.2e-3 block8 late_layers sampled1 greedy+4 data_labels dpace kl tv nla lk lk_dpace dflash2
       dflash2_dpace dflash2_dpace_minutes)
for name in ${RUNS:-${order[@]}}; do
  case $name in sampled1) need=$S1 ;; greedy+4 | data_labels) need=$D/sampled4.jsonl ;; *) need=$D/greedy.jsonl ;; esac
  if [[ ! -f $need ]]; then
    echo "$name: skipped, no $need" | tee -a "$OUT/skipped.txt"
    continue
  fi
  # shellcheck disable=SC2086  # the flags are words
  accelerate launch --config_file accelerate_configs/1gpu.yaml train_dflash.py --config configs/smollm2-gsm8k-gpu.yaml \
    --target_model "$SMOLLM2" --train_data "$D/greedy.jsonl" --eval_data "$D/heldout_questions.jsonl" --eval_num_prompts 64 \
    --per_device_batch_size 32 --num_anchors 256 --max_steps 654 --eval_steps 0 --save_steps 0 \
    --output_dir "$OUT/$name" --overwrite_output_dir "${ABLATION_BASE[@]}" ${flags[$name]} \
    > "$OUT/$name.log" 2>&1 &
  while (($(jobs -rp | wc -l) >= ${RUNS_AT_ONCE:-2})); do sleep 2; done
done
wait
# The runs named in HELD_OUT on the recipe's held-out questions (as tools/gpu/smollm2_gsm8k.sh step 3),
# greedy and sampled; the table reads OUT_DIR/eval_<run>.json and eval_<run>_t0.8.json.
for name in ${HELD_OUT:-}; do
  for t in 0 0.8; do
    result=$OUT/eval_$name$([[ $t == 0 ]] || echo "_t$t").json
    [[ -f $result || ! -f $OUT/$name/final/model.safetensors ]] && continue
    python3 eval_dflash.py --target_model "$SMOLLM2" --draft_model "$OUT/$name/final" --data "$D/heldout_questions.jsonl" \
      --num_prompts 100 --max_new_tokens 256 --block_size 16 --baseline none --temperature $t --top_p 1.0 --seed 0 \
      --output "$result" > "${result%.json}.log" 2>&1
  done
done
python3 tools/gpu/ablation_table.py "$OUT" | tee "$OUT/table.md"
